"""The canonical msgpack subset of the wire format (docs/protocol.md section 6): how values
are written, and a reader that accepts only their canonical encoding.

The reader reads a message directly from its bytes: every header is checked (type, minimal
form, count against the bytes left and the limit for the kind) before anything is
allocated, so a hostile message costs at most a small multiple of its size and time linear
in it. It accepts only the canonical encoding, so one message has one byte string (no
re-encoding to compare). Which fields a message has: ``secagg/messages.py``.
"""

from __future__ import annotations

from typing import Any, cast

import msgpack  # type: ignore[import-untyped]

from .crypto import SIGNATURE_BYTES
from .errors import DecodeError

MAX_CLIENT_ID = (1 << 32) - 1


def pack_value(value: Any) -> bytes:
    """``value`` in msgpack (bins as bin, never str: canonical for the values we write)."""
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def array_header(count: int) -> bytes:
    return bytes([0x90 + count]) if count < 16 else b"\xdc" + count.to_bytes(2, "big")


def fail(what: str) -> DecodeError:
    return DecodeError(f"malformed message: {what}")


_UINT = {0xCC: (1, 1 << 7), 0xCD: (2, 1 << 8), 0xCE: (4, 1 << 16), 0xCF: (8, 1 << 32)}
_BIN = {0xC4: (1, 0), 0xC5: (2, 1 << 8), 0xC6: (4, 1 << 16)}
_ARRAY = {0xDC: (2, 16), 0xDD: (4, 1 << 16)}
_MAP = {0xDE: (2, 16), 0xDF: (4, 1 << 16)}


class Reader:
    """A cursor over one message's bytes that accepts only canonical msgpack."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def _take(self, size: int, what: str) -> int:
        start = self.pos
        if start + size > len(self.data):
            raise fail(f"truncated at {what}")
        self.pos = start + size
        return start

    def _length(self, table: dict[int, tuple[int, int]], lead: int, what: str) -> int:
        size, smallest = table[lead]
        start = self._take(size, what)
        value = int.from_bytes(self.data[start:start + size], "big")
        if value < smallest:
            raise fail(f"{what} is not in canonical form (a wider length than needed)")
        return value

    def uint(self, what: str) -> int:
        lead = self.data[self._take(1, what)]
        if lead < 0x80:
            return lead
        if lead not in _UINT:
            raise fail(f"{what} must be a non-negative integer")
        return self._length(_UINT, lead, what)

    def _bin_size(self, what: str, length: int | None) -> int:
        """The length of the bin that starts here (``length``: exactly that many bytes)."""
        lead = self.data[self._take(1, what)]
        if lead not in _BIN:
            raise fail(f"{what} must be bytes")
        size = self._length(_BIN, lead, what)
        if length is not None and size != length:
            raise fail(f"{what} must be {length} bytes, got {size}")
        return size

    def view(self, what: str, length: int | None, *, limit: int = 1 << 62,
             multiple: int = 1) -> bytes:
        """A bin of exactly ``length`` bytes (or, ``None``: 1 to ``limit`` bytes, a multiple
        of ``multiple``) as a read-only view into the message (no copy: the masked vector
        is most of a round's bytes)."""
        size = self._bin_size(what, length)
        if length is None and not (0 < size <= limit and size % multiple == 0):
            raise fail(f"{what} of {size} bytes: it must be 1 to {limit} bytes, whole "
                        f"{multiple}-byte elements, ending at or before dim")
        start = self._take(size, what)
        return cast(bytes, memoryview(self.data)[start:start + size])

    def bin(self, what: str, length: int | None = None, *, limit: int = 1 << 62) -> bytes:
        size = self._bin_size(what, length)
        if size > limit:
            raise fail(f"{what} has {size} bytes, more than {limit}")
        start = self._take(size, what)
        return self.data[start:start + size]

    def _count(self, table: dict[int, tuple[int, int]], low: int, high: int, what: str,
               kind: str, limit: int, entry_bytes: int) -> int:
        lead = self.data[self._take(1, what)]
        if low <= lead < high:
            count = lead - low
        elif lead in table:
            count = self._length(table, lead, what)
        else:
            raise fail(f"{what} must be {kind}")
        if count > limit:
            raise fail(f"{what} has {count} entries, more than {limit}")
        if count * entry_bytes > len(self.data) - self.pos:
            raise fail(f"{what} claims {count} entries but the message is too short")
        return count

    def array(self, what: str, limit: int, entry_bytes: int = 1) -> int:
        return self._count(_ARRAY, 0x90, 0xA0, what, "an array", limit, entry_bytes)

    def map(self, what: str, limit: int, entry_bytes: int = 2) -> int:
        return self._count(_MAP, 0x80, 0x90, what, "a map of client id to value", limit,
                           entry_bytes)

    def client_id(self, what: str) -> int:
        value = self.uint(what)
        if not 1 <= value <= MAX_CLIENT_ID:
            raise fail(f"{what} must be a client id in 1..{MAX_CLIENT_ID}")
        return value

    def signature(self, what: str) -> bytes:
        sig = self.bin(what, limit=SIGNATURE_BYTES)
        if len(sig) not in (0, SIGNATURE_BYTES):
            raise fail(f"{what} must be empty or {SIGNATURE_BYTES} bytes")
        return sig

    def blob_map(self, length: int, what: str, limit: int) -> dict[int, bytes]:
        """A map id -> bin of exactly ``length`` bytes, ids strictly ascending."""
        count = self.map(what, limit, 2 + length)
        out: dict[int, bytes] = {}
        header = bin_header(length)
        span = len(header) + length
        data, pos, last = self.data, self.pos, 0
        # one tight loop: this runs for every entry of every share list (n^2 per round)
        for _ in range(count):
            lead = data[pos] if pos < len(data) else -1
            if 0 < lead < 0x80:
                key, pos = lead, pos + 1
            elif lead in (0xCC, 0xCD, 0xCE):
                self.pos = pos
                key = self.client_id(f"{what} key")
                pos = self.pos
            else:
                raise fail(f"{what} key must be a client id in 1..{MAX_CLIENT_ID}")
            if key <= last:
                raise fail(f"{what} repeats a key or is not sorted by id (canonical form)")
            last = key
            if data[pos:pos + len(header)] != header or pos + span > len(data):
                raise fail(f"{what} value must be {length} bytes")
            out[key] = data[pos + len(header):pos + span]
            pos += span
        self.pos = pos
        return out

    def id_list(self, what: str, limit: int) -> tuple[int, ...]:
        count = self.array(what, limit)
        ids: list[int] = []
        data, pos, last = self.data, self.pos, 0
        end = len(data)
        # one tight loop (an unmasking request lists every survivor: n ids for each of n
        # clients); canonical 1- and 2-byte ids inline, anything else through client_id
        for _ in range(count):
            lead = data[pos] if pos < end else -1
            if 0 < lead < 0x80:
                value, pos = lead, pos + 1
            elif lead == 0xCD and pos + 3 <= end and data[pos + 1]:
                value, pos = (data[pos + 1] << 8) | data[pos + 2], pos + 3
            else:
                self.pos = pos
                value = self.client_id(what)
                pos = self.pos
            if value <= last:
                raise fail(f"{what} must be sorted and must not repeat a client id")
            last = value
            ids.append(value)
        self.pos = pos
        return tuple(ids)


def bin_header(length: int) -> bytes:
    """The canonical msgpack header of a bin of ``length`` bytes."""
    if length < 1 << 8:
        return bytes([0xC4, length])
    if length < 1 << 16:
        return b"\xc5" + length.to_bytes(2, "big")
    return b"\xc6" + length.to_bytes(4, "big")
