"""A malicious Flower server against real nodes, through Flower's own serialisation
(fl.flower.local.LocalGrid): the node's site core (fl/site/core.py) refuses what the site
role refuses, before the user's training runs, and its ledger shows every charge.

Each server here is ``SecureAggregation`` with one thing changed, as a server operator could
change it: zero noise, the same DP round repeated, stated dropout/corruption rates of 0, an
array layout that cannot match."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ConfigRecord, Message
from flwr.serverapp.strategy import FedAvg

from dp.audit import distributed_event
from dp.budget import PrivacyBudget
from dp.ledger import read_charges
from dp.policy import SitePolicy
from fl.errors import NothingReleased
from fl.flower import DistributedDP, NodeOptions, SecureAggregation, make_secagg_mod, secagg_mod
from fl.flower.encoding import dp_params
from fl.flower.local import LocalGrid
from fl.flower.setup import RoundSetup
from fl.site.core import open_site_core, state_directory
from fl.vector import ArraySpec
from tests.flower import apps


class Trained:
    """A mod after the secagg mod: counts the messages that reach the user's training."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, msg: Message, context: Any, call_next: Any) -> Message:
        self.calls += 1
        return call_next(msg, context)


def _grid(n: int, mod: Any = secagg_mod, **grid_args: Any) -> tuple[LocalGrid, Trained]:
    trained = Trained()
    grid = LocalGrid(None, n, **grid_args)
    grid.app = apps.client_app(None, [mod, trained])
    return grid, trained


def _ledger(grid: LocalGrid, node: int) -> list[dict[str, Any]]:
    """The charges of a node's default ledger (none if it was never written)."""
    from flwr.common.serde import context_from_proto

    path = Path(NodeOptions().ledger_path(context_from_proto(grid.contexts[node])))
    assert path.parent == state_directory()
    if not path.exists():
        return []
    return [asdict(c) for c in read_charges(path)]


def _reasons(grid: LocalGrid) -> list[str]:
    return [r.error.reason for r in grid.replies if r.has_error()]


class ZeroNoise(SecureAggregation):
    """Announces distributed DP, sets every node's noise to 0."""

    def _setup(self, *args: Any, **kwargs: Any) -> RoundSetup | None:
        setup = super()._setup(*args, **kwargs)
        assert setup is not None and setup.dp is not None
        return replace(setup, dp=replace(setup.dp, noise_stddev=0.0))


def test_a_zero_noise_dp_round_is_refused_before_training_and_nothing_is_charged() -> None:
    grid, trained = _grid(4)
    wrapper = ZeroNoise(FedAvg(fraction_evaluate=0.0, min_available_nodes=4), neighbors=None,
                        privacy=DistributedDP(clip_norm=1.0, noise_multiplier=1.0))
    apps.unreleased(wrapper.start, grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    (report,) = wrapper.reports
    assert report.setup.mode == "distributed" and report.setup.dp.noise_stddev == 0.0
    assert report.aborted is not None and report.total is None
    reasons = _reasons(grid)
    assert len(reasons) == 4 and all(
        "PolicyRefused" in r and "[min_noise_multiplier]" in r and "adds no noise" in r
        for r in reasons)
    assert trained.calls == 0
    assert all(_ledger(grid, node) == [] for node in grid.nodes)


def _configure(wrapper: SecureAggregation, grid: LocalGrid, server_round: int = 1
               ) -> list[Message]:
    return list(wrapper.strategy.configure_train(
        server_round, apps.initial_arrays(), ConfigRecord(), grid))


def test_a_repeated_dp_round_is_refused_once_the_budget_is_spent_every_charge_in_the_ledger(
        ) -> None:
    """The issue's attack: the same DP round re-run with fresh nonces, to average the noise
    away. Every attempt a node joins is charged write-ahead (its own noise share: the
    semi-honest roster is the server's word), so the node stops at its budget."""
    n, budget = 4, 12.0
    policy = SitePolicy(modes=("distributed",), epsilon=budget, round_epsilon=None)
    grid, trained = _grid(n, apps.operated(policy=policy))
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=n),
                                neighbors=None,
                                privacy=DistributedDP(clip_norm=1.0, noise_multiplier=4.0))
    messages = _configure(wrapper, grid)
    for _ in range(40):
        if not wrapper.secure_round(grid, messages, 5):
            break
    done = [r for r in wrapper.reports if r.aborted is None]
    refused = wrapper.reports[len(done):]
    assert len(refused) == 1 and len(done) >= 2
    assert {r.setup.server_round for r in wrapper.reports} == {1}
    assert len({r.setup.nonce for r in wrapper.reports}) == len(wrapper.reports)
    # independently of the ledger: the lone share's event, composed until the budget stops it
    event = distributed_event(replace(dp_params(done[0].setup), threshold=1).replace_one(), 1.0)
    independent = PrivacyBudget(budget, policy.delta)
    expected = []
    while independent.can_run(event):
        expected.append(independent.spend(event)[0])
    assert len(done) == len(expected)
    assert trained.calls == n * len(done)  # the refused attempt trained nobody
    last = [r for r in _reasons(grid)]
    assert len(last) == n and all("[budget]" in r for r in last)
    for node in grid.nodes:
        charges = _ledger(grid, node)
        assert len(charges) == len(done)
        assert all(c["mode"] == "distributed" and "round 1 " in c["label"] for c in charges)
        assert [c["epsilon_after"] for c in charges] == pytest.approx(expected, rel=1e-9)
        assert charges[-1]["epsilon_after"] <= budget
    wrapper.secure_round(grid, messages, 5)  # once spent, it stays refused
    assert all(len(_ledger(grid, node)) == len(done) for node in grid.nodes)
    assert trained.calls == n * len(done)


