"""The server's upload slots (docs/protocol.md 6.3): which senders may stream a masked
input now, where each stream stands, and the memory the masked inputs take.

A masked input arrives whole (one ``MaskedInput``, no slot needed) or in ``MaskedChunk``s
from a sender granted a slot. A stream is pending, never in the sum, until its last chunk
is in: a partial input cannot be unmasked without revealing it. The memory is the sum plus
at most ``slots`` pending vectors, never n (``slots = max(1, budget // vector bytes)``); a
finished stream's buffer is reused by the next one.

:class:`Uploads` decides only where a chunk falls in its stream (granted, in order, on the
grant's chunk grid, or held ahead of a gap); what a chunk says (its width, values, peers
and signature) is checked by the server (``secagg/server.py``) before it is written here.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Container, Iterable
from dataclasses import dataclass, field

import numpy as np

from .messages import MaskedChunk

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

    def __init__(self, dim: int, dtype: np.dtype, budget: int) -> None:
        if budget < 1:
            raise ValueError("upload_budget must be a positive number of bytes")
        self._dim = dim
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

    def place(self, client_id: int, offset: int, count: int, last: bool
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

    def write(self, client_id: int, upload: Upload | None, raw: bytes, offset: int,
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
