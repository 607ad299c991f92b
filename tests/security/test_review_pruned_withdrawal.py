"""Review PoC (withdrawal rule, Flower runtime): "a charge is withdrawn exactly when the
site's masked input never left it". A Flower node decides whether to withdraw an unfinished
round's charge from that round's stage record (fl/flower/client.py ``_previous``). Stage
records live in the node's directory, shared by every run of the node, and are pruned to the
``keep_rounds`` most recent (fl/flower/guard.py ``prune``). A malicious server:

1. runs round A of run 1 through masked_input (the node's masked input leaves it), then
   stops (no unmasking: the round is unfinished in the node's run-1 state);
2. runs ``keep_rounds`` rounds of another run on the same node (each abandoned before its
   masked input, so they cost the node no budget): A's stage record is pruned;
3. sends a new setup in run 1: the node finds no record of A, reads it as "never
   advertised" and withdraws A's charge, although A's masked input left.

``keep_rounds=1`` (an operator's setting) makes the PoC short; with the default (1024) the
server only needs more setups in step 2."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from adversary import threat
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from fl.errors import NothingReleased
from fl.flower import DistributedDP, NodeOptions, SecureAggregation, make_secagg_mod
from fl.flower.local import LocalGrid
from tests.flower import apps
from tests.flower.test_site_core import _ledger

N = 3
PRIVACY = DistributedDP(clip_norm=1.0, noise_multiplier=6.0)


def _grid(run_id: int, keep_rounds: int) -> LocalGrid:
    grid = LocalGrid(None, N, run_id=run_id)  # the same node ids and node config: same node
    grid.app = apps.client_app(mods=[apps.operated(make_secagg_mod(
        NodeOptions(keep_rounds=keep_rounds)))])
    return grid


def _round(grid: LocalGrid) -> None:
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=N),
                                neighbors=None, privacy=PRIVACY)
    with contextlib.suppress(NothingReleased):  # these rounds release nothing
        wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)


@threat(attack="Withdrawal of a charge whose masked input left",
        adversary="malicious server",
        controls="rounds of another run on the node until the stage record of a round past "
                 "masked_input is pruned, then a new setup in the first run",
        protocol="a missing or aborted stage record keeps the charge; only the abort path "
                 "withdraws, when the input never existed")
def test_a_charge_whose_masked_input_left_is_never_withdrawn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    first = _grid(run_id=7, keep_rounds=1)
    node = first.nodes[0]
    # 1. run 7, round A: every node sends its masked input; the server then stops
    first.silent = lambda n, msg: apps.stage_of(msg) == "unmasking"
    _round(first)
    # its masked input left: it was asked for it and answered with the chunked input
    assert any(m.metadata.src_node_id == node and not m.has_error()
               and m.content.array_records for m in first.replies)
    (a,) = _ledger(first, node)
    assert a["withdrawn"] is None
    # 2. another run on the same node: its round's stage record pushes A's out
    other = _grid(run_id=8, keep_rounds=1)
    other.silent = lambda n, msg: apps.stage_of(msg) == "share_keys"
    _round(other)
    # 3. run 7 again: a new setup (the node abandons A)
    TaskIdentity.run_id = 7  # LocalGrid sets the process's run id: back to run 7's
    first.silent = lambda n, msg: apps.stage_of(msg) == "share_keys"
    _round(first)
    charges = {c["id"]: c for c in _ledger(first, node)}
    assert charges[a["id"]]["withdrawn"] is None, (
        "the charge of a round whose masked input left the node was withdrawn: "
        f"{charges[a['id']]['withdrawn']}")
