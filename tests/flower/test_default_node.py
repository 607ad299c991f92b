"""A node nobody configured (``ClientApp(mods=[secagg_mod])``, no node config) against the
red team's malicious server (issue 27): tiny noise, a tiny noise multiplier, the same round
repeated 200 times. The default policy's floor and budgets refuse them, before training;
an app's policy only tightens the operator's; and the session's replay and withdrawal
rules hold on the node (fl/site/session.py)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import pytest
from flwr.app import Message
from flwr.serverapp.strategy import FedAvg

from dp.policy import DEFAULT_EPSILON, DEFAULT_ROUND_EPSILON, SitePolicy
from fl.errors import NothingReleased
from fl.flower import DistributedDP, NodeOptions, SecureAggregation, make_secagg_mod
from fl.flower.setup import RoundSetup
from tests.flower import apps
from tests.flower.test_site_core import _configure, _grid, _ledger, _reasons


class TinyNoise(SecureAggregation):
    """Announces distributed DP, sets every node's noise to 1e-9 times the clip."""

    def _setup(self, *args: Any, **kwargs: Any) -> RoundSetup | None:
        setup = super()._setup(*args, **kwargs)
        assert setup is not None and setup.dp is not None
        return replace(setup, dp=replace(setup.dp, noise_stddev=1e-9 * setup.dp.clip_norm))


def _server(n: int, privacy: DistributedDP, cls: type = SecureAggregation) -> Any:
    return cls(FedAvg(fraction_evaluate=0.0, min_available_nodes=n), neighbors=None,
               privacy=privacy)


@pytest.mark.parametrize(("cls", "z"), [(TinyNoise, 1.0), (SecureAggregation, 1e-4)])
def test_a_default_node_refuses_tiny_noise_before_training(cls: type, z: float) -> None:
    grid, trained = _grid(3)
    wrapper = _server(3, DistributedDP(clip_norm=1.0, noise_multiplier=z), cls)
    with pytest.raises(NothingReleased):
        wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    assert wrapper.reports[0].aborted is not None
    reasons = _reasons(grid)
    assert len(reasons) == 3 and all("[min_noise_multiplier]" in r for r in reasons), reasons
    assert trained.calls == 0 and all(_ledger(grid, n) == [] for n in grid.nodes)


def test_a_default_node_stops_200_repeated_rounds_at_its_default_budget() -> None:
    """The red team's 166-239 repeated rounds: each is within the per-release cap, so the
    default node joins until its total budget is spent, then refuses every one after."""
    n = 3
    grid, trained = _grid(n)
    wrapper = _server(n, DistributedDP(clip_norm=1.0, noise_multiplier=6.0))
    messages = _configure(wrapper, grid)
    for _ in range(200):
        wrapper.secure_round(grid, messages, 5)
    done = [r for r in wrapper.reports if r.aborted is None]
    assert len(wrapper.reports) == 200 and 2 <= len(done) <= 20
    assert all(r.aborted is not None for r in wrapper.reports[len(done):])
    assert trained.calls == n * len(done)
    for node in grid.nodes:
        charges = _ledger(grid, node)
        assert len(charges) == len(done)
        assert charges[-1]["epsilon_after"] <= DEFAULT_EPSILON
        steps = [b["epsilon_after"] - a["epsilon_after"]
                 for a, b in zip([{"epsilon_after": 0.0}, *charges], charges, strict=False)]
        assert max(steps) <= DEFAULT_ROUND_EPSILON
        assert charges[-1]["epsilon_after"] + max(steps) > DEFAULT_EPSILON  # spent, not idle
    assert all("[budget]" in r for r in _reasons(grid)[-n:])


def test_an_apps_policy_only_tightens_the_operators() -> None:
    """The ClientApp's code comes with the app bundle (the server side): an app policy that
    lists exact sums does not turn them on, and its looser floor and budget are ignored."""
    loose = SitePolicy(modes=("none", "distributed"), min_noise_multiplier=0.0,
                       epsilon=None, round_epsilon=None)
    grid, trained = _grid(3, make_secagg_mod(NodeOptions(policy=loose)))
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=3),
                                neighbors=None)
    with pytest.raises(NothingReleased):
        wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    reasons = _reasons(grid)
    assert len(reasons) == 3 and all("[exact-release]" in r and "secagg-dp='none'" in r
                                     for r in reasons)
    grid.replies.clear()
    wrapper = _server(3, DistributedDP(clip_norm=1.0, noise_multiplier=1e-4))
    with pytest.raises(NothingReleased, match=r"\[min_noise_multiplier\]"):
        wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    assert all("[min_noise_multiplier]" in r for r in _reasons(grid))
    assert trained.calls == 0
    # the operator's own opt-in does turn exact sums on
    grid, trained = _grid(3, apps.operated(make_secagg_mod(NodeOptions(policy=loose))))
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=3),
                                neighbors=None)
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    assert wrapper.reports[0].aborted is None and trained.calls == 3


