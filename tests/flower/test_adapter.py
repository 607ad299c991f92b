"""The Flower adapter through Flower's own message serde, in-process (fast): exact sums for
SecAgg and SecAgg+ with nodes failing or going silent at every stage, the user's strategy
update rule, distributed DP with its budget, and what a node refuses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ConfigRecord, Message, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvg

from dp.policy import SitePolicy
from fl.flower import (
    DistributedDP,
    NodeOptions,
    RoundSetup,
    SecureAggregation,
    SetupError,
    make_secagg_mod,
    secagg_mod,
)
from fl.flower.chunks import MASKED
from fl.flower.local import LocalGrid
from fl.flower.records import PAYLOAD, RECORD, SESSION, SETUP, STATE
from secagg.messages import MaskedInput, UnmaskRequest, decode, encode
from tests.flower import apps


def _plan_by_position(grid: LocalGrid, stages: dict[int, str]) -> apps.DropPlan:
    by_node = {grid.nodes[i]: stage for i, stage in stages.items()}
    return lambda node, server_round, roster: by_node.get(node)


def _grid(n: int, drops: dict[int, str] | None = None,
          silent: Callable[[int, Message], bool] | None = None,
          mods: list[Any] | None = None) -> tuple[LocalGrid, apps.DropPlan]:
    grid = LocalGrid(None, n, silent=silent)
    plan = _plan_by_position(grid, drops or {})
    grid.app = apps.client_app(plan, mods)
    return grid, plan


def _check_exact(wrapper: SecureAggregation, plan: apps.DropPlan) -> None:
    for report in wrapper.reports:
        assert report.aborted is None, report.aborted
        assert report.included == apps.expected_included(report, plan)
        assert np.array_equal(report.total, apps.expected_total(report))


@pytest.mark.parametrize("neighbors", [None, "auto"])
def test_rounds_are_exact_when_nodes_fail_at_every_stage(neighbors: str | None) -> None:
    drops = {1: "advertise_keys", 4: "share_keys", 7: "masked_input", 10: "unmasking"}
    grid, plan = _grid(16, drops)
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=16),
                                neighbors=neighbors, dropout_rate=0.25,
                                metrics=("train_loss",))
    result = wrapper.start(grid, apps.initial_arrays(), num_rounds=2, timeout=5)
    _check_exact(wrapper, plan)
    report = wrapper.reports[-1]
    assert (report.setup.neighbors is None) == (neighbors is None)
    assert report.dropped == {grid.nodes[i]: s for i, s in drops.items()}
    assert len(report.included) == 16 - 3
    for name, value in apps.weighted_average(report.included, 2).items():
        np.testing.assert_allclose(result.arrays[name].numpy(), value, rtol=1e-6, atol=1e-6)
    weights = sum(1 + node % 7 for node in report.included)
    losses = sum((1 + node % 7) * apps.reply_content(node, 2)["metrics"]["train_loss"]
                 for node in report.included)
    assert result.train_metrics_clientapp[2]["train_loss"] == pytest.approx(losses / weights)


def test_silent_nodes_are_dropouts_of_the_stage_they_miss() -> None:
    grid, _ = _grid(8)
    quiet = {grid.nodes[2]: "share_keys", grid.nodes[5]: "unmasking"}
    grid.silent = lambda node, msg: quiet.get(node) == apps.stage_of(msg) or (
        node in quiet and apps.stage_of(msg) in ("masked_input", "unmasking")
        and quiet[node] == "share_keys")
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=8),
                                neighbors=None)
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    (report,) = wrapper.reports
    assert report.dropped == quiet
    assert report.included == frozenset(grid.nodes) - {grid.nodes[2]}
    assert np.array_equal(report.total, apps.expected_total(report))


def test_the_strategy_update_rule_applies_to_the_secure_aggregate() -> None:
    """FedAdam's server optimiser on the secure aggregate equals FedAdam on the plain replies."""
    plain_grid, _ = _grid(6, mods=[])
    plain = FedAdam(fraction_evaluate=0.0, min_available_nodes=6).start(
        plain_grid, apps.initial_arrays(), num_rounds=3, timeout=5)
    grid, _ = _grid(6)
    wrapper = SecureAggregation(FedAdam(fraction_evaluate=0.0, min_available_nodes=6))
    secure = wrapper.start(grid, apps.initial_arrays(), num_rounds=3, timeout=5)
    assert len(wrapper.reports) == 3
    for name in apps.SHAPES:
        np.testing.assert_allclose(secure.arrays[name].numpy(), plain.arrays[name].numpy(),
                                   rtol=1e-5, atol=1e-6)
        assert not np.allclose(secure.arrays[name].numpy(), 0)


