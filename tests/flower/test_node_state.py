"""Where a node's privacy ledger lives (issue 27, "per-run node state"): in Flower's
simulation engine each run has its own ledgers, so a second simulation on one machine is not
charged with what the first spent; ``$SECAGG_FLOWER_DIR`` (the operator's explicit folder)
wins, and then the second run is charged on top of the first; a node outside the simulation
engine (a SuperNode; the in-process grid stands for one) keeps one ledger across apps.

Three default nodes (no operator policy: distributed DP only), one DP round each run, the
tests' tiny model (tests/flower/apps.py). The simulations start Ray three times: about 3
minutes on this shared 2-core machine at load 9 (most of it the actors' start-up), hence
``slow``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from dp.ledger import read_charges
from fl.flower import DistributedDP, SecureAggregation, secagg_mod
from fl.flower.client import DIR_ENV
from fl.flower.local import LocalGrid
from fl.site.core import state_directory
from tests.flower import apps
from tests.pace import slowdown

ROOT = Path(__file__).resolve().parents[2]
NODES = 3


def _strategy() -> SecureAggregation:
    return SecureAggregation(
        FedAvg(fraction_evaluate=0.0, min_train_nodes=NODES, min_available_nodes=NODES),
        neighbors=None, privacy=DistributedDP(clip_norm=1.0, noise_multiplier=5.0),
        stage_timeout=120 * slowdown())


def _simulate() -> None:
    """One simulation (Flower's engine, Ray backend) of one DP round on default nodes."""
    wrapper = _strategy()
    server = ServerApp()
    done: list[bool] = []

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=120 * slowdown())
        (report,) = wrapper.reports
        assert report.aborted is None and len(report.included) == NODES, report
        done.append(True)

    apps.simulate(server, apps.client_app(None, [secagg_mod]), NODES)
    assert done, "the simulation's server app did not finish its round"


def _charges(folder: Path) -> dict[str, list[float]]:
    """Each default ledger under ``folder``: its charges' epsilon after each."""
    return {p.relative_to(folder).as_posix(): [c.epsilon_after for c in read_charges(p)]
            for p in sorted(folder.rglob("ledger-flower-*.json"))}


@pytest.fixture
def ray_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_DEDUP_LOGS", "0")
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    monkeypatch.delenv(DIR_ENV, raising=False)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_simulations_do_not_share_ledgers_unless_the_folder_is_explicit(
        ray_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    state = state_directory()  # the conftest's $XDG_STATE_HOME/secagg, this test's own
    _simulate()
    first = _charges(state)
    _simulate()
    both = _charges(state)
    second = {k: v for k, v in both.items() if k not in first}
    # each run: its own folder, a ledger per node with that run's one charge
    assert len(first) == NODES and len(second) == NODES, both
    assert all(len(v) == 1 for v in both.values()), both
    assert {k.split("/")[0] for k in first} == {"flower-runs"}
    assert len({k.rsplit("/", 1)[0] for k in both}) == 2  # two run folders
    assert not list(state.glob("ledger-flower-*.json"))  # nothing in the node's own folder
    assert sorted(first.values()) == sorted(second.values())  # the second starts from zero

    # the operator names a folder (here the first run's): it wins, and the third run is
    # charged on top of what the first spent there
    (explicit,) = {state / k.rsplit("/", 1)[0] for k in first}
    monkeypatch.setenv(DIR_ENV, str(explicit))
    _simulate()
    shared = _charges(explicit)
    assert len(shared) == NODES and set(shared) == {k.rsplit("/", 1)[1] for k in first}
    for name, spent in shared.items():
        assert len(spent) == 2 and spent[1] > spent[0] > 0
        assert spent[0] == first[f"{explicit.relative_to(state).as_posix()}/{name}"][0]
    assert len(_charges(state)) == 2 * NODES  # no third run folder


def test_a_node_outside_the_simulation_engine_keeps_its_ledger_across_apps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two apps (two runs, two strategies) on the same nodes: their default ledgers, in the
    node's own folder, are charged by both."""
    monkeypatch.delenv(DIR_ENV, raising=False)
    for run_id in (11, 12):
        grid = LocalGrid(apps.client_app(None, [secagg_mod]), NODES, run_id=run_id)
        wrapper = _strategy()
        wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=60)
        assert wrapper.reports[0].aborted is None
    spent = _charges(state_directory())
    assert len(spent) == NODES and all(k.startswith("ledger-flower-") for k in spent), spent
    assert all(len(v) == 2 and v[1] > v[0] for v in spent.values()), spent