class WrongLayout(SecureAggregation):
    """Announces a layout the arrays it sends cannot have."""

    def _setup(self, grid: Any, roster: list[int], server_round: int,
               specs: tuple[Any, ...]) -> RoundSetup | None:
        wrong = tuple(ArraySpec(s.name, tuple(reversed(s.shape)), s.dtype)
                      if len(s.shape) > 1 else s for s in specs)
        return super()._setup(grid, roster, server_round, wrong)


@pytest.mark.parametrize("privacy", [None, DistributedDP(clip_norm=1.0, noise_multiplier=5.0)])
def test_a_layout_mismatch_is_refused_before_the_users_training_runs(
        privacy: DistributedDP | None) -> None:
    grid, trained = _grid(4, apps.open_mod)
    wrapper = WrongLayout(FedAvg(fraction_evaluate=0.0, min_available_nodes=4),
                          neighbors=None, privacy=privacy)
    for _ in range(3):  # as often as the server likes: never a training run
        wrapper.secure_round(grid, _configure(wrapper, grid), 5)
    assert all(r.aborted is not None for r in wrapper.reports)
    reasons = _reasons(grid)
    assert len(reasons) == 12 and all("do not match the round setup" in r and "(4, 3)" in r
                                      for r in reasons)
    assert trained.calls == 0
    # the arrays arrive with the masked-input request (the node trains there): the round
    # was charged at its setup and is withdrawn, its masked input never having existed
    charges = [c for node in grid.nodes for c in _ledger(grid, node)]
    assert charges and all(c["withdrawn"] for c in charges), charges


def test_a_thin_secagg_plus_graph_from_stated_zero_rates_is_refused_at_1000_nodes() -> None:
    """The server states dropout and corruption rates of 0, which make k = 3, t = 2 "safe"
    for 1,000 nodes: two colluding neighbours would hold a node's secrets. The node checks
    the graph at its own floors (0.1, 0.1) and names the pair that is safe there."""
    n = 1000
    grid, trained = _grid(n, apps.open_mod)
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=n),
                                dropout_rate=0.0, corrupt_rate=0.0)
    apps.unreleased(wrapper.start, grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    (report,) = wrapper.reports
    assert (report.setup.neighbors, report.setup.threshold) == (3, 2)
    assert report.aborted is not None
    reasons = _reasons(grid)
    assert len(reasons) == n and all(
        "[min_dropout_rate]" in r and "neighbors=49, threshold=27" in r for r in reasons)
    assert trained.calls == 0


@pytest.mark.parametrize("n", [16, 100, 1000, 5000])
def test_the_default_servers_graph_is_accepted_by_the_default_node(n: int,
                                                                   tmp_path: Path) -> None:
    """The server's default rates (0.1, 0.1) meet the node's default floors at every size."""
    k, t = SecureAggregation(FedAvg())._graph(n)
    with open_site_core(policy=SitePolicy(), ledger_path=str(tmp_path / "l.json")) as core:
        core.check_protocol(num_clients=n, threshold=int(t or 0), neighbors=k,
                            security="semi-honest")


def test_the_node_operators_config_overrides_the_apps_policy_and_ledger(tmp_path: Path
                                                                        ) -> None:
    """In a deployment the ClientApp's code comes with the server side's app bundle; the
    node config is the hospital's: its ``secagg-dp`` and ``secagg-ledger`` win."""
    ledgers = tmp_path / "own"
    ledgers.mkdir()
    grid, trained = _grid(4, apps.open_mod, node_config=lambda node: {
        "secagg-dp": "distributed", "secagg-ledger": str(ledgers / f"{node}.json")})
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=4),
                                neighbors=None)
    apps.unreleased(wrapper.start, grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    reasons = _reasons(grid)
    assert len(reasons) == 4 and all("[exact-release]" in r for r in reasons)
    assert trained.calls == 0
    grid.replies.clear()
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=4),
                                neighbors=None,
                                privacy=DistributedDP(clip_norm=1.0, noise_multiplier=5.0))
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    assert wrapper.reports[0].aborted is None and trained.calls == 4
    for node in grid.nodes:
        charges = read_charges(ledgers / f"{node}.json")
        assert [c.mode for c in charges] == ["distributed"]
    assert not list(state_directory().glob("ledger-flower-*.json"))  # no default ledger


