"""Red team of the Flower adapter's chunked masked input (fl/flower/chunks.py), at small d.

A hostile node through ``LocalGrid`` answers the masked-input request with chunks that
play dtype games (big-endian, signed with negatives, float with NaN, pickled objects, a
``.npy`` body that contradicts the declared dtype or shape) or that declare a huge array in
a few bytes (an allocation bomb): each is a ``ChunkError`` naming the chunk, the node is a
dropout at masked_input and the round sums the others exactly. A malicious server that
asks one node twice for its masked input with another chunk length gets the same vector
(re-cut), never a second masked input.
"""

from __future__ import annotations

import io
import resource
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.serverapp.strategy import FedAvg

from fl.flower import SecureAggregation
from fl.flower.chunks import CHUNK, MASKED
from fl.flower.local import LocalGrid
from fl.flower.records import RECORD
from tests.flower import apps
from tests.flower.test_adapter import _malicious
from tests.flower.test_chunks import _first_chunk, _keys, _one_round, _tampering_mod

pytestmark = pytest.mark.timeout(60)


def _npy(dtype: str, shape: tuple[int, ...], body: bytes) -> bytes:
    """A ``.npy`` header declaring ``dtype`` and ``shape``, then ``body``."""
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        out, {"descr": dtype, "fortran_order": False, "shape": shape})
    return out.getvalue() + body


def _declared(data: bytes, dtype: str = "uint32", shape: tuple[int, ...] = (7,)) -> Array:
    return Array(dtype=dtype, shape=shape, stype="numpy.ndarray", data=data)


# the round is 32-bit at 7 elements per chunk (tests/flower/test_chunks.py::_one_round)
# a .npy header that does not describe the declared array is refused before it is parsed
DESCRIBES_ANOTHER = "its bytes describe another array than the declared uint32 (7,)"
GAMES: dict[str, tuple[Array, str]] = {
    "big-endian uint32": (Array(np.arange(7, dtype=">u4")), "has dtype"),
    "signed with negatives": (Array(-np.ones(7, np.int32)), "has dtype"),
    "float32 with NaN": (Array(np.full(7, np.nan, np.float32)), "has dtype"),
    "pickled objects": (_declared(b"\x80\x04junk", dtype="object"), "has dtype"),
    "declared uint32, body big-endian": (
        _declared(_npy(">u4", (7,), bytes(28))), DESCRIBES_ANOTHER),
    "declared uint32, body int32": (
        _declared(_npy("<i4", (7,), b"\xff" * 28)), DESCRIBES_ANOTHER),
    "declared uint32, body float32 NaN": (
        _declared(_npy("<f4", (7,), b"\xff" * 28)), DESCRIBES_ANOTHER),
    "declared uint32, body of objects": (
        _declared(_npy("|O", (7,), b"\x80\x04junk")), DESCRIBES_ANOTHER),
    "declared (7,), body (7, 1)": (
        _declared(_npy("<u4", (7, 1), bytes(28))), DESCRIBES_ANOTHER),
    "declared (7,), body of 2**31 elements": (
        _declared(_npy("<u4", (1 << 31,), bytes(28))), DESCRIBES_ANOTHER),
    "declared (7,), body of 2**60 elements": (
        _declared(_npy("<u4", (1 << 60,), bytes(28))), DESCRIBES_ANOTHER),
    "declared (2**30,)": (_declared(bytes(28), shape=(1 << 30,)), "expected (7,)"),
    "a zero-dimensional chunk": (_declared(_npy("<u4", (), bytes(4)), shape=()),
                                 "expected (7,)"),
}


@pytest.mark.parametrize("case", sorted(GAMES))
def test_dtype_and_shape_games_in_a_chunk_are_refused(case: str) -> None:
    array, reason = GAMES[case]
    grid = LocalGrid(None, 5)
    hostile = grid.nodes[3]
    grid.app = apps.client_app(None, [_tampering_mod(
        {hostile}, lambda r: _first_chunk(r, array)), apps.open_mod])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = _one_round(grid)
    # an allocation bomb costs no memory: the peak RSS grew by far less than its claim
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB
    assert report.dropped == {hostile: "masked_input"}
    assert report.included == frozenset(grid.nodes) - {hostile}
    ((node, why),) = report.chunk_rejected
    assert node == hostile and reason in why, why


