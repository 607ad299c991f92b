"""Model-sized updates through the Flower adapter (fl.flower.chunks), at small d: a node's
masked input travels as an ArrayRecord of chunks in the sum's natural width and sums
exactly whatever the chunk length (one dividing d or not, one element, the whole vector) at
16, 32 and 64 bits with dropouts at every stage; a node whose chunks do not have the round's
layout (missing, extra, misplaced, re-spelled, duplicated, wrong dtype or length, oversized,
no envelope) is rejected with a ChunkError naming it and the round completes for the
others; a node refuses a chunk request it cannot honour."""

from __future__ import annotations

import gc
import io
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.serverapp.strategy import FedAvg

from fl.flower import SecureAggregation
from fl.flower.chunks import (
    CHUNK,
    MASKED,
    MAX_CHUNK_BYTES,
    MAX_CHUNKS,
    ChunkError,
    check_layout,
    chunk_elements,
)
from fl.flower.local import LocalGrid
from fl.flower.records import PAYLOAD, RECORD
from secagg.crypto import dtype_for_bits
from tests.flower import apps

DIM = sum(int(np.prod(s)) for s in apps.SHAPES.values()) + 1  # arrays + the weight: 17
FRAC = {16: 8, 32: 16, 64: 24}


def _wrapper(n: int, bits: int, chunk_bytes: int) -> SecureAggregation:
    return SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=n),
                             neighbors=None, bits=bits, frac_bits=FRAC[bits],
                             chunk_bytes=chunk_bytes)


def _exact(report: Any) -> None:
    assert report.aborted is None, report.aborted
    assert np.array_equal(report.total, apps.expected_total(report))


@pytest.mark.parametrize(("bits", "chunk_bytes", "chunks"), [
    (16, 2, 17),           # one element per chunk
    (16, 10, 4),           # 5 + 5 + 5 + 2: does not divide d
    (32, 28, 3),           # 7 + 7 + 3
    (32, 4 << 20, 1),      # the default: the whole vector in one chunk
    (64, 48, 3),           # 6 + 6 + 5
    (64, 8 * DIM, 1),      # exactly d
])
def test_a_chunked_masked_input_sums_exactly_with_drops(bits: int, chunk_bytes: int,
                                                        chunks: int) -> None:
    drops = {1: "advertise_keys", 2: "share_keys", 3: "masked_input", 5: "unmasking"}
    grid = LocalGrid(None, 9)
    by_node = {grid.nodes[i]: stage for i, stage in drops.items()}
    plan: apps.DropPlan = lambda node, r, roster: by_node.get(node)  # noqa: E731
    grid.app = apps.client_app(plan)
    wrapper = _wrapper(9, bits, chunk_bytes)
    wrapper.start(grid, apps.initial_arrays(), num_rounds=2, timeout=5)
    for report in wrapper.reports:
        _exact(report)
        assert report.included == apps.expected_included(report, plan)
        assert report.dropped == {grid.nodes[i]: s for i, s in drops.items()}
    masked = [r.content[MASKED] for r in grid.replies
              if r.has_content() and MASKED in r.content]
    assert len(masked) == 2 * 6  # two rounds, the nodes that answered the masked input
    for record in masked:
        assert len(record) == chunks
        assert {a.dtype for a in record.values()} == {dtype_for_bits(bits).name}
        assert sum(a.shape[0] for a in record.values()) == DIM


Tamper = Callable[[Message], None]


def _one_round(grid: LocalGrid, deliver: Callable[[Message], Message | None] | None = None
               ) -> Any:
    """One exact 32-bit round at 7 elements per chunk (7 + 7 + 3); its report. Every node
    answers in these rounds, so the stage deadline is never what ends a stage: it is set far
    above what a loaded host needs (a 5 s deadline failed under a CPU hog on two cores)."""
    if deliver is not None:
        grid.deliver = deliver  # type: ignore[method-assign]
    wrapper = _wrapper(len(grid.nodes), 32, 28)
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=120)
    (report,) = wrapper.reports
    _exact(report)
    return report


def _replace(reply: Message, arrays: dict[str, Array]) -> None:
    reply.content[MASKED] = ArrayRecord(arrays)


def _arrays(reply: Message) -> dict[str, Array]:
    return dict(reply.content[MASKED].items())


def _keys(reply: Message, rename: dict[str, str]) -> None:
    _replace(reply, {rename.get(k, k): v for k, v in _arrays(reply).items()})


def _first_chunk(reply: Message, array: Array) -> None:
    _replace(reply, {**_arrays(reply), "0": array})