def test_a_replayed_setup_is_refused_and_a_never_sent_round_is_withdrawn() -> None:
    """The session's two rules on a Flower node: the same setup twice is refused (the
    ledger knows the round's key); a round that aborts before the node's masked input
    left it (here: the server never sends share_keys, and the next setup replaces it) has
    its charge withdrawn, while a round whose masked input left keeps its charge."""
    grid, _ = _grid(3, apps.open_mod)
    grid.silent = lambda node, msg: apps.stage_of(msg) == "share_keys"
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=3),
                                neighbors=None)
    with pytest.raises(NothingReleased):
        wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    assert wrapper.reports[0].aborted is not None  # nobody shared keys
    node = grid.nodes[0]
    setup = next(m for m in grid.sent if m.metadata.dst_node_id == node
                 and apps.stage_of(m) == "advertise_keys")
    reply = grid.deliver(Message(setup.content, dst_node_id=node, message_type="train",
                                 group_id="1"))
    assert reply is not None and reply.has_error()
    assert "already joined this round" in reply.error.reason
    (first,) = _ledger(grid, node)
    assert first["withdrawn"] is None  # the node cannot know yet that the round is gone
    grid.silent = lambda node, msg: False
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    assert wrapper.reports[-1].aborted is None
    first, second = _ledger(grid, node)
    assert first["withdrawn"] is not None and "replaced" in first["withdrawn"]
    assert second["withdrawn"] is None  # its masked input left: the charge stays
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    assert [c["withdrawn"] is None for c in _ledger(grid, node)] == [False, True, True]


def test_the_node_logs_its_policy_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    import fl.flower.client as client

    client._ANNOUNCED.clear()
    grid, _ = _grid(3)
    wrapper = _server(3, DistributedDP(clip_norm=1.0, noise_multiplier=6.0))
    with caplog.at_level("WARNING", logger="fl.flower"):
        wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    lines = [r.getMessage() for r in caplog.records if "privacy policy:" in r.getMessage()]
    assert len(lines) == 3 and all("\n" not in line and "{" not in line for line in lines)
    assert all(f"at most {DEFAULT_ROUND_EPSILON:g} per release" in line
               and f"at most {DEFAULT_EPSILON:g} in total" in line for line in lines)


def test_an_app_asking_exact_sums_from_default_nodes_fails_naming_the_opt_in(
        caplog: pytest.LogCaptureFixture) -> None:
    """Before: every node refused every round and the run ended as a success with an
    untrained model (6,262 log lines, none naming the opt-in). Now the server logs, per
    round at WARNING, the rule, how many nodes and the fix, and the run raises a typed
    error whose one line names the opt-in (a ServerApp that raises exits non-zero)."""
    grid, trained = _grid(4)
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=4),
                                neighbors=None)
    # the warnings go to Flower's own logger, which earlier tests' simulations may leave
    # disabled or not propagating: listen on it directly, as a Flower app's log does
    flwr_logger = logging.getLogger("flwr")
    saved = flwr_logger.disabled, flwr_logger.level
    flwr_logger.disabled = False
    flwr_logger.setLevel(logging.INFO)
    flwr_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("WARNING"), pytest.raises(NothingReleased) as caught:
            wrapper.start(grid, apps.initial_arrays(), num_rounds=3, timeout=5)
    finally:
        flwr_logger.removeHandler(caplog.handler)
        flwr_logger.disabled, flwr_logger.level = saved
    line = str(caught.value)
    assert "\n" not in line and "in 3 rounds" in line
    assert "4 of 4 sites refused by their site policy ([exact-release] 4)" in line
    assert "secagg-dp='none'" in line
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
              and "refused by their site policy" in r.getMessage()]
    assert len(set(warned)) == 3 and all("secagg-dp='none'" in w for w in warned)  # per round
    assert trained.calls == 0


def test_the_server_reports_the_epsilon_each_nodes_ledger_holds() -> None:
    """One epsilon a user can trust: beside the plan's, the server reports the figure each
    node's ledger records (its own noise share in a semi-honest round, the replace-one
    sensitivity of its one row), computed by the same function the node charges with."""
    grid, _ = _grid(3)
    wrapper = _server(3, DistributedDP(clip_norm=1.0, noise_multiplier=6.0))
    wrapper.start(grid, apps.initial_arrays(), num_rounds=2, timeout=5)
    last = wrapper.reports[-1]
    assert all(r.aborted is None for r in wrapper.reports) and last.node_epsilon is not None
    for node in grid.nodes:
        assert _ledger(grid, node)[-1]["epsilon_after"] == pytest.approx(last.node_epsilon,
                                                                          rel=1e-9)


def test_a_server_cannot_plan_on_node_sampling_the_nodes_do_not_count() -> None:
    """A node charges every round it joins at sample rate 1 (it cannot verify it was
    sampled), so a server plan amplified by a node sample rate would report less than every
    ledger holds: refused, naming the field."""
    from fl.round_setup import SetupError

    with pytest.raises(SetupError, match=r"sample_rate=0\.5"):
        DistributedDP(clip_norm=1.0, epsilon=8.0, rounds=10, sample_rate=0.5)
    assert DistributedDP(clip_norm=1.0, epsilon=8.0, rounds=10).sample_rate == 1.0
