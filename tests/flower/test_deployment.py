"""The adapter on Flower's real transport: a SuperLink and three SuperNodes as separate
processes on 127.0.0.1 (``--insecure``, the closest flwr 1.42 offers offline), the app
submitted with ``flwr run``; every ClientApp runs in its own process, so the node's round
state crosses messages only through ``Context.state``. One node drops before its masked
input; the round completes and the aggregate equals the plaintext sum of the others. The
nodes' policy and ledger come from their operators' ``--node-config`` (fl.flower.client)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from dp.ledger import read_charges
from tests.flower import apps
from tests.flower.processes import environment, free_port, start, stop, wait_http

ROOT = Path(__file__).resolve().parents[2]
APP = Path(__file__).resolve().parent / "deploy_app"
NODES = 3


def test_superlink_and_supernodes_as_processes_one_node_drops_the_round_is_exact(
        tmp_path: Path) -> None:
    home = tmp_path / "flwr-home"
    home.mkdir()
    link = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
        f'address = "127.0.0.1:{link}"\ninsecure = true\n')
    env = environment(home, ROOT)
    report_path = tmp_path / "report.json"
    processes = []
    try:
        processes.append(start(["flower-superlink", "--insecure", "--host", "127.0.0.1",
                                "--port", str(link), "--database", str(tmp_path / "link.db"),
                                "--disable-runtime-dependency-installation"],
                               env, tmp_path / "superlink.log"))
        wait_http(link, "/health", time.monotonic() + 60)
        for partition in range(NODES):
            processes.append(start(
                ["flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{link}",
                 "--host", "127.0.0.1", "--port", str(free_port()),
                 # the node operator's own word: exact sums (opt-in) and its ledger
                 "--node-config", f"partition-id={partition} num-partitions={NODES} "
                 f"secagg-dp='none' secagg-ledger='{tmp_path / f'ledger-{partition}.json'}'"],
                env, tmp_path / f"supernode{partition}.log"))
        run = subprocess.run(
            [str(Path(env["PATH"].split(":")[0]) / "flwr"), "run", str(APP), "local",
             "--stream", "--run-config",
             f"report-path='{report_path}' num-nodes={NODES} num-server-rounds=1"],
            env=env, capture_output=True, text=True, timeout=240)
        if not report_path.exists():
            logs = "\n".join(p.read_text()[-2000:] for p in sorted(tmp_path.glob("*.log")))
            pytest.fail(f"the ServerApp wrote no report\n{run.stdout[-3000:]}\n"
                        f"{run.stderr[-2000:]}\n{logs}")
    finally:
        stop(processes)
    records = list((home / "tmp").glob("secagg-flower-*/node-*/*"))
    assert len(records) == NODES  # each node kept its stage record for the round
    for partition in range(NODES):  # each node charged the round to the ledger it was given
        ledger = tmp_path / f"ledger-{partition}.json"
        assert [(c.mode, c.kind) for c in read_charges(ledger)] == [("none", "train")]
        assert json.loads(ledger.read_text().splitlines()[0])["policy"]["modes"] == ["none"]
    out = json.loads(report_path.read_text())
    (data,) = out["reports"]
    report = apps.report_from_json(data)
    assert report.aborted is None
    assert report.setup.num_clients == NODES and report.setup.neighbors is None
    assert list(report.dropped.values()) == ["masked_input"]
    (dropped,) = report.dropped
    assert report.included == frozenset(report.setup.roster) - {dropped}
    assert np.array_equal(report.total, apps.expected_total(report))
    expected = apps.weighted_average(report.included, 1)
    for name, value in expected.items():
        np.testing.assert_allclose(np.array(out["arrays"][name]), value, rtol=1e-6, atol=1e-6)
