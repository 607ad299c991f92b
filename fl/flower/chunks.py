"""A node's masked input as chunked ``ArrayRecord`` entries, and their checked reassembly.

A masked input is most of a round's bytes (``d`` elements of ``bits`` bits: 40 MB at
``d = 10^7`` and 32 bits). It does not travel as one ``bytes`` value of the adapter's
``ConfigRecord`` (one Flower object, one gRPC message of up to Flower's 2 GiB limit, copied
whole at every hop) but as an ``ArrayRecord`` under :data:`MASKED` whose entries are the
vector's chunks in their natural width (``uint32`` for a 32-bit sum, ``uint16`` for 16
bits: never widened to ``uint64``). Flower moves each entry as its own object, in pieces of
at most ``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE`` (5 MiB in flwr 1.42), so no gRPC message of a
round carries more than a chunk. The ``ConfigRecord``'s ``msg`` carries the masked input's
**envelope**: the secagg ``MaskedInput`` wire message with the vector left out (``dim`` 1
and one zero element, as the wire format needs a vector), i.e. the session, client id,
bits, peers digest and, in malicious mode, the signature over the whole vector.

The server fixes the chunk length per round (``SecureAggregation(chunk_bytes=...)``) and
sends it, in elements, with the message that asks for the masked input (:data:`CHUNK`), so
a node's reply has exactly one layout: entry ``str(offset)`` holds elements
``[offset, offset + chunk)`` (the last one shorter), offsets ``0, chunk, 2 chunk, ...``
below ``d``. :func:`assemble` accepts nothing else: more entries than the round's ``d``
makes (refused before any is parsed), a missing or misplaced entry, a key that is not the
decimal offset (``"07"``: a second spelling of an offset; Flower's serde already keeps one
entry per key, so a key listed twice on the wire arrives once), a wrong dtype or length, an
entry whose bytes outgrow its shape or whose ``.npy`` header describes another array (both
refused before parsing), or a malformed envelope is a
:class:`ChunkError` that names what is wrong, raised before any of that node's data is
used; the round goes on without that node (a dropout at ``masked_input``), and every
other node's reply is checked on its own: nothing is shared between nodes but the round's
running sum, so one node's chunks cannot evict or starve another's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from fl.errors import FLError
from secagg import SecAggError, decode, encode
from secagg.crypto import dtype_for_bits
from secagg.messages import CLIENT_KINDS, MaskedInput

MASKED = "secagg.masked"
"""The ``ArrayRecord`` of a masked-input reply: the vector's chunks, keyed by offset."""
CHUNK = "chunk"
"""Key in the adapter's ``ConfigRecord`` of the server's masked-input request: the chunk
length in elements."""
DEFAULT_CHUNK_BYTES = 4 << 20
"""Chunk bytes by default: under Flower's 5 MiB ``ArrayChunk`` with the ``.npy`` header,
so each chunk crosses Flower's transport as one object."""
MAX_CHUNKS = 1 << 16
"""The most chunks a masked input may be cut into (the server refuses a smaller chunk
length; a node refuses a request for more): bounds the entries either side handles."""
MAX_CHUNK_BYTES = 1 << 30
"""The largest chunk (under gRPC's 2 GiB message limit, with room)."""
_ENVELOPE_BYTES = 1024  # an envelope is ~150 bytes (~220 with a signature)
_NPY_HEADER = 256  # the .npy header of one chunk (Flower's Array serialisation)


class ChunkError(FLError, ValueError):
    """A masked input's chunks do not have the round's layout (or a node was asked for a
    layout it refuses); the message says what is wrong."""


