"""The node's stage records (fl.flower.guard) are pruned to NodeOptions.keep_rounds, and a
pruned round stays closed: its unmasking request is refused even from a rolled-back
Context, and a replayed setup cannot revive the earlier join's snapshot."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp.strategy import FedAvg

from fl.flower import NodeOptions, SecureAggregation, make_secagg_mod
from fl.flower.guard import default_directory, hold, prune, record_name
from fl.flower.local import LocalGrid
from fl.flower.records import PAYLOAD, RECORD, SESSION
from secagg.messages import UnmaskRequest, decode, encode
from tests.flower import apps


def _grid(n: int, keep: int) -> tuple[LocalGrid, SecureAggregation]:
    grid = LocalGrid(None, n)
    grid.app = apps.client_app(None, [apps.operated(make_secagg_mod(NodeOptions(
        keep_rounds=keep)))])
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=n),
                                neighbors=None)
    return grid, wrapper


def _records(node: int) -> list[str]:
    directory = default_directory(node)
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def _send(grid: LocalGrid, node: int, content: RecordDict) -> Message:
    reply = grid.deliver(Message(content, dst_node_id=node, message_type="train",
                                 group_id="1"))
    assert reply is not None
    return reply


def _first(grid: LocalGrid, node: int, stage: str, start: int = 0) -> Message:
    return next(m for m in grid.sent[start:] if m.metadata.dst_node_id == node
                and apps.stage_of(m) == stage)


def _stalled_round(grid: LocalGrid, wrapper: SecureAggregation) -> None:
    """One round whose nodes all go silent at unmasking (each keeps its masked snapshot)."""
    grid.silent = lambda node, msg: apps.stage_of(msg) == "unmasking"
    apps.unreleased(wrapper.start, grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    assert wrapper.reports[-1].aborted is not None
    grid.silent = lambda node, msg: False


def _other_request(record: ConfigRecord) -> RecordDict:
    """The unmasking request that asks for the other share of one survivor."""
    honest = decode(record[PAYLOAD])
    assert isinstance(honest, UnmaskRequest)
    victim = max(honest.survivors)
    other = UnmaskRequest(honest.session_id, honest.recipient,
                          tuple(p for p in honest.survivors if p != victim),
                          (*honest.dropped, victim), {})
    return RecordDict({RECORD: ConfigRecord({SESSION: record[SESSION],
                                             PAYLOAD: encode(other)})})


def test_many_rounds_keep_each_nodes_stage_directory_bounded() -> None:
    grid, wrapper = _grid(3, keep=2)
    wrapper.start(grid, apps.initial_arrays(), num_rounds=8, timeout=5)
    assert len(wrapper.reports) == 8
    assert all(report.aborted is None for report in wrapper.reports)
    for node in grid.nodes:
        assert len(_records(node)) == 2  # 8 rounds joined, the 2 most recent kept


def test_a_pruned_rounds_unmasking_request_is_refused_even_from_a_rolled_back_context(
) -> None:
    grid, wrapper = _grid(5, keep=1)
    _stalled_round(grid, wrapper)
    node = grid.nodes[0]
    before = grid.contexts[node]  # the Context holding round 1's masked-stage snapshot
    request = _first(grid, node, "unmasking").content[RECORD]
    first = _send(grid, node, RecordDict({RECORD: ConfigRecord(dict(request.items()))}))
    assert not first.has_error()
    (kept,) = _records(node)

    mark = len(grid.sent)
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)  # round 2
    assert wrapper.reports[-1].aborted is None
    assert _records(node) != [kept] and len(_records(node)) == 1  # round 1's record pruned

    grid.contexts[node] = before  # the rollback
    for content in (_other_request(request),
                    RecordDict({RECORD: ConfigRecord(dict(request.items()))})):
        reply = _send(grid, node, content)
        assert reply.has_error() and "no record of this round" in reply.error.reason
    assert grid.sent[mark:]  # round 2 really ran between


def test_a_replayed_setup_of_a_pruned_round_is_refused_and_revives_nothing() -> None:
    grid, wrapper = _grid(5, keep=1)
    _stalled_round(grid, wrapper)
    node = grid.nodes[0]
    before = grid.contexts[node]
    setup = _first(grid, node, "advertise_keys")
    advertised = next(r for r in grid.replies if r.metadata.src_node_id == node)
    request = _first(grid, node, "unmasking").content[RECORD]
    assert not _send(grid, node, RecordDict(
        {RECORD: ConfigRecord(dict(request.items()))})).has_error()
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)  # prunes round 1

    again = _send(grid, node, RecordDict(dict(setup.content.items())))
    # the ledger remembers the round the pruned stage record forgot: joined once
    # (fl.site.session); before, it was joined afresh and charged again
    assert again.has_error() and "already joined this round" in again.error.reason
    assert advertised.content[RECORD][SESSION]

    grid.contexts[node] = before  # the first join's masked-stage snapshot
    reply = _send(grid, node, _other_request(request))
    assert reply.has_error() and "no record of this round" in reply.error.reason


def test_a_record_in_use_is_not_pruned(tmp_path: Path) -> None:
    sessions = [bytes([i]) * 32 for i in range(4)]
    for session in sessions:
        with hold(tmp_path, session, 1) as record:
            record.join_round(0, session)
    holding, release = threading.Event(), threading.Event()

    def busy() -> None:
        with hold(tmp_path, sessions[0], 1):
            holding.set()
            release.wait(30)

    worker = threading.Thread(target=busy)
    worker.start()
    try:
        assert holding.wait(30)
        assert prune(tmp_path, 1, record_name(sessions[3], 1)) == 2
    finally:
        release.set()
        worker.join(30)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        record_name(s, 1) for s in (sessions[0], sessions[3]))


def test_a_refused_message_leaves_no_record_behind(tmp_path: Path) -> None:
    from fl.flower.guard import GuardError, snapshot_key

    with pytest.raises(GuardError, match="no record"), hold(tmp_path, bytes(32), 2) as rec:
        snapshot_key(rec, b"")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("keep", [0, -3, True, 2.5])
def test_keep_rounds_must_be_a_positive_count(keep: object) -> None:
    with pytest.raises(ValueError, match="keep_rounds"):
        NodeOptions(keep_rounds=keep)  # type: ignore[arg-type]


def test_a_stage_directory_another_user_could_write_is_refused_and_the_round_goes_on(
        tmp_path: Path) -> None:
    """A local user who pre-creates the node's stage directory world-writable (as in a
    shared /tmp) could read a round's snapshot key from its record and roll the record back
    after the honest unmasking answer; the node refuses to join a round there, so the
    others finish it without it."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    planted = shared / "node-stages"
    planted.mkdir()
    planted.chmod(0o777)
    grid = LocalGrid(None, 5)
    victim = grid.nodes[0]
    grid.app = apps.client_app(None, [apps.operated(make_secagg_mod(
        lambda ctx: NodeOptions(stage_dir=str(planted if ctx.node_id == victim
                                              else tmp_path / f"own-{ctx.node_id}"))))])
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=5),
                                neighbors=None)
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    (report,) = wrapper.reports
    assert report.aborted is None and victim not in report.included
    assert report.included == frozenset(grid.nodes) - {victim}
    assert list(planted.iterdir()) == []  # nothing of the round was written there