def test_a_malicious_mode_round_of_enrolled_nodes_counts_their_noise(tmp_path: Path) -> None:
    """With every key enrolled the roster is authenticated: the node charges the noise the
    calibration threshold's nodes carry, not its lone share (fl.site.core.lone_share)."""
    from secagg import SigningKey

    grid = LocalGrid(None, 4)
    keys = {node: SigningKey.generate() for node in grid.nodes}
    enrolled = frozenset(k.public for k in keys.values())
    grid.app = apps.client_app(None, [make_secagg_mod(lambda ctx: NodeOptions(
        signing_key=keys[ctx.node_id], trusted_keys=enrolled))])
    wrapper = SecureAggregation(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=4), neighbors=None,
        security="malicious", verify_keys={n: k.public for n, k in keys.items()},
        privacy=DistributedDP(clip_norm=1.0, noise_multiplier=3.0))
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    (report,) = wrapper.reports
    assert report.aborted is None
    params = dp_params(report.setup).replace_one()  # the node's one row: replace-one
    calibrated = PrivacyBudget(1e9, 1e-5).epsilon_after(distributed_event(params, 1.0))
    lone = PrivacyBudget(1e9, 1e-5).epsilon_after(
        distributed_event(replace(params, threshold=1), 1.0))
    for node in grid.nodes:
        (charge,) = _ledger(grid, node)
        assert charge["epsilon_after"] == pytest.approx(calibrated, rel=1e-9)
    assert lone > calibrated


def test_a_replayed_setup_is_neither_charged_nor_trained_again() -> None:
    """The same setup sent again (same session) is refused before the ledger and the
    training: replays cannot drain a node's budget or make it train."""
    grid, trained = _grid(4, apps.open_mod)
    grid.silent = lambda node, msg: apps.stage_of(msg) == "unmasking"
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=4),
                                neighbors=None)
    apps.unreleased(wrapper.start, grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    node = grid.nodes[0]
    assert trained.calls == 4 and len(_ledger(grid, node)) == 1
    setup = next(m for m in grid.sent if m.metadata.dst_node_id == node
                 and apps.stage_of(m) == "advertise_keys")
    for _ in range(3):
        reply = grid.deliver(Message(setup.content, dst_node_id=node, message_type="train",
                                     group_id="1"))
        assert reply is not None and reply.has_error()
        assert "already joined this round" in reply.error.reason
    assert trained.calls == 4 and len(_ledger(grid, node)) == 1


@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
def test_a_graph_derived_for_rates_at_or_above_the_nodes_floors_is_accepted(
        security: str, tmp_path: Path) -> None:
    """The node's floors only refuse thinner graphs: (k, t) a server derives for higher
    dropout or corruption rates than the node assumes pass the node's check."""
    from secagg import secagg_plus_parameters

    checked = 0
    with open_site_core(policy=SitePolicy(), ledger_path=str(tmp_path / "l.json")) as core:
        for n in (16, 100, 1000):
            for dropout in (0.1, 0.3):
                for corrupt in (0.1, 0.2):
                    try:
                        graph = secagg_plus_parameters(n, dropout, corrupt, security)
                    except ValueError:
                        continue  # no safe parameters at all: the server runs no round
                    core.check_protocol(num_clients=n, threshold=graph.threshold,
                                        neighbors=graph.neighbors, security=security)
                    checked += 1
    assert checked >= 6


def test_a_fresh_node_id_does_not_give_a_node_a_fresh_budget() -> None:
    """The SuperLink (the server's side) assigns node ids: the default ledger is keyed by the
    node config its operator set, so the same node under new ids keeps its budget."""
    policy = SitePolicy(modes=("distributed",), epsilon=6.0, round_epsilon=None)
    privacy = DistributedDP(clip_norm=1.0, noise_multiplier=4.0)
    runs = []
    for first_node in (1000, 5000, 9000):  # three registrations, three sets of ids
        grid, _ = _grid(4, apps.operated(policy=policy), first_node=first_node)
        wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=4),
                                    neighbors=None, privacy=privacy)
        with contextlib.suppress(NothingReleased):  # refused runs raise
            wrapper.start(grid, apps.initial_arrays(), num_rounds=2, timeout=5)
        runs.append(sum(r.aborted is None for r in wrapper.reports))
    assert runs[0] >= 1 and sum(runs) == runs[0]  # later ids: refused, budget spent
    assert all("[budget]" in r for r in _reasons(grid))
    assert len(_ledger(grid, grid.nodes[0])) == runs[0]
