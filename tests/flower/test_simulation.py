"""The adapter in Flower's simulation runtime (``run_simulation``, Ray backend): 50 virtual
nodes, some dropping out at random stages, every aggregate checked exactly."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fl.flower import NodeOptions, SecureAggregation, make_secagg_mod
from tests.flower import apps
from tests.pace import slowdown

ROOT = Path(__file__).resolve().parents[2]
NODES = 50


def test_fifty_virtual_nodes_dropping_at_random_stages_every_aggregate_is_exact(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("RAY_DEDUP_LOGS", "0")
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    plan = apps.ranked_drops(2, seed=11)  # 8 of 50 nodes per round, 2 at each stage
    wrapper = SecureAggregation(
        FedAvg(fraction_evaluate=0.0, min_train_nodes=NODES, min_available_nodes=NODES),
        dropout_rate=0.2, metrics=("train_loss",), stage_timeout=120 * slowdown())
    results = []
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        results.append(wrapper.start(grid, apps.initial_arrays(), num_rounds=2,
                                      timeout=120 * slowdown()))

    stages = tmp_path / "stages"  # the nodes' stage records (fl.flower.guard)
    mod = apps.operated(make_secagg_mod(NodeOptions(stage_dir=str(stages))))
    apps.simulate(server, apps.client_app(plan, [mod]), NODES)
    assert len(results) == 1 and len(wrapper.reports) == 2
    for report in wrapper.reports:
        assert report.aborted is None
        assert report.setup.num_clients == NODES and report.setup.neighbors is not None
        assert report.included == apps.expected_included(report, plan)
        assert {n: s for n, s in report.dropped.items()} == {
            n: plan(n, report.server_round, report.setup.roster) for n in report.setup.roster
            if plan(n, report.server_round, report.setup.roster) is not None}
        assert np.array_equal(report.total, apps.expected_total(report))
        assert sorted(report.dropped.values()) == sorted(2 * apps.STAGES)
    # one stage record per node and round, except nodes that dropped before advertising
    assert len(list(stages.iterdir())) == sum(
        NODES - list(r.dropped.values()).count("advertise_keys") for r in wrapper.reports)
    final = results[0].arrays
    expected = apps.weighted_average(wrapper.reports[-1].included, 2)
    for name, value in expected.items():
        np.testing.assert_allclose(final[name].numpy(), value, rtol=1e-6, atol=1e-6)
