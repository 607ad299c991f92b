"""Review PoC (distributed DP, Flower server): "the epsilon the server reports equals every
node's ledger". A round that aborts after the nodes' masked inputs left them (here: every
node silent in unmasking) stays charged in each node's ledger (the withdrawal rule: the
masked input left), but the server spends only released rounds: from then on the epsilon it
reports (``RoundReport.node_epsilon`` / ``epsilon``) is below every node's ledger, and its
budget check lets it plan rounds the nodes' budgets no longer hold."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from adversary import threat
from flwr.serverapp.strategy import FedAvg

from fl.flower import DistributedDP, SecureAggregation
from fl.flower.local import LocalGrid
from tests.flower import apps
from tests.flower.test_site_core import _ledger

N = 3


@threat(attack="Under-reported epsilon after a late abort (Flower)",
        adversary="malicious server",
        controls="every node silent in unmasking, after the masked inputs left",
        protocol="once the masked-input request is sent the server spends the round's charged "
                 "event, released or not (fl.round_reply.inputs_requested)")
def test_the_reported_epsilon_equals_the_ledgers_after_a_round_aborted_in_unmasking(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    grid = LocalGrid(None, N)
    grid.app = apps.client_app(mods=[apps.operated()])
    # round 1: every masked input leaves its node, then nobody answers unmasking
    grid.silent = lambda node, msg: (apps.stage_of(msg) == "unmasking"
                                     and msg.metadata.group_id == "1")
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=N),
                                neighbors=None,
                                privacy=DistributedDP(clip_norm=1.0, noise_multiplier=6.0))
    wrapper.start(grid, apps.initial_arrays(), num_rounds=2, timeout=5)
    first, second = wrapper.reports
    assert first.aborted is not None and second.total is not None
    for node in grid.nodes:
        charges = _ledger(grid, node)
        assert [c["withdrawn"] for c in charges] == [None, None]  # both rounds charged
        assert second.node_epsilon == pytest.approx(charges[-1]["epsilon_after"]), (
            f"node {node}: the server reports epsilon {second.node_epsilon:.4g}, the node's "
            f"ledger holds {charges[-1]['epsilon_after']:.4g}")
