"""What a coordinator that stops without finishing leaves behind, across processes.

A coordinator and three sites, each its own ``secagg train`` process on the embedded broker.
Before: any exit of the coordinator told the sites "Done" (retained), so they exited 0 and a
``--resume`` found none; a checkpoint that could not be written exited 2 (the usage-error
code); and a failed run wrote neither the report nor the model of its completed rounds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fl.test_multiprocess_training import (
    COMMON,
    SITES,
    Party,
    federation_broker,
    start,
)
from transport.topics import SERVER_USER

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FAST = ["--local-epochs", "3", "--batch-size", "16"]


def _stop(parties: list[Party]) -> None:
    for party in parties:
        party.kill()


def test_a_full_checkpoint_disk_resumes_without_restarting_sites(tmp_path: Path) -> None:
    """Round 3's checkpoint cannot be written (the directory is gone: a file stands in its
    place, as a full disk fails the write). The coordinator exits 1 with the report and
    model of its three completed rounds, and the sites are not sent home: they wait. Once
    the directory is back, ``--resume`` continues after round 2 with the same site
    processes, which exit 0 when the run is really over."""
    ckpt = tmp_path / "ckpt"
    report, model = tmp_path / "report.json", tmp_path / "model.pt"
    with federation_broker() as urls:
        coordinator, sites = start(urls, report, rounds=4, extra=[
            "--checkpoint", str(ckpt), "--save-model", str(model), *FAST])
        parties = [coordinator, *sites.values()]
        try:
            coordinator.wait_for("round   2/4", timeout=150)
            ckpt.rename(tmp_path / "ckpt.saved")
            ckpt.write_text("not a directory")  # every later write of the checkpoint fails
            code = coordinator.wait(120)
            assert code == 1, coordinator.log  # a runtime failure, not a usage error (2)
            (error,) = [line for line in coordinator.lines if "secagg train: error" in line]
            assert "checkpoint" in error and "--resume" in error, coordinator.log
            first = json.loads(report.read_text())
            assert [r["round"] for r in first["rounds"]] == [1, 2, 3], first["rounds"]
            assert "checkpoint" in first["failed"]
            assert model.exists() and json.loads(
                Path(f"{model}.json").read_text())["rounds"] == 3
            for party in sites.values():  # told the coordinator is away, not done
                party.wait_for("the coordinator went offline", timeout=60)
                assert party.proc.poll() is None, party.log
                assert "the coordinator finished" not in party.log, party.log
                assert "the coordinator went offline" in party.log, party.log
            ckpt.unlink()
            (tmp_path / "ckpt.saved").rename(ckpt)
            report.unlink()
            resumed = Party(["--role", "coordinator", "--sites", "1,2,3", "--rounds", "4",
                             "--dp", "none", "--broker", urls[SERVER_USER], "--report",
                             str(report), "--join-timeout", "60", "--ready-timeout", "90",
                             "--insecure-verify", "--checkpoint", str(ckpt), "--resume",
                             *COMMON, *FAST])
            parties.append(resumed)
            assert resumed.wait(150) == 0, resumed.log
            assert "resumed from" in resumed.log and "after round 2" in resumed.log
            for party in sites.values():
                assert party.wait(30) == 0, party.log
                assert "the coordinator finished after 4 rounds" in party.log, party.log
        finally:
            _stop(parties)
    rows = json.loads(report.read_text())["rounds"]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert all(r["included"] == list(SITES) and r["aggregate_correct"] for r in rows)


def test_a_run_failing_at_round_n_writes_round_n_minus_1(tmp_path: Path) -> None:
    """Two of three sites are killed after round 2: round 3 cannot reach the threshold and
    fails after its attempts (each retry waits, backing off, for the sites to come back).
    The coordinator exits 1 having written the report and the model of rounds 1 and 2; the
    remaining site is not told the run is over."""
    report, model = tmp_path / "report.json", tmp_path / "model.pt"
    with federation_broker() as urls:
        coordinator, sites = start(urls, report, rounds=6, extra=[
            "--save-model", str(model), "--max-attempts", "3", "--ready-timeout", "10",
            *FAST])
        parties = [coordinator, *sites.values()]
        try:
            coordinator.wait_for("round   2/6", timeout=150)
            sites[2].kill()
            sites[3].kill()
            assert coordinator.wait(120) == 1, coordinator.log
            assert sites[1].proc.poll() is None, sites[1].log
            assert "the coordinator finished" not in sites[1].log
        finally:
            _stop(parties)
    out = json.loads(report.read_text())
    done = [r["round"] for r in out["rounds"]]
    assert done in ([1, 2], [1, 2, 3]), done  # round 3 may have completed before the kill
    assert "failed" in out and f"round {len(done) + 1} failed" in out["failed"]
    assert json.loads(Path(f"{model}.json").read_text())["rounds"] == len(done)
    assert "retrying within 2 s" in coordinator.log and "retrying within 4 s" in coordinator.log