def test_records_and_directories_only_the_nodes_user_controls_are_accepted(
        tmp_path: Path) -> None:
    from fl.flower.guard import GuardError

    session = bytes(range(32))
    with hold(tmp_path / "ok", session, 1) as rec:  # created 0700: accepted
        rec.join_round(1, b"reply")
    assert (tmp_path / "ok").stat().st_mode & 0o777 == 0o700
    # a record that is a link (to a file the attacker reads, or rewinds) is refused
    linked = tmp_path / "linked"
    linked.mkdir(mode=0o700)
    (linked / record_name(session, 1)).symlink_to(tmp_path / "ok" / record_name(session, 1))
    with pytest.raises(GuardError, match="symbolic link"), hold(linked, session, 1):
        pass
    # a second hard link (someone kept a handle on the record's contents) is refused
    hard = tmp_path / "hard"
    hard.mkdir(mode=0o700)
    (hard / record_name(session, 1)).hardlink_to(tmp_path / "ok" / record_name(session, 1))
    with pytest.raises(GuardError, match="private file"), hold(hard, session, 1):
        pass
    # a record others can read (the snapshot key) is refused
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o700)
    (loose / record_name(session, 1)).write_bytes(b"")
    (loose / record_name(session, 1)).chmod(0o644)
    with pytest.raises(GuardError, match="private file"), hold(loose, session, 1):
        pass
    # a private directory inside a parent others can write (they could swap it) is refused
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    with pytest.raises(GuardError, match="parent"), hold(open_parent / "node", session, 1):
        pass
    # ... unless the parent is sticky, like /tmp itself
    open_parent.chmod(0o1777)
    with hold(open_parent / "node", session, 1) as rec:
        assert rec.stage is None
