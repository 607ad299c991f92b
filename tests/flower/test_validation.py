"""Input validation through the Flower runtime (``SecureAggregation(norm_bound=...)``, the
site session's proof, docs/protocol.md 10): a node that scales its update is refused, named
and left out, and the global model is the honest nodes' own; an honest round with
validation equals the round without it; under distributed DP the bound is the clip, noise
included (fl/input_bound.py)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

pytest.importorskip("py_arkworks_bls12381")

from flwr.app import Message
from flwr.serverapp.strategy import FedAvg

from fl.flower import DistributedDP, NodeOptions, SecureAggregation, make_secagg_mod
from fl.flower.local import LocalGrid
from fl.input_bound import dp_bound
from fl.round_setup import dp_params
from fl.site.session import SiteSession
from tests.flower import apps
from tests.scaling_site import scaling

N = 5
BOUND = 40.0  # an honest node's row [w x, w]: w <= 7, 16 values in [-1, 1]: norm < 29


class ScalingNode(NodeOptions):
    """A node whose session is the scaling attacker's (tests/scaling_site.py)."""

    def session(self, context: Any) -> SiteSession:
        return scaling(super().session(context))


def _grid(attacker: int | None = None, policy: Any = apps.OPEN) -> LocalGrid:
    grid = LocalGrid(None, N)
    honest = apps.operated(policy=policy)
    evil = apps.operated(make_secagg_mod(ScalingNode()), policy=policy)
    target = None if attacker is None else grid.nodes[attacker]

    def mod(msg: Message, context: Any, call_next: Any) -> Message:
        return (evil if context.node_id == target else honest)(msg, context, call_next)

    grid.app = apps.client_app(mods=[mod])
    return grid


def _run(grid: LocalGrid, **options: Any) -> tuple[SecureAggregation, Any]:
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=N),
                                neighbors=None, **options)
    result = wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=30)
    return wrapper, result


def test_an_honest_round_with_validation_equals_the_round_without() -> None:
    plain, plain_result = _run(_grid())
    checked, checked_result = _run(_grid(), norm_bound=BOUND)
    (before,), (after,) = plain.reports, checked.reports
    assert after.setup.norm_bound == BOUND and before.setup.norm_bound is None
    assert after.input_refused == {} and after.included == before.included == frozenset(
        after.setup.roster)
    assert np.array_equal(after.total, before.total)
    for name in apps.SHAPES:
        assert np.array_equal(checked_result.arrays[name].numpy(),
                              plain_result.arrays[name].numpy())
    # the proofs travelled: each node sent more in masked_input than without validation
    assert all(after.bytes_up[n] > before.bytes_up[n] + 10_000 for n in after.setup.roster)


def test_a_scaling_node_is_refused_named_and_the_model_is_the_honest_nodes(
        caplog: pytest.LogCaptureFixture) -> None:
    grid = _grid(attacker=2)
    attacker = grid.nodes[2]
    honest = frozenset(grid.nodes) - {attacker}
    with caplog.at_level(logging.WARNING):
        wrapper, result = _run(grid, norm_bound=BOUND)
    (report,) = wrapper.reports
    assert set(report.input_refused) == {attacker}  # named, and no honest node is
    assert "input proof refused" in report.input_refused[attacker]
    assert report.included == honest and report.aborted is None
    assert report.dropped == {attacker: "masked_input"}
    assert np.array_equal(report.total, apps.expected_total(report))
    for name, value in apps.weighted_average(honest, 1).items():
        np.testing.assert_allclose(result.arrays[name].numpy(), value, rtol=1e-6, atol=1e-6)


def test_without_a_bound_the_scaling_node_replaces_the_model() -> None:
    """The same attacker in a round without validation: its update is in the sum and moves
    the model far from the honest nodes' average (what the bound prevents)."""
    grid = _grid(attacker=2)
    honest = frozenset(grid.nodes) - {grid.nodes[2]}
    wrapper, result = _run(grid)
    (report,) = wrapper.reports
    assert report.included == frozenset(grid.nodes) and report.input_refused == {}
    own = apps.weighted_average([grid.nodes[2]], 1)
    for name, value in apps.weighted_average(honest, 1).items():
        got = result.arrays[name].numpy()
        assert np.linalg.norm(got - own[name]) < 0.05 * np.linalg.norm(got - value)


def test_under_distributed_dp_the_bound_is_the_clip_noise_included() -> None:
    """Every honest node's update is far above the clip (clipped to it, then noised) and
    passes; the scaling node is refused and named; the bound is fl.input_bound's."""
    grid = _grid(attacker=1, policy=apps.LOOSE)
    attacker = grid.nodes[1]
    privacy = DistributedDP(clip_norm=0.5, noise_multiplier=1.0)
    wrapper, _ = _run(grid, privacy=privacy, norm_bound="clip")
    (report,) = wrapper.reports
    setup = report.setup
    assert setup.mode == "distributed" and setup.norm_bound == 0.5
    assert setup.input_bound == dp_bound(dp_params(setup))
    assert set(report.input_refused) == {attacker} and report.aborted is None
    assert report.included == frozenset(grid.nodes) - {attacker}
    with pytest.raises(ValueError, match="norm_bound='clip'"):
        SecureAggregation(FedAvg(), privacy=privacy, norm_bound=3.0)
    with pytest.raises(ValueError, match="distributed DP"):
        SecureAggregation(FedAvg(), norm_bound="clip")


def test_an_honest_node_above_the_bound_is_clipped_by_its_weight_never_refused() -> None:
    """At a bound below some honest rows, those nodes lower their weight to fit it
    (fl.input_bound.capped_weight): nobody is refused, and the model is the weighted
    average with the capped weights (the row [w x, w] clipped to the bound)."""
    tight = 12.0
    wrapper, result = _run(_grid(), norm_bound=tight)
    (report,) = wrapper.reports
    assert report.input_refused == {} and report.included == frozenset(report.setup.roster)
    assert np.array_equal(report.total, apps.expected_total(report))
    weights, total = {}, {}
    for node in report.included:
        content = apps.reply_content(node, 1)
        arrays = {k: a.numpy().astype(np.float64) for k, a in content["arrays"].items()}
        row = np.sqrt(sum(float(np.sum(a * a)) for a in arrays.values()) + 1.0)
        weights[node] = min(float(content["metrics"]["num-examples"]), tight / row)
        for k, a in arrays.items():
            total[k] = total.get(k, 0) + weights[node] * a
    assert sum(w < float(apps.reply_content(n, 1)["metrics"]["num-examples"])
               for n, w in weights.items()) >= 2  # the bound did bite
    for name, value in total.items():
        np.testing.assert_allclose(result.arrays[name].numpy(), value / sum(weights.values()),
                                   rtol=1e-5, atol=1e-6)