def test_nothing_but_secagg_messages_leaves_a_node_and_the_state_is_erased() -> None:
    grid, _ = _grid(5)
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=5),
                                neighbors=None)
    snapshots: list[bytes] = []
    deliver = grid.deliver

    def recording(message: Message) -> Message | None:
        reply = deliver(message)
        for node in grid.nodes:
            saved = grid.state(node).config_records.get(STATE)
            if saved is not None:
                snapshots.append(bytes(saved["snapshot"]))
        return reply

    grid.deliver = recording  # type: ignore[method-assign]
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    assert wrapper.reports[0].aborted is None and snapshots
    plain = [apps.reply_content(node, 1)["arrays"][k].numpy().tobytes()
             for node in grid.nodes for k in apps.SHAPES]
    chunked = 0
    for reply in grid.replies:
        message = decode(reply.content[RECORD][PAYLOAD])  # a secagg client message
        if isinstance(message, MaskedInput):  # and its vector's chunks (fl.flower.chunks)
            assert set(reply.content.keys()) == {RECORD, MASKED}
            wire = b"".join(a.numpy().tobytes() for a in reply.content[MASKED].values())
            chunked += 1
        else:
            assert set(reply.content.keys()) == {RECORD}
            wire = reply.content[RECORD][PAYLOAD]
        assert set(reply.content[RECORD].keys()) == {SESSION, PAYLOAD}
        assert not any(chunk[:32] in wire for chunk in plain)
        assert not any(snap[-64:] in wire for snap in snapshots)
    assert chunked == 5
    assert all(STATE not in grid.state(node).config_records for node in grid.nodes)


