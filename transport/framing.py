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

from .errors import TransportError

MAGIC = b"SGF1"
_HEADER = struct.Struct(">4s32sIII")
HEADER_BYTES = _HEADER.size
DEFAULT_MAX_PAYLOAD = 256 * 1024
"""Default largest MQTT payload the drivers publish (frames above it are chunked). Far below
Mosquitto's and the embedded broker's limits, and what managed brokers commonly accept."""
MIN_MAX_PAYLOAD = HEADER_BYTES + 16
MAX_MESSAGE_BYTES = (1 << 32) - 1


class FrameError(TransportError, ValueError):
    """A payload that is not a valid frame, or one that does not fit its chunk set."""


def frame(message: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD,
          digest: bytes | None = None) -> list[bytes]:
    """Split ``message`` into frames of at most ``max_payload`` bytes each; ``digest``: its
    ``message_id`` when the caller already computed it (a 4 MiB chunk is not hashed
    twice)."""
    if max_payload < MIN_MAX_PAYLOAD:
        raise ValueError(f"max_payload={max_payload}: need at least {MIN_MAX_PAYLOAD} bytes "
                         f"(the {HEADER_BYTES}-byte frame header plus data)")
    total = len(message)
    if total > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {total} bytes exceeds the framing limit of 4 GiB")
    if digest is None:
        digest = hashlib.sha256(message).digest()
    step = max_payload - HEADER_BYTES
    count = max(1, -(-total // step))
    view = memoryview(message)
    return [_HEADER.pack(MAGIC, digest, i, count, total) + view[i * step:(i + 1) * step]
            for i in range(count)]


def message_id(message: bytes) -> bytes:
    """The id frames carry for ``message`` (its sha256)."""
    return hashlib.sha256(message).digest()


CHUNK_OVERHEAD = 480
"""Bytes charged per buffered chunk on top of its whole frame (header included: the chunk is
kept as a view into its frame): the frame's bytes object, the memoryview, its slot in the
message's dict. Measured with tracemalloc (CPython 3.11: 407-427 B besides the frame's
bytes; ``tests/security/test_transport_fairness.py`` checks the charge against it), so a
sender pays for tiny chunks what they really cost in memory."""
PARTIAL_OVERHEAD = 1024
"""Bytes charged per incomplete message (its ``_Partial``, dict, keys and index entries;
measured about 770 B)."""


def chunk_charge(frame_bytes: int) -> int:
    """What one buffered chunk arriving in a frame of ``frame_bytes`` bytes is charged."""
    return frame_bytes + CHUNK_OVERHEAD


@dataclass
class _Partial:
    total: int
    count: int
    step: int  # the length of every chunk but the last
    created: float
    chunks: dict[int, memoryview] = field(default_factory=dict)
    size: int = 0
    charged: int = PARTIAL_OVERHEAD


def _chunk_step(index: int, count: int, total: int, length: int) -> int:
    """The full chunk size a well-formed chunk set has, from one of its chunks; raises
    ``FrameError`` when no sender using full-size chunks could have produced it."""
    if index < count - 1:
        step = length
    else:  # the last chunk: the others share total - length bytes equally
        rest = total - length
        if rest <= 0 or rest % (count - 1):
            raise FrameError("chunks are not full-size (the last chunk does not fit)")
        step = rest // (count - 1)
    if step <= 0 or -(-total // step) != count or total - step * (count - 1) <= 0:
        raise FrameError(f"chunk of {length} bytes does not fit {count} full-size chunks of "
                         f"a {total}-byte message")
    return step


@dataclass(frozen=True)
class Reassembled:
    """A complete message: its bytes and its id (sha256)."""

    digest: bytes
    payload: bytes


def round_reassembler(max_message_bytes: int, senders: int, max_payload: int,
                      control_bytes: int = 0) -> Reassembler:
    """The reassembly a round's server needs: every sender can have one whole message of up
    to ``max_message_bytes`` (plus, ``control_bytes``, one notice) in flight, charged to its
    own quota, and the pool is the sum of the quotas, so no sender, honest or not, can evict
    another's honest message (``tests/security/test_transport_reassembly.py``). A sender's
    second partial message of the same size is its own to lose."""
    step = max(1, max_payload - HEADER_BYTES)

    def charge(message_bytes: int) -> int:  # a message in full-size frames, as charged
        return (message_bytes + PARTIAL_OVERHEAD
                + chunk_charge(HEADER_BYTES) * (message_bytes // step + 1))

    quota = charge(max_message_bytes) + (charge(control_bytes) if control_bytes else 0)
    return Reassembler(max_message_bytes, max_partial=2, max_sender_bytes=quota,
                       max_buffered_bytes=max(1, senders) * quota)


class Reassembler:
    """Collects frames per sender and returns each message when it is complete.

    Bounds (a sender that breaks them loses only its own partial messages):

    * ``max_message_bytes`` per message (callers pass the largest valid message for the
      topic, or a smaller ``max_message_bytes`` per call);
    * per quota key (``quota``, by default the sender): at most ``max_partial`` incomplete
      messages (its oldest is evicted) and ``max_sender_bytes`` bytes charged, each chunk
      counting its frame's length plus ``CHUNK_OVERHEAD`` (``chunk_charge``: what it
      costs in memory) and each message ``PARTIAL_OVERHEAD``;
    * ``max_buffered_bytes`` charged overall;
    * incomplete messages older than ``ttl`` seconds are discarded, oldest first, in
      constant time per expired message.

    Chunk sets must use full-size chunks: every chunk but the last has the same length and
    the count is what that length implies (what :func:`frame` produces).
    """

    def __init__(self, max_message_bytes: int, *, max_partial: int = 4,
                 max_buffered_bytes: int = 512 << 20, max_sender_bytes: int | None = None,
                 ttl: float = 120.0) -> None:
        if max_message_bytes <= 0 or max_partial <= 0 or max_buffered_bytes <= 0:
            raise ValueError("Reassembler limits must be positive")
        self.max_message_bytes = max_message_bytes
        self.max_partial = max_partial
        self.max_buffered_bytes = max_buffered_bytes
        self.max_sender_bytes = (max_sender_bytes if max_sender_bytes is not None else
                                 max_partial * (max_message_bytes + PARTIAL_OVERHEAD)
                                 + chunk_charge(HEADER_BYTES) * 1024)
        self.ttl = ttl
        self._partial: dict[tuple[Hashable, bytes], tuple[Hashable, _Partial]] = {}
        self._by_quota: dict[Hashable, OrderedDict[tuple[Hashable, bytes], None]] = {}
        self._charged: dict[Hashable, int] = {}
        self._expiry: OrderedDict[tuple[Hashable, bytes], float] = OrderedDict()
        self._buffered = 0
        self._charged_total = 0

    @property
    def buffered_bytes(self) -> int:
        """Chunk bytes held in incomplete messages."""
        return self._buffered

    @property
    def charged_bytes(self) -> int:
        """What the quotas count: chunk bytes plus per-chunk and per-message overhead."""
        return self._charged_total

    def feed(self, sender: Hashable, data: bytes, now: float,
             max_message_bytes: int | None = None, *,
             quota: Hashable | None = None) -> Reassembled | None:
        """Add one frame from ``sender``; the message if this frame completed it.

        ``quota`` names whose quota the buffered bytes count against (default ``sender``;
        the server passes the client, whatever topic the frame came on). Raises
        ``FrameError`` for a frame that is malformed, oversized, not full-size, or
        inconsistent with the other frames of its message (that message is discarded).
        """
        limit = self.max_message_bytes if max_message_bytes is None else max_message_bytes
        if len(data) < HEADER_BYTES:
            raise FrameError(f"payload of {len(data)} bytes is shorter than a frame header")
        magic, digest, index, count, total = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise FrameError("payload does not start with the frame magic")
        if not isinstance(data, bytes):
            data = bytes(data)  # a view into mutable memory could change under us
        chunk = memoryview(data)[HEADER_BYTES:]  # kept as a view: one copy, in the join
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
        owner = sender if quota is None else quota
        key = (sender, digest)
        entry = self._partial.get(key)
        if entry is None:
            step = _chunk_step(index, count, total, len(chunk))
            partial = self._open(owner, key, _Partial(total, count, step, now))
        else:
            partial = entry[1]
            if partial.total != total or partial.count != count:
                self._discard(key)
                raise FrameError("chunk disagrees with earlier chunks of its message")
        expected = partial.step if index < count - 1 else total - partial.step * (count - 1)
        if len(chunk) != expected:
            self._discard(key)
            raise FrameError(f"chunk {index} has {len(chunk)} bytes, not the {expected} "
                             "full-size chunking gives")
        if index in partial.chunks:
            return None  # a duplicate chunk (QoS 1 redelivery or re-publish)
        cost = chunk_charge(len(data))
        if self._charged[owner] + cost > self.max_sender_bytes:
            self._discard(key)
            raise FrameError(f"the sender's reassembly quota ({self.max_sender_bytes} bytes) "
                             "is used up")
        if self._charged_total + cost > self.max_buffered_bytes:
            self._discard(key)
            raise FrameError(f"reassembly buffers are full ({self._charged_total} bytes)")
        partial.chunks[index] = chunk
        partial.size += len(chunk)
        partial.charged += cost
        self._buffered += len(chunk)
        self._charged[owner] += cost
        self._charged_total += cost
        if len(partial.chunks) < count:
            return None
        self._discard(key)
        payload = b"".join(partial.chunks[i] for i in range(count))
        if hashlib.sha256(payload).digest() != digest:
            raise FrameError("reassembled message does not match its length and sha256")
        return Reassembled(digest, payload)

    def _open(self, owner: Hashable, key: tuple[Hashable, bytes],
              partial: _Partial) -> _Partial:
        mine = self._by_quota.setdefault(owner, OrderedDict())
        while len(mine) >= self.max_partial:
            self._discard(next(iter(mine)))  # the sender's own oldest goes
            mine = self._by_quota.setdefault(owner, OrderedDict())
        if self._charged.get(owner, 0) + PARTIAL_OVERHEAD > self.max_sender_bytes:
            raise FrameError(f"the sender's reassembly quota ({self.max_sender_bytes} bytes) "
                             "is used up")
        mine[key] = None
        self._partial[key] = (owner, partial)
        self._expiry[key] = partial.created
        self._charged[owner] = self._charged.get(owner, 0) + PARTIAL_OVERHEAD
        self._charged_total += PARTIAL_OVERHEAD
        return partial

    def _discard(self, key: tuple[Hashable, bytes]) -> None:
        entry = self._partial.pop(key, None)
        if entry is None:
            return
        owner, partial = entry
        self._expiry.pop(key, None)
        self._buffered -= partial.size
        self._charged_total -= partial.charged
        self._charged[owner] -= partial.charged
        mine = self._by_quota[owner]
        del mine[key]
        if not mine:
            del self._by_quota[owner], self._charged[owner]

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry:
            key, created = next(iter(expiry.items()))
            if now - created <= self.ttl:
                return
            self._discard(key)
