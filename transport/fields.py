"""The one msgpack codec for control-plane maps, and field-by-field checks of them.

Used by everything that decodes a map from a peer: the round control messages
(:mod:`transport.control`), the round task (:mod:`fl.contribution`) and the federation
messages (:mod:`fl.remote.messages`). :func:`unpack_map` decodes with every msgpack limit
set from the message's size before anything is allocated; each caller names the error type
its readers catch (``error=``) and how a field is called in messages (``what=``); anything
of the wrong type or out of range raises it, so a hostile peer can make a party refuse a
message, never crash it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgpack  # type: ignore[import-untyped]  # msgpack ships no type information

from .errors import TransportError

MAX_SITE_ID = (1 << 32) - 1
MAX_ROSTER = 1 << 16


class FieldError(TransportError, ValueError):
    """A field is missing, of the wrong type or out of range."""


def integer(body: Mapping[Any, Any], key: str, low: int = 0, high: int = MAX_SITE_ID, *,
            error: type[ValueError] = FieldError, what: str = "field") -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise error(f"{what} {key!r} must be an integer in [{low}, {high}]")
    return value


def number(body: Mapping[Any, Any], key: str, low: float = 0.0, high: float = math.inf, *,
           low_open: bool = False, error: type[ValueError] = FieldError,
           what: str = "field") -> float:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{what} {key!r} must be a number")
    value = float(value)
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        raise error(f"{what} {key!r}={value} is out of range")
    return value


def text(body: Mapping[Any, Any], key: str, choices: tuple[str, ...] = (),
         limit: int = 4096, *, error: type[ValueError] = FieldError,
         what: str = "field") -> str:
    value = body.get(key)
    if not isinstance(value, str) or len(value) > limit or (choices and value not in choices):
        raise error(f"{what} {key!r} must be " + (f"one of {choices}" if choices
                                                   else "a string"))
    return value


def raw(body: Mapping[Any, Any], key: str, sizes: tuple[int, ...] = (), *,
        error: type[ValueError] = FieldError, what: str = "field") -> bytes:
    value = body.get(key)
    if not isinstance(value, bytes) or (sizes and len(value) not in sizes):
        raise error(f"{what} {key!r} must be {' or '.join(map(str, sizes)) or 'some'} bytes")
    return value


def site_ids(body: Mapping[Any, Any], key: str, *, error: type[ValueError] = FieldError,
             what: str = "field") -> tuple[int, ...]:
    value = body.get(key)
    if not isinstance(value, list) or len(value) > MAX_ROSTER or not all(
            isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_SITE_ID
            for v in value):
        raise error(f"{what} {key!r} must be a list of site ids")
    if len(set(value)) != len(value):
        raise error(f"{what} {key!r} repeats a site id")
    return tuple(sorted(value))


def names(body: Mapping[Any, Any], key: str, *, error: type[ValueError] = FieldError,
          what: str = "field") -> tuple[str, ...]:
    value = body.get(key)
    if not isinstance(value, list) or len(value) > 100_000 or not all(
            isinstance(v, str) and len(v) <= 1024 for v in value):
        raise error(f"{what} {key!r} must be a list of strings")
    return tuple(value)


def pack_map(body: Mapping[str, Any]) -> bytes:
    """``body`` as a msgpack map (bytes as bin, strings as str)."""
    data: bytes = msgpack.packb(dict(body), use_bin_type=True)
    return data


def unpack_map(data: bytes, limit: int, *, error: type[ValueError] = FieldError,
               max_entries: int = 64, max_array_len: int = 1 << 20,
               max_str_len: int = 1 << 16, what: str = "message") -> dict[Any, Any]:
    """Decode a msgpack map of at most ``limit`` bytes; anything else raises ``error``."""
    if len(data) > limit:
        raise error(f"{what} of {len(data)} bytes exceeds {limit}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False, max_bin_len=len(data),
                               max_str_len=max_str_len, max_array_len=max_array_len,
                               max_map_len=max_entries)
    except Exception as exc:  # msgpack raises several unrelated types
        raise error(f"{what} is not msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise error(f"{what} is not a map")
    return body
