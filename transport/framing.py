"""The envelope every transport payload travels in, and chunking for large messages.

Each MQTT payload is one frame::

    b"SGF1" | sha256(message) (32) | chunk index (u32) | chunk count (u32) | total length (u32)
    | chunk bytes

The message id *is* the sha256 of the whole message, so a QoS 1 redelivery or a deliberate
re-publish of the same message carries the same id and reassembles to the same bytes: the
drivers handle duplicates idempotently without any sender-side state. Reassembly buffers are
bounded (bytes per message, partial messages per sender, bytes overall, age) and anything
inconsistent raises ``FrameError``, which the drivers log and drop: garbage, truncated,
oversized or spliced payloads never reach a state machine.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

MAGIC = b"SGF1"
_HEADER = struct.Struct(">4s32sIII")
HEADER_BYTES = _HEADER.size
DEFAULT_MAX_PAYLOAD = 256 * 1024
"""Default largest MQTT payload the drivers publish (frames above it are chunked). Far below
Mosquitto's and the embedded broker's limits, and what managed brokers commonly accept."""
MIN_MAX_PAYLOAD = HEADER_BYTES + 16
MAX_MESSAGE_BYTES = (1 << 32) - 1


class FrameError(ValueError):
    """A payload that is not a valid frame, or one that does not fit its chunk set."""


def frame(message: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD) -> list[bytes]:
    """Split ``message`` into frames of at most ``max_payload`` bytes each."""
    if max_payload < MIN_MAX_PAYLOAD:
        raise ValueError(f"max_payload={max_payload}: need at least {MIN_MAX_PAYLOAD} bytes "
                         f"(the {HEADER_BYTES}-byte frame header plus data)")
    total = len(message)
    if total > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {total} bytes exceeds the framing limit of 4 GiB")
    digest = hashlib.sha256(message).digest()
    step = max_payload - HEADER_BYTES
    count = max(1, -(-total // step))
    view = memoryview(message)
    return [_HEADER.pack(MAGIC, digest, i, count, total) + view[i * step:(i + 1) * step]
            for i in range(count)]


def message_id(message: bytes) -> bytes:
    """The id frames carry for ``message`` (its sha256)."""
    return hashlib.sha256(message).digest()


@dataclass
class _Partial:
    total: int
    count: int
    created: float
    chunks: dict[int, bytes] = field(default_factory=dict)
    size: int = 0


@dataclass(frozen=True)
class Reassembled:
    """A complete message: its bytes and its id (sha256)."""

    digest: bytes
    payload: bytes


class Reassembler:
    """Collects frames per sender and returns each message when it is complete.

    ``max_message_bytes`` bounds one message (callers pass the largest valid message for the
    topic); at most ``max_partial`` incomplete messages are kept per sender (the oldest is
    evicted) and ``max_buffered_bytes`` overall; incomplete messages older than ``ttl``
    seconds are discarded.
    """

    def __init__(self, max_message_bytes: int, *, max_partial: int = 4,
                 max_buffered_bytes: int = 512 << 20, ttl: float = 120.0) -> None:
        if max_message_bytes <= 0 or max_partial <= 0 or max_buffered_bytes <= 0:
            raise ValueError("Reassembler limits must be positive")
        self.max_message_bytes = max_message_bytes
        self.max_partial = max_partial
        self.max_buffered_bytes = max_buffered_bytes
        self.ttl = ttl
        self._partial: dict[Hashable, OrderedDict[bytes, _Partial]] = {}
        self._buffered = 0

    @property
    def buffered_bytes(self) -> int:
        return self._buffered

    def feed(self, sender: Hashable, data: bytes, now: float,
             max_message_bytes: int | None = None) -> Reassembled | None:
        """Add one frame from ``sender``; the message if this frame completed it.

        Raises ``FrameError`` for a frame that is malformed, oversized, or inconsistent
        with the other frames of its message (that message's partial set is discarded).
        """
        limit = self.max_message_bytes if max_message_bytes is None else max_message_bytes
        if len(data) < HEADER_BYTES:
            raise FrameError(f"payload of {len(data)} bytes is shorter than a frame header")
        magic, digest, index, count, total = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise FrameError("payload does not start with the frame magic")
        chunk = data[HEADER_BYTES:]
        if total > limit:
            raise FrameError(f"message of {total} bytes exceeds the {limit}-byte limit")
        if count < 1 or index >= count or count > max(1, total):
            raise FrameError(f"inconsistent chunk header: index {index} of {count}, "
                             f"{total} bytes")
        if len(chunk) > total:
            raise FrameError("chunk is longer than its message")
        if count == 1:
            if len(chunk) != total:
                raise FrameError(f"single-chunk message has {len(chunk)} of {total} bytes")
            if hashlib.sha256(chunk).digest() != digest:
                raise FrameError("message does not match its sha256")
            return Reassembled(digest, bytes(chunk))
        self._expire(now)
        sets = self._partial.setdefault(sender, OrderedDict())
        partial = sets.get(digest)
        if partial is None:
            if len(sets) >= self.max_partial:
                _, evicted = sets.popitem(last=False)
                self._buffered -= evicted.size
            partial = sets[digest] = _Partial(total, count, now)
        elif partial.total != total or partial.count != count:
            self._discard(sender, digest)
            raise FrameError("chunk disagrees with earlier chunks of its message")
        if index in partial.chunks:
            return None  # a duplicate chunk (QoS 1 redelivery or re-publish)
        if partial.size + len(chunk) > total:
            self._discard(sender, digest)
            raise FrameError("chunks add up to more than the message length")
        if self._buffered + len(chunk) > self.max_buffered_bytes:
            self._discard(sender, digest)
            raise FrameError(f"reassembly buffers are full ({self._buffered} bytes)")
        partial.chunks[index] = bytes(chunk)
        partial.size += len(chunk)
        self._buffered += len(chunk)
        if len(partial.chunks) < count:
            return None
        self._discard(sender, digest)
        payload = b"".join(partial.chunks[i] for i in range(count))
        if len(payload) != total or hashlib.sha256(payload).digest() != digest:
            raise FrameError("reassembled message does not match its length and sha256")
        return Reassembled(digest, payload)

    def _discard(self, sender: Hashable, digest: bytes) -> None:
        sets = self._partial.get(sender)
        if sets is None:
            return
        partial = sets.pop(digest, None)
        if partial is not None:
            self._buffered -= partial.size
        if not sets:
            del self._partial[sender]

    def _expire(self, now: float) -> None:
        for sender in list(self._partial):
            for digest, partial in list(self._partial[sender].items()):
                if now - partial.created > self.ttl:
                    self._discard(sender, digest)