def _npy_claiming(shape: tuple[int, ...]) -> bytes:
    """.npy bytes whose header claims ``shape`` (uint32) over 7 elements of data."""
    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(stream, {"descr": "<u4", "fortran_order": False,
                                                  "shape": shape})
    return stream.getvalue() + bytes(28)


def _without_last(reply: Message) -> None:
    arrays = _arrays(reply)
    arrays.pop(max(arrays, key=int))
    _replace(reply, arrays)


TAMPERS: dict[str, tuple[Tamper, str]] = {
    "a chunk missing": (_without_last, "of its 3 chunks"),
    "one chunk more than d makes": (
        lambda r: _replace(r, {**_arrays(r), "21": Array(np.zeros(7, np.uint32))}),
        "more than the 3"),
    "a misplaced offset": (lambda r: _keys(r, {"7": "8"}), "not an offset"),
    "an offset spelled twice": (lambda r: _keys(r, {"7": "07"}), "not an offset"),
    "a 64-bit chunk in a 32-bit round": (
        lambda r: _first_chunk(r, Array(np.zeros(7, np.uint64))), "travels as uint32"),
    "a short chunk": (lambda r: _first_chunk(r, Array(np.zeros(6, np.uint32))),
                      "expected (7,)"),
    "an oversized chunk": (lambda r: _first_chunk(r, Array(np.zeros(1 << 20, np.uint32))),
                           "expected (7,)"),
    "a chunk whose bytes outgrow its shape": (
        lambda r: _first_chunk(r, Array(dtype="uint32", shape=(7,), stype="numpy.ndarray",
                                        data=bytes(1 << 20))), "expected (7,)"),
    "a chunk that is not an array": (
        lambda r: _first_chunk(r, Array(dtype="uint32", shape=(7,), stype="numpy.ndarray",
                                        data=b"\x93NUMPY garbage")), "not a valid array"),
    "a chunk whose bytes describe a huge array": (
        lambda r: _first_chunk(r, Array(dtype="uint32", shape=(7,), stype="numpy.ndarray",
                                        data=_npy_claiming((1 << 40,)))), "another array"),
    "an unknown dtype": (
        lambda r: _first_chunk(r, Array(dtype="no-such-type", shape=(7,),
                                        stype="numpy.ndarray", data=b"")), "has dtype"),
    "no chunks at all": (lambda r: r.content.array_records.pop(MASKED), "no 'secagg.masked'"),
    "another array record": (
        lambda r: r.content.__setitem__("extra", ArrayRecord({"x": Array(np.zeros(3))})),
        "other array records"),
    "a malformed envelope": (
        lambda r: r.content[RECORD].__setitem__(PAYLOAD, b"\x95garbage"), "envelope"),
}


def _tampering_mod(nodes: set[int], tamper: Tamper) -> Any:
    def mod(msg: Message, context: Context, call_next: Any) -> Message:
        reply = call_next(msg, context)
        if msg.metadata.dst_node_id in nodes and not reply.has_error() \
                and MASKED in reply.content:
            tamper(reply)
        return reply

    return mod


@pytest.mark.parametrize("case", sorted(TAMPERS))
def test_a_node_whose_chunks_break_the_layout_is_rejected_and_the_round_goes_on(
        case: str) -> None:
    tamper, reason = TAMPERS[case]
    grid = LocalGrid(None, 6)
    hostile = grid.nodes[2]
    grid.app = apps.client_app(None, [_tampering_mod({hostile}, tamper), apps.open_mod])
    report = _one_round(grid)
    assert report.dropped == {hostile: "masked_input"}
    assert report.included == frozenset(grid.nodes) - {hostile}
    ((node, why),) = report.chunk_rejected
    assert node == hostile and reason in why, why


def test_oversized_and_duplicated_chunks_of_two_nodes_cannot_starve_the_others() -> None:
    """Two hostile nodes at once: one sends a chunk far larger than its slot, the other
    sends its chunk list on the wire with one offset twice (once honest, once 4 MB):
    Flower keeps one entry per key, the oversized one, and it is refused. The honest
    nodes' masked inputs are each checked on their own and the round sums them exactly."""
    grid = LocalGrid(None, 7)
    big, dup = grid.nodes[1], grid.nodes[4]
    grid.app = apps.client_app(None, [_tampering_mod(
        {big}, TAMPERS["an oversized chunk"][0]), apps.open_mod])
    deliver = grid.deliver

    def duplicating(message: Message) -> Message | None:
        reply = deliver(message)
        if reply is None or message.metadata.dst_node_id != dup or MASKED not in reply.content:
            return reply
        proto = message_to_proto(reply)
        item = next(i for i in proto.content.items if i.key == MASKED)
        first = item.array_record.items[0]
        item.array_record.items.add(key=first.key).value.CopyFrom(first.value)
        extra = message_to_proto(Message(RecordDict({MASKED: ArrayRecord(
            {"0": Array(np.zeros(1 << 20, np.uint32))})}), reply_to=message))
        oversized = next(i for i in extra.content.items).array_record.items[0]
        item.array_record.items.append(oversized)
        assert [i.key for i in item.array_record.items].count("0") == 3
        return message_from_proto(proto)

    report = _one_round(grid, duplicating)
    assert report.included == frozenset(grid.nodes) - {big, dup}
    assert dict(report.dropped) == {big: "masked_input", dup: "masked_input"}
    assert sorted(node for node, _ in report.chunk_rejected) == sorted([big, dup])