def chunk_elements(chunk_bytes: int, bits: int, dim: int) -> int:
    """Elements per chunk for a round of ``dim`` elements of ``bits`` bits, from the
    server's ``chunk_bytes`` (longer if that would make more than :data:`MAX_CHUNKS`
    chunks; :class:`ChunkError` if it is not in 1..:data:`MAX_CHUNK_BYTES`)."""
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or not (
            0 < chunk_bytes <= MAX_CHUNK_BYTES):
        raise ChunkError(f"chunk_bytes={chunk_bytes!r}: give the bytes of one masked-input "
                         f"chunk, 1..{MAX_CHUNK_BYTES}")
    width = dtype_for_bits(bits).itemsize
    # never more than MAX_CHUNKS chunks: a larger vector gets longer chunks
    elements = max(1, chunk_bytes // width, math.ceil(dim / MAX_CHUNKS))
    return check_layout(elements, bits, dim)


def check_layout(chunk: object, bits: int, dim: int) -> int:
    """``chunk`` as a valid chunk length (elements) for the round, else :class:`ChunkError`."""
    width = dtype_for_bits(bits).itemsize
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ChunkError(f"the masked-input chunk length must be a positive number of "
                         f"elements, got {chunk!r}")
    if chunk * width > MAX_CHUNK_BYTES:
        raise ChunkError(f"a chunk of {chunk} elements is {chunk * width} bytes, more than "
                         f"{MAX_CHUNK_BYTES}; lower chunk_bytes")
    if math.ceil(dim / chunk) > MAX_CHUNKS:
        raise ChunkError(f"a chunk of {chunk} elements cuts d={dim} into "
                         f"{math.ceil(dim / chunk)} chunks, more than {MAX_CHUNKS}; raise "
                         "chunk_bytes")
    return chunk


def offsets(dim: int, chunk: int) -> range:
    return range(0, dim, chunk)


def envelope(message: MaskedInput) -> bytes:
    """The masked input's wire message with the vector left out (one zero element)."""
    width = dtype_for_bits(message.bits).itemsize
    return encode(dataclasses.replace(message, dim=1, masked=bytes(width)))


def answer_digest(message: MaskedInput) -> bytes:
    """What a node's stage record keeps of its masked-input answer (``fl.flower.guard``):
    the envelope and a digest of the vector, without re-encoding the vector."""
    return envelope(message) + hashlib.sha256(message.masked).digest()


def to_records(message: MaskedInput, chunk: int) -> tuple[bytes, Any]:
    """A masked input as (envelope, ``ArrayRecord`` of its chunks, natural width). Each
    chunk is a view of the masked bytes until Flower serialises it (one copy)."""
    from flwr.app import Array, ArrayRecord

    vector = message.vector()
    check_layout(chunk, message.bits, message.dim)
    return envelope(message), ArrayRecord(
        {str(start): Array(vector[start:start + chunk]) for start in offsets(message.dim,
                                                                             chunk)})


def chunks_of(content: Any, dim: int, bits: int, chunk: int
              ) -> Iterator[tuple[int, np.ndarray]]:
    """The (offset, chunk) pairs of a reply's :data:`MASKED` record, in order, each checked
    against the round's layout before it is parsed; :class:`ChunkError` otherwise."""
    dtype = dtype_for_bits(bits)
    others = set(content.array_records.keys()) - {MASKED}
    if others:
        raise ChunkError(f"the masked-input reply carries other array records "
                         f"({sorted(others)[:3]}); only {MASKED!r} is accepted")
    record = content.array_records.get(MASKED)
    if record is None:
        raise ChunkError(f"the masked-input reply carries no {MASKED!r} array record")
    expected = offsets(dim, chunk)
    if len(record) > len(expected):
        raise ChunkError(f"{len(record)} chunks is more than the {len(expected)} this "
                         f"round's d={dim} makes at {chunk} elements per chunk")
    seen = set()
    for key in record:
        # at most as many digits as d (int() refuses over 4300 digits with a ValueError)
        start = (int(key) if isinstance(key, str) and key.isascii() and key.isdigit()
                 and len(key) <= len(str(dim)) else -1)
        if str(start) != key or start >= dim or start % chunk:
            raise ChunkError(f"chunk key {str(key)[:32]!r} is not an offset of this round (the "
                             f"multiples of {chunk} below d={dim}, in decimal)")
        seen.add(start)
    if len(seen) != len(expected):  # keys are unique and valid: only fewer is left
        missing = [s for s in expected if s not in seen][:3]
        raise ChunkError(f"the masked input has {len(seen)} of its {len(expected)} chunks "
                         f"(missing offsets {missing}...)")
    for start in expected:
        array = record[str(start)]
        length = min(chunk, dim - start)
        if not _is_dtype(array.dtype, dtype):
            raise ChunkError(f"chunk at offset {start} has dtype {array.dtype}; this round's "
                             f"{bits}-bit vector travels as {dtype.name}")
        if list(array.shape) != [length] or len(array.data) > length * dtype.itemsize \
                + _NPY_HEADER:
            raise ChunkError(f"chunk at offset {start} has shape {tuple(array.shape)}; "
                             f"expected ({length},)")
        try:  # the .npy header's own shape and dtype first: np.load allocates by them
            if _npy_header(array.data) != ((length,), False, dtype):
                raise ChunkError(f"chunk at offset {start}: its bytes describe another "
                                 f"array than the declared {dtype.name} ({length},)")
            values = array.numpy()
        except ChunkError:
            raise
        except Exception as exc:  # malformed .npy bytes
            raise ChunkError(f"chunk at offset {start} is not a valid array: "
                             f"{type(exc).__name__}") from None
        if values.dtype != dtype or values.shape != (length,):
            raise ChunkError(f"chunk at offset {start} holds {values.dtype} {values.shape}, "
                             f"not its declared {dtype.name} ({length},)")
        yield start, values


def assemble(content: Any, payload: bytes, dim: int, bits: int, chunk: int) -> MaskedInput:
    """The whole ``MaskedInput`` of a chunked reply (its envelope ``payload`` and the
    chunks in ``content``), for ``secagg.Server.receive``; :class:`ChunkError` if the
    envelope or any chunk does not fit the round. Only this node's vector is built here
    (one buffer), and it reaches the secagg server only if every chunk checked out."""
    try:
        head = decode(payload, max_bytes=_ENVELOPE_BYTES, max_vector_bytes=8,
                      kinds=CLIENT_KINDS)
    except (ValueError, SecAggError) as exc:
        raise ChunkError(f"the masked input's envelope is malformed: {exc}") from None
    if not isinstance(head, MaskedInput) or head.dim != 1:
        raise ChunkError("the masked input's envelope must be a MaskedInput with the vector "
                         "left out (dim 1)")
    if head.bits != bits:
        raise ChunkError(f"the masked input has bits={head.bits}; the round uses {bits}")
    dtype = dtype_for_bits(bits)
    vector = np.empty(dim, dtype=dtype)
    for start, values in chunks_of(content, dim, bits, chunk):
        vector[start:start + len(values)] = values
    # a view of the buffer, not a copy: Server.receive encodes it once
    return dataclasses.replace(head, dim=dim, masked=vector.data.cast("B"))


def _npy_header(data: bytes) -> tuple[Any, Any, Any]:
    """(shape, fortran order, dtype) of ``.npy`` bytes, read without allocating the array."""
    stream = io.BytesIO(data)
    version = np.lib.format.read_magic(stream)
    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
            else np.lib.format.read_array_header_2_0)
    shape, fortran_order, dtype = read(stream)
    return shape, fortran_order, dtype


def _is_dtype(name: object, dtype: np.dtype[Any]) -> bool:
    try:
        return isinstance(name, str) and np.dtype(name) == dtype
    except (TypeError, ValueError):  # not a dtype name, or one numpy cannot build
        return False