def _stalled_round(n: int = 5) -> tuple[LocalGrid, SecureAggregation]:
    """A round whose nodes all go silent at unmasking: every node keeps its snapshot."""
    grid, _ = _grid(n)
    grid.silent = lambda node, msg: apps.stage_of(msg) == "unmasking"
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=n),
                                neighbors=None)
    apps.unreleased(wrapper.start, grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    assert wrapper.reports[0].aborted is not None
    grid.silent = lambda node, msg: False
    return grid, wrapper


def _request_to(grid: LocalGrid, node: int) -> Message:
    return next(m for m in grid.sent if m.metadata.dst_node_id == node
                and apps.stage_of(m) == "unmasking")


def _send(grid: LocalGrid, node: int, content: RecordDict, group: str = "1") -> Message:
    reply = grid.deliver(Message(content, dst_node_id=node, message_type="train",
                                 group_id=group))
    assert reply is not None
    return reply


def test_a_message_of_another_session_is_refused_and_changes_nothing() -> None:
    grid, _ = _stalled_round()
    node = grid.nodes[0]
    request = _request_to(grid, node).content[RECORD]
    before = dict(grid.state(node).config_records[STATE])
    forged = RecordDict({RECORD: ConfigRecord({SESSION: bytes(32),
                                               PAYLOAD: request[PAYLOAD]})})
    reply = _send(grid, node, forged)
    assert reply.has_error() and "RoundStateError" in reply.error.reason
    assert dict(grid.state(node).config_records[STATE]) == before


def test_a_stale_round_message_is_refused_after_a_new_round_started() -> None:
    grid, wrapper = _stalled_round()
    node = grid.nodes[1]
    old = _request_to(grid, node).content[RECORD]
    grid.silent = lambda n, msg: apps.stage_of(msg) == "unmasking"
    apps.unreleased(wrapper.start, grid, apps.initial_arrays(), num_rounds=1,
                    timeout=5)  # a second round
    assert wrapper.reports[-1].setup.nonce != wrapper.reports[0].setup.nonce
    assert STATE in grid.state(node).config_records  # the new round's state, mid-round
    grid.silent = lambda n, msg: False
    reply = _send(grid, node, RecordDict({RECORD: ConfigRecord(dict(old.items()))}))
    assert reply.has_error() and "another secure-aggregation session" in reply.error.reason


def test_a_snapshot_copied_from_another_node_is_refused() -> None:
    grid, _ = _stalled_round()
    a, b = grid.nodes[0], grid.nodes[1]
    state_a = grid.state(a).config_records[STATE]
    context_b = grid.contexts[b]
    from flwr.common.serde import context_from_proto, context_to_proto

    ctx = context_from_proto(context_b)
    ctx.state.config_records[STATE] = state_a
    grid.contexts[b] = context_to_proto(ctx)
    record = _request_to(grid, b).content[RECORD]
    reply = _send(grid, b, RecordDict({RECORD: ConfigRecord(dict(record.items()))}))
    assert reply.has_error() and "StaleSnapshot" in reply.error.reason


def test_the_both_shares_request_is_refused_and_the_round_secrets_erased() -> None:
    """A server asking a node for both shares of one peer (which would unmask that peer's
    update; Flower's secaggplus_mod answers it, see test_legacy.py) gets an error reply."""
    grid, _ = _stalled_round()
    node = grid.nodes[0]
    record = _request_to(grid, node).content[RECORD]
    honest = decode(record[PAYLOAD])
    assert isinstance(honest, UnmaskRequest)
    victim = max(honest.survivors)
    evil = UnmaskRequest(honest.session_id, honest.recipient, honest.survivors,
                         (*honest.dropped, victim), {})
    reply = _send(grid, node, RecordDict({RECORD: ConfigRecord(
        {SESSION: record[SESSION], PAYLOAD: encode(evil)})}))
    assert reply.has_error() and "both survived and dropped" in reply.error.reason
    assert STATE not in grid.state(node).config_records


def _setup_message(grid: LocalGrid, setup_bytes: bytes, node: int) -> RecordDict:
    content = apps.reply_content(0, 1)
    content["config"] = ConfigRecord({"server-round": 1})
    content[RECORD] = ConfigRecord({SETUP: setup_bytes})
    return content


def _valid_setup(grid: LocalGrid, **changes: Any) -> RoundSetup:
    from dataclasses import replace

    from fl.flower.encoding import layout_of

    setup = RoundSetup(run_id=grid.run.run_id, server_round=1, nonce=bytes(range(32)),
                       roster=tuple(grid.nodes), threshold=3, neighbors=None, bits=64,
                       security="semi-honest", arrays=layout_of(apps.initial_arrays()),
                       metrics=(), weight_key="num-examples", mode="none",
                       frac_bits=24)
    return replace(setup, **changes)


@pytest.mark.parametrize("mutate, message", [
    (lambda raw: raw[:-1], "not msgpack"),
    (lambda raw: raw + b"\x00", "not msgpack"),
    (lambda raw: b"\x80", "version"),
])
def test_a_malformed_setup_is_refused_with_a_typed_error(
        mutate: Callable[[bytes], bytes], message: str) -> None:
    grid, _ = _grid(4)
    raw = mutate(_valid_setup(grid).to_bytes())
    with pytest.raises(SetupError, match=message):
        RoundSetup.from_bytes(raw)
    reply = _send(grid, grid.nodes[0], _setup_message(grid, raw, grid.nodes[0]))
    assert reply.has_error() and "SetupError" in reply.error.reason


@pytest.mark.parametrize("changes, message", [
    ({"threshold": 2}, "unsafe"),                       # t <= n/2 for n = 4
    ({"roster": (1, 2, 3, 4)}, "not in this round's roster"),
    ({"run_id": 99}, "run 99"),
])
def test_a_node_refuses_an_unsafe_or_foreign_setup(changes: dict[str, Any],
                                                   message: str) -> None:
    grid, _ = _grid(4)
    raw = _valid_setup(grid, **changes).to_bytes()
    reply = _send(grid, grid.nodes[0], _setup_message(grid, raw, grid.nodes[0]))
    assert reply.has_error() and message in reply.error.reason
    assert STATE not in grid.state(grid.nodes[0]).config_records


def test_the_node_policy_refuses_low_thresholds_and_exact_sums_by_default() -> None:
    policy = SitePolicy(modes=("none", "distributed"), min_threshold=4)
    grid, _ = _grid(4, mods=[apps.operated(policy=policy)])
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=4),
                                neighbors=None)
    apps.unreleased(wrapper.start, grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    assert wrapper.reports[0].aborted is not None
    assert all("[min_threshold]" in r.error.reason for r in grid.replies if r.has_error())
    grid, _ = _grid(4, mods=[secagg_mod])  # the default policy: distributed DP only
    raw = _valid_setup(grid).to_bytes()
    reply = _send(grid, grid.nodes[0], _setup_message(grid, raw, grid.nodes[0]))
    assert reply.has_error() and "[exact-release]" in reply.error.reason


def test_distributed_dp_round_decodes_to_the_noisy_average_within_its_noise() -> None:
    n = 8
    grid, _ = _grid(n, mods=[apps.operated(policy=apps.LOOSE)])
    wrapper = SecureAggregation(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=n), neighbors=None,
        privacy=DistributedDP(clip_norm=4.0, noise_multiplier=0.5))
    result = wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    (report,) = wrapper.reports
    assert report.setup.mode == "distributed" and report.setup.dp is not None
    assert report.setup.dp.threshold == report.setup.threshold == 5
    assert report.included == frozenset(grid.nodes)
    # the arrays sent are zeros and every update is inside the clip: the exact average is
    # the plain mean of the replies; the decoded one carries the nodes' summed noise
    mean = np.concatenate([np.mean([apps.reply_content(node, 1)["arrays"][k].numpy()
                                    for node in grid.nodes], axis=0).ravel()
                           for k in apps.SHAPES])
    got = np.concatenate([result.arrays[k].numpy().ravel() for k in apps.SHAPES])
    sigma = report.setup.dp.noise_stddev * np.sqrt(n) / n  # per coordinate, in the mean
    error = got - mean
    assert np.sqrt(np.mean(error**2)) < 3 * sigma + 0.05
    assert np.sqrt(np.mean(error**2)) > 0.1 * sigma  # the noise is there


