"""Review PoC, the NVFlare runtime (as tests/security/test_review_epsilon_after_abort.py for
Flower): a distributed-DP round that aborts in unmasking (every site fails the unmasking
task, after its masked input left it) stays charged in each site's ledger; the server must
spend it too, so the epsilon it reports after the next round equals every site's ledger."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("nvflare.apis")

HERE = Path(__file__).resolve().parents[1] / "nvflare"
sys.path.insert(0, str(HERE))

from adversary import threat  # noqa: E402
from nvflare_sites import run_job  # noqa: E402

from dp.ledger import read_charges  # noqa: E402
from fl.nvflare.server import SecureFedAvg  # noqa: E402


@threat(attack="Under-reported epsilon after a late abort (NVFlare)",
        adversary="malicious server",
        controls="every site silent in unmasking, after the masked inputs left",
        protocol="SecureFedAvg spends the charged event once the masked-input request is sent")
def test_the_reported_epsilon_equals_the_ledgers_after_a_round_aborted_in_unmasking(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = [f"site-{i}" for i in range(1, 4)]
    server = SecureFedAvg(num_rounds=2, neighbors=None, stage_timeout=60.0, train_timeout=120,
                          dp={"clip_norm": 1.0, "noise_multiplier": 6.0},
                          report_path=str(tmp_path / "reports.jsonl"))
    run_job(tmp_path, monkeypatch, server, {n: {"modes": ["distributed"]} for n in names},
            {n: {"0": ["unmasking", "fail", 0]} for n in names})
    first, second = [json.loads(line) for line in
                     Path(server.report_path).read_text().splitlines()]
    assert first["aborted"] is not None and second["total"] is not None
    for name in names:
        charges = read_charges(tmp_path / "sites" / name / "ledger.json")
        assert [c.withdrawn for c in charges] == [None, None]  # both rounds stay charged
        assert second["node_epsilon"] == pytest.approx(charges[-1].epsilon_after), (
            f"{name}: the server reports epsilon {second['node_epsilon']}, the site's "
            f"ledger holds {charges[-1].epsilon_after}")
