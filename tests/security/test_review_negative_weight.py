"""Review PoC (input validation, fixed point): the proved bound is on the L2 norm of the row
``[w x, w m, w]``, but nothing proves the weight coordinate ``w`` is non-negative. A site with
a valid login sends a *negative* weight that cancels the honest nodes' summed weight down to
a hair above zero; its row is well within the bound, its proof passes, it is never named, and
the server divides the honest weighted sum by that hair: the global model is blown up by
orders of magnitude (or, with the weight a little lower, the round releases nothing)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

pytest.importorskip("py_arkworks_bls12381")

from adversary import threat
from flwr.app import Message
from flwr.serverapp.strategy import FedAvg

from fl.flower import NodeOptions, SecureAggregation, make_secagg_mod
from fl.flower.local import LocalGrid
from fl.round_setup import _fixed
from fl.site.session import Joined, SiteSession
from tests.flower import apps

N = 5
BOUND = 40.0  # as tests/flower/test_validation.py: every honest row is below it
DELTA = 0.01  # the summed weight the attacker leaves


@pytest.fixture(autouse=True)
def _own_state(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The nodes' ledgers and stage records per test (as tests/flower/conftest.py)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


class NegativeWeightSession(SiteSession):
    """Encodes the row ``[0, ..., 0, -(sum of the others' weights) + DELTA]``: norm < BOUND."""

    def encode(self, joined: Joined, arrays: Any, metrics: Mapping[str, float],
               weight: float) -> Any:
        setup = joined.setup
        me = setup.node_of(joined.client_id)
        others = sum(float(apps.reply_content(n, setup.server_round)["metrics"]["num-examples"])
                     for n in setup.roster if n != me)
        row = np.zeros(setup.model_dim + len(setup.metrics) + 1)
        row[-1] = -others + DELTA
        assert np.linalg.norm(row) < BOUND  # within the proved bound
        return _fixed(setup).encode(row)


class NegativeWeightNode(NodeOptions):
    def session(self, context: Any) -> SiteSession:
        evil = NegativeWeightSession.__new__(NegativeWeightSession)
        evil.__dict__.update(super().session(context).__dict__)
        return evil


def _grid(attacker: int) -> LocalGrid:
    grid = LocalGrid(None, N)
    honest = apps.operated()
    evil = apps.operated(make_secagg_mod(NegativeWeightNode()))
    target = grid.nodes[attacker]

    def mod(msg: Message, context: Any, call_next: Any) -> Message:
        return (evil if context.node_id == target else honest)(msg, context, call_next)

    grid.app = apps.client_app(mods=[mod])
    return grid


@threat(attack="A negative weight within the norm bound",
        adversary="malicious client",
        controls="its row: zeros with a weight of minus the honest total plus 0.01, and an honest"
                 " proof of it",
        protocol="nothing yet: the proof bounds the row's norm, not the weight's sign; the "
                 "weighted average divides by almost nothing",
        shows="limitation")
@pytest.mark.xfail(strict=True, reason="review finding, not fixed: the proof bounds the row's "
                   "L2 norm, not the sign of its weight coordinate (fl/input_bound.py)")
def test_a_negative_weight_within_the_bound_does_not_blow_up_the_model() -> None:
    grid = _grid(attacker=2)
    attacker = grid.nodes[2]
    honest = frozenset(grid.nodes) - {attacker}
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=N),
                                neighbors=None, norm_bound=BOUND)
    try:
        result = wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=30)
    except Exception:  # nothing released is the safe outcome of this attack too
        result = None
    (report,) = wrapper.reports
    if result is None or report.total is None:
        # refused: then the attacker must be named (claim: refused and named)
        assert attacker in report.input_refused, report
        return
    expected = apps.weighted_average(honest, 1)
    for name, value in expected.items():
        got = result.arrays[name].numpy()
        # the attacker's row is bounded by BOUND, so it may move the sum by BOUND, not
        # multiply the honest average by (sum of honest weights) / DELTA
        assert np.linalg.norm(got) < 10 * max(np.linalg.norm(value), 1.0), (
            f"{name}: |model| = {np.linalg.norm(got):.1f}, honest average "
            f"{np.linalg.norm(value):.2f}; attacker {attacker} named? "
            f"{attacker in report.input_refused}")