def test_distributed_dp_rounds_stop_at_the_budget() -> None:
    n = 8
    grid, _ = _grid(n, mods=[apps.operated(policy=apps.LOOSE)])  # the server's budget
    privacy = DistributedDP(clip_norm=4.0, epsilon=8.0, delta=1e-5, rounds=2)
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=n),
                                neighbors=None, privacy=privacy)
    wrapper.start(grid, apps.initial_arrays(), num_rounds=3, timeout=5)
    assert len(wrapper.reports) == 2  # the third round would exceed the budget: not run
    first, second = wrapper.reports
    assert first.epsilon is not None and second.epsilon is not None
    assert 0 < first.epsilon < second.epsilon <= 8.0
    assert wrapper.budget is not None and wrapper.budget.rounds == 2
    assert len([m for m in grid.sent if apps.stage_of(m) == "advertise_keys"]) == 2 * n


def test_a_round_without_safe_parameters_is_not_run() -> None:
    grid, _ = _grid(2)
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=2))
    line = apps.unreleased(wrapper.start, grid, apps.initial_arrays(), num_rounds=1,
                           timeout=5)  # nothing was trained: an error, not a success
    assert wrapper.reports == [] and grid.sent == []
    assert "not run" in line


def test_unsupported_wrapper_settings_are_refused_with_what_to_change() -> None:
    with pytest.raises(ValueError, match="verify_keys"):
        SecureAggregation(FedAvg(), security="malicious")
    with pytest.raises(ValueError, match="metrics"):
        SecureAggregation(FedAvg(), metrics=("loss",), privacy=DistributedDP(1.0, epsilon=1))
    with pytest.raises(ValueError, match="noise_multiplier"):
        SecureAggregation(FedAvg(), privacy=DistributedDP(1.0))