@pytest.mark.parametrize("chunk", [0, -7, True, 1.5, "7", None, MAX_CHUNK_BYTES])
def test_a_node_refuses_a_chunk_request_it_cannot_honour(chunk: object) -> None:
    grid = LocalGrid(None, 5)
    grid.app = apps.client_app()
    victim = grid.nodes[3]
    deliver = grid.deliver

    def altering(message: Message) -> Message | None:
        record = message.content.config_records.get(RECORD)
        if message.metadata.dst_node_id == victim and record is not None and CHUNK in record:
            fields = {k: v for k, v in record.items() if k != CHUNK}
            if chunk is not None:
                fields[CHUNK] = chunk  # type: ignore[assignment]
            message.content[RECORD] = ConfigRecord(fields)
        return deliver(message)

    report = _one_round(grid, altering)
    assert report.dropped == {victim: "masked_input"}
    errors = [r.error.reason for r in grid.replies
              if r.metadata.src_node_id == victim and r.has_error()]
    assert len(errors) == 1 and errors[0].startswith("ChunkError"), errors


def test_chunk_sizes_the_server_refuses_or_lengthens() -> None:
    for bad in (0, -1, True, 1.0, MAX_CHUNK_BYTES + 1):
        with pytest.raises(ChunkError, match="chunk_bytes"):
            SecureAggregation(FedAvg(), chunk_bytes=bad)  # type: ignore[arg-type]
    # a tiny chunk for a large vector is lengthened to at most MAX_CHUNKS chunks
    assert chunk_elements(4, 32, 10**8) == 1526
    assert chunk_elements(4 << 20, 32, 10**7) == 1 << 20
    assert chunk_elements(4 << 20, 16, 10) == 2 << 20
    # what a node refuses to be asked for (fl.flower.client checks the request with it)
    with pytest.raises(ChunkError, match="more than 65536"):
        check_layout(1, 32, MAX_CHUNKS + 1)
    with pytest.raises(ChunkError, match="lower chunk_bytes"):
        check_layout((1 << 28) + 1, 32, 10)
    assert check_layout(1, 32, MAX_CHUNKS) == 1


class _PullGrid(LocalGrid):
    """A grid with push and pull, as Flower's simulation and deployment grids have: each
    pull delivers one pushed message and returns its reply; it records, at every pull,
    whether a masked-input reply it returned before is still alive anywhere."""

    pull_interval = 0.0

    def __init__(self, n: int) -> None:
        super().__init__(None, n)
        self.record = False  # LocalGrid would keep every reply for the tests
        self.pushed: dict[str, Message] = {}
        self.returned: list[weakref.ref[Message]] = []
        self.alive_at_pull: list[int] = []

    def push_messages(self, messages: Any) -> list[str]:
        ids = []
        for message in messages:
            ids.append(f"pushed-{len(self.pushed)}")
            self.pushed[ids[-1]] = message
        return ids

    def pull_messages(self, message_ids: Any) -> list[Message]:
        gc.collect()
        self.alive_at_pull.append(sum(ref() is not None for ref in self.returned))
        wanted = sorted(set(message_ids) & set(self.pushed))
        if not wanted:
            return []
        reply = self.deliver(self.pushed.pop(wanted[0]))
        if reply is None:
            return []
        reply.metadata.__dict__["_reply_to_message_id"] = wanted[0]
        if reply.has_content() and MASKED in reply.content:
            self.returned.append(weakref.ref(reply))
        return [reply]


def test_the_server_sums_each_masked_input_as_it_arrives_and_lets_it_go() -> None:
    """On a grid with push and pull (Flower's simulation and deployment grids) the server
    checks and sums a node's masked input when it is pulled and keeps no reference to it:
    when the next reply is pulled, no earlier masked-input reply is alive."""
    grid = _PullGrid(6)
    grid.app = apps.client_app()
    report = _one_round(grid)
    assert report.included == frozenset(grid.nodes)
    assert len(grid.returned) == 6 and all(ref() is None for ref in grid.returned)
    assert max(grid.alive_at_pull) == 0
