"""A client's masked input, streamed: ``MaskedStream`` expands y = x + masks mod 2^bits one
window at a time (stage masked_input), and ``SentMaskedInput`` stands in for a masked input
sent before a snapshot (secagg/resume.py). Built by ``secagg.client.Client``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import cast

import numpy as np

from .config import Config
from .crypto import Masker, SigningKey, dtype_for_bits
from .errors import ProtocolError
from .messages import InputProof, MaskedChunk, MaskedInput
from .stage import Stage
from .transcripts import SIGNED_TAGS, masked_input_hash, transcript


class MaskedStream:
    """A client's masked input y = x + masks mod 2^bits (stage masked_input), produced
    chunk by chunk: ``chunks(elements)`` yields ``MaskedChunk`` messages in order, each
    expanding every mask over its own window only (AES-CTR seeks), so the client never
    holds more than one window of y; ``whole()`` is the one-chunk case as a ``MaskedInput``
    (what ``Client.handle`` returns). The same bytes come out every time and for every
    chunking: a transport may restart the stream. In malicious mode the last chunk is
    signed over the running SHA-256 of the whole stream (docs/protocol.md 5.7, 6.3).

    Built by ``Client`` with everything it reads: the input ``vector``, the mask ``keys``
    (each with its sign), the round's ids and width, the ``signer`` (malicious mode) and ``over``,
    which says why the client's round is over (its input wiped) so the stream stops."""

    def __init__(self, vector: np.ndarray, keys: list[tuple[bytearray, bool]],
                 peers: bytes, key_set: bytes, proof: InputProof | None = None, *,
                 session_id: bytes, client_id: int, bits: int, signer: SigningKey | None,
                 over: Callable[[], ProtocolError | None]) -> None:
        self._input = vector
        self.proof = proof
        """With ``norm_bound``: the ``InputProof`` a transport sends before the masked
        input (docs/protocol.md 10); ``None`` otherwise."""
        self._keys = keys
        self.peers_digest = peers
        self._key_set = key_set
        self._whole: MaskedInput | None = None
        self._session_id, self._client_id = session_id, client_id
        self._signer = signer
        self._over = over
        self.dim = int(vector.shape[0])
        self.bits = bits

    @property
    def nbytes(self) -> int:
        """The bytes of the whole masked vector."""
        return self.dim * dtype_for_bits(self.bits).itemsize

    def chunks(self, elements: int) -> Iterator[MaskedChunk]:
        """The masked input as chunks of ``elements`` elements (the last may be shorter)."""
        if not isinstance(elements, int) or elements < 1:
            raise ValueError(f"chunks of {elements!r} elements: use a positive integer")
        sid, me, dim, bits = self._session_id, self._client_id, self.dim, self.bits
        window = min(elements, dim)
        masker = Masker(window, bits)
        signer = self._signer
        running = masked_input_hash(bits, dim, self.peers_digest) if signer else None
        top = masker.dtype.type((1 << bits) - 1) if bits < 8 * masker.dtype.itemsize else None
        for start in range(0, dim, window):
            over = self._over()
            if over is not None:
                raise over
            count = min(window, dim - start)
            x = self._input[start:start + count]
            y = np.empty(count, dtype=masker.dtype)  # each chunk its own bytes
            for i, (key, added) in enumerate(self._keys):
                stream = masker.keystream(bytes(key), start, count)
                # the first mask is added to x straight into y: no separate copy of x
                (np.add if added else np.subtract)(x if i == 0 else y, stream, out=y)
            if top is not None:
                np.bitwise_and(y, top, out=y)
            data = cast(bytes, y.data.cast("B").toreadonly())
            signature = b""
            if running is not None and signer is not None:
                running.update(data)
                if start + count == dim:
                    signature = signer.sign(transcript(
                        SIGNED_TAGS[MaskedInput], sid, Stage.MASKED_INPUT, me,
                        running.digest(), self._key_set))
            yield MaskedChunk(sid, me, bits, dim, start, data, self.peers_digest, signature)

    def whole(self) -> MaskedInput:
        """The masked input as one ``MaskedInput`` (the same object every time)."""
        if self._whole is None:
            chunk = next(iter(self.chunks(self.dim)))
            self._whole = MaskedInput(chunk.session_id, chunk.client_id, self.bits, self.dim,
                                      chunk.masked, self.peers_digest, chunk.signature)
        return self._whole


class SentMaskedInput(MaskedStream):
    """The reply cache's entry, after a restore, for a masked input this client sent before
    its snapshot: neither the input nor the masked vector is kept (``secagg.resume``), so
    the same request again is refused (``ProtocolError``; the client stays as it is)
    instead of answered."""

    def __init__(self, config: Config, client_id: int) -> None:
        self._client_id = client_id
        self.dim, self.bits = config.dim, config.bits

    def _gone(self) -> ProtocolError:
        return ProtocolError(
            f"client {self._client_id} sent its masked input before its state was "
            "saved; the saved state keeps only the request's digest (no input, no masked "
            "vector), so the same request is not answered again",
            stage=Stage.MASKED_INPUT, client_id=self._client_id)

    def chunks(self, elements: int) -> Iterator[MaskedChunk]:
        raise self._gone()

    def whole(self) -> MaskedInput:
        raise self._gone()