def test_the_node_policy_sets_a_noise_floor_relative_to_the_clip() -> None:
    """``min_noise_multiplier`` is the Gaussian-equivalent multiplier of the noise the node
    can count on, over the clip (dp.distributed.effective_noise_multiplier). In a
    semi-honest round the roster is the server's word, so only the node's own share counts
    (fl.site.core.lone_share), and the node's one clipped row is charged at the replace-one
    sensitivity (twice the clip): a 0.05 stddev at clip 1 is a multiplier of about 0.025,
    not the 0.087 that three honest nodes' shares over the add/remove sensitivity give."""
    from dataclasses import replace

    from fl.flower.setup import DpSpec

    for floor, refused in ((0.03, True), (0.02, False)):
        policy = SitePolicy(modes=("distributed",), min_noise_multiplier=floor,
                            round_epsilon=None, epsilon=None)  # the floor alone
        grid, _ = _grid(4, mods=[apps.operated(policy=policy)])
        setup = replace(_valid_setup(grid), mode="distributed", frac_bits=0, bits=40,
                        dp=DpSpec(1.0, 100.0, 40, 0.05, 3, "dgauss", 0.5, 3))
        reply = _send(grid, grid.nodes[0],
                      _setup_message(grid, setup.to_bytes(), grid.nodes[0]))
        assert reply.has_error() == refused, reply.error.reason if refused else ""
        if refused:
            assert "[min_noise_multiplier]" in reply.error.reason


def test_the_adapter_imports_without_torch() -> None:
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.modules['torch'] = None; import fl.flower, fl.flower.local; "
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def _malicious(n: int, drops: dict[int, str] | None = None
               ) -> tuple[LocalGrid, apps.DropPlan, dict[int, Any]]:
    from secagg import SigningKey

    grid = LocalGrid(None, n)
    keys = {node: SigningKey.generate() for node in grid.nodes}
    enrolled = frozenset(k.public for k in keys.values())
    mod = apps.operated(make_secagg_mod(lambda ctx: NodeOptions(
        signing_key=keys[ctx.node_id], trusted_keys=enrolled)))
    plan = _plan_by_position(grid, drops or {})
    grid.app = apps.client_app(plan, [mod])
    return grid, plan, keys


def test_malicious_mode_rounds_are_exact_with_dropouts_including_the_consistency_check(
        ) -> None:
    drops = {0: "share_keys", 3: "masked_input", 5: "consistency_check", 8: "unmasking"}
    grid, plan, keys = _malicious(16, drops)  # t = 11: more than 2/3 of 16
    wrapper = SecureAggregation(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=16), neighbors=None,
        security="malicious", verify_keys={n: k.public for n, k in keys.items()})
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    (report,) = wrapper.reports
    assert report.setup.security == "malicious"
    assert report.dropped == {grid.nodes[i]: s for i, s in drops.items()}
    assert report.included == frozenset(grid.nodes) - {grid.nodes[0], grid.nodes[3]}
    assert report.included == apps.expected_included(report, plan)
    assert np.array_equal(report.total, apps.expected_total(report))
    assert any(apps.stage_of(m) == "consistency_check" for m in grid.sent)


