"""The server's upload slots (docs/protocol.md 6.3): which senders may stream a masked
input now, where each stream stands, and the memory the masked inputs take.

A masked input arrives whole (one ``MaskedInput``, no slot needed) or in ``MaskedChunk``s
from a sender granted a slot. A stream is pending, never in the sum, until its last chunk
is in: a partial input cannot be unmasked without revealing it. The memory is the sum plus
at most ``slots`` pending vectors, never n (``slots = max(1, budget // vector bytes)``); a
finished stream's buffer is reused by the next one.

:class:`Uploads` takes each chunk (:meth:`Uploads.take`): it checks where the chunk falls in
its stream (granted, in order, on the grant's chunk grid, or held ahead of a gap) and what
it says (its width, values, peers and, on the last, the signature over the whole stream)
before anything changes. Which senders may send one at all (the stage, the roster, an input
proof first) is the server's state machine (``secagg/server.py``).
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field

import numpy as np

from .crypto import CryptoError, constant_time_equal, dtype_for_bits
from .messages import MaskedChunk, MaskedInput
from .transcripts import masked_input_hash

DEFAULT_UPLOAD_BUDGET = 1 << 30
"""Bytes the server sets aside for masked inputs that are still streaming in (pending: not
in the sum until complete, docs/protocol.md 6.3); ``upload_budget // vector bytes`` senders
stream at once (at least one). 1 GiB: every sender at once up to 2.6 x 10^7 32-bit
elements, two at a time at 10^8."""


@dataclass(eq=False)
class Upload:
    """A granted sender's masked input while it streams in: pending, never in the sum
    until its last chunk arrived (a partial input cannot be unmasked without revealing
    it, docs/protocol.md 6.3)."""

    chunk: int | None = None  # the granted chunk length (elements); None: any
    vector: np.ndarray | None = None  # allocated by the first chunk
    next: int = 0  # the element offset the next chunk must start at
    running: hashlib._Hash | None = None  # malicious mode: SHA-256 of the stream so far
    last_raw: bytes = b""  # the latest accepted chunk (its redelivery is a no-op)
    held: dict[int, tuple[MaskedChunk, bytes]] = field(default_factory=dict)
    """Chunks that arrived ahead of ``next`` (offset -> chunk), on the grant's chunk grid:
    taken in order once the gap is filled (a broker restart re-delivers a cut chunk after
    its successor). Each offset once, so they never hold more than one input."""

    def hold(self, offset: int, msg: MaskedChunk, raw: bytes) -> bool:
        """Keep a chunk that is ahead of the stream until the gap before it is filled:
        ``True`` when it is new, ``False`` for a redelivery of a held chunk. Raises
        ``ValueError`` for a second, different chunk at a held offset."""
        held = self.held.get(offset)
        if held is not None:
            if held[1] == raw:
                return False
            raise ValueError(f"a second, different chunk at element {offset}")
        self.held[offset] = (msg, raw)
        return True

    def next_held(self) -> tuple[MaskedChunk, bytes] | None:
        """The held chunk that starts where the stream stands now (taken out), if any."""
        return self.held.pop(self.next, None)


class Uploads:
    """The masked inputs of one round as they arrive: the upload slots, each pending
    stream, and the sum that complete inputs are added to (``sum``; holds nothing
    meaningful while ``empty``)."""

    def __init__(self, dim: int, bits: int, budget: int) -> None:
        if budget < 1:
            raise ValueError("upload_budget must be a positive number of bytes")
        dtype = dtype_for_bits(bits)
        self._dim, self._bits = dim, bits
        self.slots = max(1, budget // (dim * dtype.itemsize))
        """How many senders may stream a masked input at once (``grant``)."""
        self._streams: dict[int, Upload] = {}  # granted senders whose input is pending
        # stage masked_input: ids not yet granted an upload slot, a heap (lowest id first),
        # built at the first grant; each id leaves it once (``grant``)
        self._queue: list[int] | None = None
        # the running sum of complete masked inputs; holds nothing meaningful until the
        # first one is added (``empty``): that one is copied or swapped in, not added to
        # zeros (first-touching a fresh 400 MB vector costs more than the adds)
        self.sum = np.empty(dim, dtype=dtype)
        self.empty = True
        self._spares: list[np.ndarray] = []  # finished pending buffers, reused

    # --- slots ----------------------------------------------------------------------------

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._streams

    def ids(self) -> frozenset[int]:
        """The senders holding a slot (a copy)."""
        return frozenset(self._streams)

    def get(self, client_id: int) -> Upload | None:
        return self._streams.get(client_id)

    def grant(self, pending: set[int], client_ids: Iterable[int] | None,
              exclude: Container[int], chunk_elements: int | None) -> list[int]:
        """Give free slots to ``pending`` clients (of ``client_ids``, default all; none in
        ``exclude``; lowest id first) and return them (``Server.grant_uploads``). Without
        ``client_ids`` a call costs O((granted + excluded ids met) log n): the queue of
        ids is a heap built at the first call of the stage."""
        free = self.slots - len(self._streams)
        if free <= 0:
            return []
        granted: list[int] = []
        if client_ids is not None:
            eligible = (pending & set(client_ids)) - self._streams.keys()
            for cid in sorted(eligible):
                if len(granted) == free:
                    break
                if cid not in exclude:
                    self._streams[cid] = Upload(chunk_elements)
                    granted.append(cid)
            return granted
        if self._queue is None:
            self._queue = sorted(pending - self._streams.keys())  # a heap
        queue, passed = self._queue, []
        while queue and len(granted) < free:
            cid = heapq.heappop(queue)
            # granted once or no longer expected: neither is ever eligible again this stage
            # (an upload ends in the inbox or in a cancel, which drops the client)
            if cid not in pending or cid in self._streams:
                continue
            if cid in exclude:
                passed.append(cid)  # for a later call
                continue
            self._streams[cid] = Upload(chunk_elements)
            granted.append(cid)
        for cid in passed:
            heapq.heappush(queue, cid)
        return granted

    def cancel(self, client_id: int) -> bool:
        """Take back ``client_id``'s slot, its pending chunks discarded; False when it held
        none."""
        return self._streams.pop(client_id, None) is not None

    def new_stage(self) -> None:
        """A stage opens: the grant queue is built again at its first grant."""
        self._queue = None

    def close(self) -> list[tuple[int, Upload]]:
        """The stage closes: the streams that did not complete (by id; they never count),
        every slot freed and the spare buffers let go."""
        cut = sorted(self._streams.items())
        self._streams.clear()
        self._spares.clear()
        return cut

    # --- chunks ---------------------------------------------------------------------------

    def take(self, client_id: int, msg: MaskedInput | MaskedChunk, raw: bytes, *,
             peers: bytes, verify: Callable[[bytes, bytes], None] | None
             ) -> tuple[bool, tuple[MaskedInput | MaskedChunk, bytes] | None]:
        """One chunk of ``client_id``'s masked input (a ``MaskedInput`` is the chunk [0,
        dim)), checked whole before anything changes (``peers``: the digest of the peers the
        server forwarded it; ``verify(stream digest, signature)``, malicious mode only,
        raises ``CryptoError``), then held pending, and added to the sum only when the
        sender's last chunk completes it; a held chunk that the stream reaches is taken too.

        Returns whether the chunk is new (``False``: a redelivery of a held chunk) and, once
        the input is complete, the message and bytes that completed it. Raises
        ``ValueError`` saying why the chunk is refused."""
        bits, dim = self._bits, self._dim
        if msg.bits != bits or msg.dim != dim:
            raise ValueError(f"masked input has bits={msg.bits}, dim={msg.dim}; the round "
                             f"uses bits={bits}, dim={dim}")
        offset = msg.offset if isinstance(msg, MaskedChunk) else 0
        vector = msg.vector()
        count = vector.shape[0]
        if isinstance(msg, MaskedInput) and len(msg.masked) != dim * self.sum.dtype.itemsize:
            raise ValueError("masked input has the wrong length")
        last = offset + count == dim
        upload, ahead = self._place(client_id, offset, count, last)
        if bits < 8 * self.sum.dtype.itemsize and int(vector.max()) >> bits:
            raise ValueError(f"masked input has values >= 2**{bits}")
        if not constant_time_equal(msg.peers_digest, peers):
            raise ValueError("the client masked with other peers than the server forwarded "
                             "(the ciphertext list was altered)")
        if verify is not None and msg.signature and not last:
            raise ValueError("a signature on a chunk that is not the last")
        if verify is None and msg.signature:
            raise ValueError("a signature in a semi-honest round")
        if ahead:
            assert upload is not None and isinstance(msg, MaskedChunk)
            return upload.hold(offset, msg, raw), None  # False: a redelivery of a held chunk
        self._accept(client_id, upload, msg, raw, offset, vector, last, verify)
        while upload is not None and not last and (held := upload.next_held()) is not None:
            msg, raw = held
            vector = msg.vector()
            last = msg.offset + vector.shape[0] == dim
            self._accept(client_id, upload, msg, raw, msg.offset, vector, last, verify)
        return True, (msg, raw) if last else None

    def _accept(self, client_id: int, upload: Upload | None, msg: MaskedInput | MaskedChunk,
                raw: bytes, offset: int, vector: np.ndarray, last: bool,
                verify: Callable[[bytes, bytes], None] | None) -> None:
        """The chunk at the stream's offset, checked by :meth:`take`: the running digest
        and, on the last, the signature; then into the pending buffer (the sum)."""
        running = None
        if verify is not None:
            running = (upload.running.copy()
                       if upload is not None and upload.running is not None
                       else masked_input_hash(self._bits, self._dim, msg.peers_digest))
            running.update(msg.masked)
            if last:
                try:
                    verify(running.digest(), msg.signature)
                except CryptoError as exc:
                    raise ValueError(f"the masked_input signature is invalid (another "
                                     f"round's, or its chunks were altered, spliced, "
                                     f"reordered or cut): {exc}") from None
        self._write(client_id, upload, raw, offset, vector, last, running)  # cannot fail

    def _place(self, client_id: int, offset: int, count: int, last: bool
              ) -> tuple[Upload | None, bool]:
        """Where ``count`` elements at element ``offset`` fall in ``client_id``'s input
        (``last``: they end it): its stream (``None`` for a whole input sent without a
        slot) and whether the chunk is ahead of the stream on the grant's chunk grid (to
        :meth:`Upload.hold`). Raises ``ValueError`` saying why the chunk is out of place;
        changes nothing."""
        upload = self._streams.get(client_id)
        ahead = False
        if offset or not last:
            if upload is None:
                raise ValueError(f"no upload slot is granted to this client: a streamed "
                                 f"masked input waits for the server's grant ({self.slots} "
                                 f"at a time)")
            # ahead of the stream on the grant's chunk grid: held, not refused
            ahead = (offset > upload.next and upload.chunk is not None
                     and offset % upload.chunk == 0)
            if offset != upload.next and not ahead:
                raise ValueError(f"a chunk at element {offset}, but the stream is at element "
                                 f"{upload.next} (chunks come in order, each once; one "
                                 f"ahead on the grant's chunk grid waits for the gap)")
            if upload.chunk is not None and (count > upload.chunk if last
                                             else count != upload.chunk):
                raise ValueError(f"a chunk of {count} elements; the grant is for chunks of "
                                 f"{upload.chunk} (only the last may be shorter)")
        elif upload is not None and upload.next:
            raise ValueError(f"a whole masked input while its stream is at element "
                             f"{upload.next}")
        return upload, ahead

    def _write(self, client_id: int, upload: Upload | None, raw: bytes, offset: int,
              vector: np.ndarray, last: bool, running: hashlib._Hash | None) -> None:
        """An accepted chunk at the stream's position (:meth:`place`) into its pending
        buffer; the last one completes the input, which goes into the sum and frees the
        slot. Nothing here can fail."""
        if offset == 0 and last:
            self._add(vector)
            self._streams.pop(client_id, None)
            return
        assert upload is not None
        if upload.vector is None:  # a buffer of an earlier upload, or a new one
            upload.vector = (self._spares.pop() if self._spares
                             else np.empty(self._dim, dtype=self.sum.dtype))
        upload.vector[offset:offset + vector.shape[0]] = vector
        upload.next, upload.running, upload.last_raw = offset + vector.shape[0], running, raw
        if last:
            spare = self._add(upload.vector, owned=True)
            if len(self._spares) < self.slots:
                self._spares.append(spare)
            del self._streams[client_id]

    def _add(self, vector: np.ndarray, *, owned: bool = False) -> np.ndarray:
        """Add a complete masked input to the sum. The first one becomes the sum (swapped
        in when the buffer is the server's own, ``owned``); returns the buffer now free."""
        if not self.empty:
            np.add(self.sum, vector, out=self.sum)
            return vector
        self.empty = False
        if owned:
            free, self.sum = self.sum, vector
            return free
        self.sum[:] = vector
        return vector