def test_a_second_request_with_another_chunk_length_is_refused() -> None:
    """A malicious server sends one node the masked-input request twice, the second time
    asking for one-element chunks: the node keeps neither its input nor its masked vector
    once masked (secagg.resume), so it refuses the second request (an error reply naming
    why) and the server learns nothing it did not have; the first answer counts and the
    round completes."""
    grid = LocalGrid(None, 5)
    grid.app = apps.client_app()
    victim = grid.nodes[2]
    deliver = grid.deliver
    refusals: list[str] = []

    def twice(message: Message) -> Message | None:
        record = message.content.config_records.get(RECORD)
        if message.metadata.dst_node_id != victim or record is None or CHUNK not in record:
            return deliver(message)
        again = message_from_proto(message_to_proto(message))
        first = deliver(message)
        again.content[RECORD] = ConfigRecord({**dict(record.items()), CHUNK: 1})
        second = deliver(again)
        assert first is not None and not first.has_error() and MASKED in first.content
        assert second is not None and second.has_error() and not second.has_content()
        refusals.append(second.error.reason)
        return first

    report: Any = _one_round(grid, twice)
    assert len(refusals) == 1 and "sent its masked input" in refusals[0], refusals
    assert victim in report.included


UNTYPED: dict[str, Any] = {
    "a dtype numpy refuses with ValueError": lambda r: _first_chunk(
        r, _declared(bytes(28), dtype="m8[as/0]")),
    "an offset of 5000 digits": lambda r: _keys(r, {"7": "9" * 5000}),
}


@pytest.mark.parametrize("case", sorted(UNTYPED))
def test_every_malformed_chunk_is_a_chunk_error(case: str) -> None:
    """A dtype numpy refuses with ValueError, an offset key int() refuses: a ChunkError
    in report.chunk_rejected like every other layout error (was an untyped ValueError)."""
    grid = LocalGrid(None, 5)
    hostile = grid.nodes[1]
    grid.app = apps.client_app(None, [_tampering_mod({hostile}, UNTYPED[case]),
                                      apps.open_mod])
    report = _one_round(grid)
    assert report.dropped == {hostile: "masked_input"}
    assert [node for node, _ in report.chunk_rejected] == [hostile]


def test_malicious_mode_a_node_answering_with_another_nodes_chunks_is_refused() -> None:
    """Malicious mode: node B's masked-input chunks arrive under node A's reply (an
    untrusted relay splices them; the layout is valid): A's envelope signature covers its
    own vector, so the server refuses A with a typed reason and sums the others exactly."""
    grid, _, keys = _malicious(7)
    donor, victim = grid.nodes[1], grid.nodes[4]
    deliver = grid.deliver
    chunks: dict[int, ArrayRecord] = {}

    def splicing(message: Message) -> Message | None:
        reply = deliver(message)
        node = message.metadata.dst_node_id
        if reply is not None and not reply.has_error() and MASKED in reply.content:
            chunks[node] = reply.content[MASKED]
            if node == victim:  # the donor was asked first (nodes go in order)
                reply.content[MASKED] = chunks[donor]
        return reply

    grid.deliver = splicing  # type: ignore[method-assign]
    wrapper = SecureAggregation(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=7), neighbors=None,
        security="malicious", verify_keys={n: k.public for n, k in keys.items()})
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    (report,) = wrapper.reports
    assert report.dropped == {victim: "masked_input"}
    assert report.included == frozenset(grid.nodes) - {victim}
    assert any(node == victim and "signature" in why for node, why in report.rejected)
    assert np.array_equal(report.total, apps.expected_total(report))