def test_malicious_mode_nodes_refuse_a_verify_key_that_is_not_enrolled() -> None:
    """A server that swaps in a key of its own (to impersonate a node) gets no round."""
    from secagg import SigningKey

    grid, _, keys = _malicious(6)
    forged = {n: k.public for n, k in keys.items()}
    forged[grid.nodes[2]] = SigningKey.generate().public
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=6),
                                neighbors=None, security="malicious", verify_keys=forged)
    apps.unreleased(wrapper.start, grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    (report,) = wrapper.reports
    assert report.aborted is not None and report.total is None
    reasons = [r.error.reason for r in grid.replies]
    assert len(reasons) == 6 and all("SetupError" in r for r in reasons)
    assert sum("not its own" in r for r in reasons) == 1
    assert sum("not enrolled" in r for r in reasons) == 5


def test_a_tampered_snapshot_is_refused_under_the_node_snapshot_key() -> None:
    grid, _ = _grid(5, mods=[apps.operated(make_secagg_mod(NodeOptions(
        snapshot_key=b"node secret")))])
    grid.silent = lambda node, msg: apps.stage_of(msg) == "unmasking"
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=5),
                                neighbors=None)
    apps.unreleased(wrapper.start, grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    grid.silent = lambda node, msg: False
    node = grid.nodes[0]
    from flwr.common.serde import context_from_proto, context_to_proto

    ctx = context_from_proto(grid.contexts[node])
    saved = ctx.state.config_records[STATE]
    blob = bytearray(saved["snapshot"])
    blob[len(blob) // 2] ^= 1
    saved["snapshot"] = bytes(blob)
    grid.contexts[node] = context_to_proto(ctx)
    record = _request_to(grid, node).content[RECORD]
    reply = _send(grid, node, RecordDict({RECORD: ConfigRecord(dict(record.items()))}))
    assert reply.has_error() and "StaleSnapshot" in reply.error.reason


def test_distributed_dp_refuses_a_strategy_that_sends_nodes_different_arrays() -> None:
    grid, _ = _grid(4)
    wrapper = SecureAggregation(FedAvg(), neighbors=None,
                                privacy=DistributedDP(clip_norm=1.0, noise_multiplier=1.0))
    messages = []
    for i, node in enumerate(grid.nodes):
        arrays = apps.initial_arrays()
        arrays["b"] = Array(np.full(4, float(i), dtype=np.float32))
        messages.append(Message(RecordDict({"arrays": arrays, "config": ConfigRecord(
            {"server-round": 1})}), dst_node_id=node, message_type="train"))
    with pytest.raises(ValueError, match="same ArrayRecord"):
        wrapper.secure_round(grid, messages, 5)
    assert grid.sent == []


def test_a_rolled_back_context_cannot_answer_a_second_unmasking_request() -> None:
    """Flower may run two messages of one node from the same saved Context (concurrent
    messages, or an exception that skips the save): the node's stage record outside the
    Context refuses a second, different unmasking answer from the older snapshot."""
    grid, _ = _stalled_round()
    node = grid.nodes[0]
    before = grid.contexts[node]  # saved Context with the masked-stage snapshot
    record = _request_to(grid, node).content[RECORD]
    honest = decode(record[PAYLOAD])
    first = _send(grid, node, RecordDict({RECORD: ConfigRecord(dict(record.items()))}))
    assert not first.has_error()
    grid.contexts[node] = before  # the rollback
    victim = max(honest.survivors)
    other = UnmaskRequest(honest.session_id, honest.recipient,
                          tuple(p for p in honest.survivors if p != victim),
                          (*honest.dropped, victim), {})
    reply = _send(grid, node, RecordDict({RECORD: ConfigRecord(
        {SESSION: record[SESSION], PAYLOAD: encode(other)})}))
    assert reply.has_error() and "StaleSnapshot" in reply.error.reason


def test_an_aborted_round_stays_aborted_even_if_the_context_was_not_saved() -> None:
    grid, _ = _stalled_round()
    node = grid.nodes[0]
    before = grid.contexts[node]
    record = _request_to(grid, node).content[RECORD]
    honest = decode(record[PAYLOAD])
    evil = UnmaskRequest(honest.session_id, honest.recipient, honest.survivors,
                         (*honest.dropped, max(honest.survivors)), {})
    reply = _send(grid, node, RecordDict({RECORD: ConfigRecord(
        {SESSION: record[SESSION], PAYLOAD: encode(evil)})}))
    assert reply.has_error() and "ProtocolAbort" in reply.error.reason
    grid.contexts[node] = before  # as if Flower had not saved the Context
    again = _send(grid, node, RecordDict({RECORD: ConfigRecord(dict(record.items()))}))
    assert again.has_error() and "aborted the round" in again.error.reason


def test_a_node_joins_a_round_once() -> None:
    grid, _ = _stalled_round()
    node = grid.nodes[0]
    setup = next(m for m in grid.sent if m.metadata.dst_node_id == node
                 and apps.stage_of(m) == "advertise_keys")
    reply = _send(grid, node, RecordDict(dict(setup.content.items())))
    assert reply.has_error() and "already joined this round" in reply.error.reason


def test_a_corrupted_stage_record_is_refused(tmp_path: Any) -> None:
    from fl.flower.guard import GuardError, hold

    with hold(tmp_path, b"\x01" * 32, 3) as record:
        record.join_round(2, b"reply")
    (path,) = tmp_path.iterdir()
    path.write_bytes(b"garbage")
    with pytest.raises(GuardError, match="corrupted"), hold(tmp_path, b"\x01" * 32, 3):
        pass
