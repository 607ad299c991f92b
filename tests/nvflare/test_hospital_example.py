"""examples/nvflare-hospital/job.py as its user runs it: ``--exact`` writes each simulated
hospital's opt-in in the folder its site reads (``$XDG_STATE_HOME``, as the site does), so
the exact sums are taken; ``--undo-exact`` takes the opt-in back (an operator's own policy
is kept); the default workspace is the user's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nvflare.apis")  # not the namespace of tests/nvflare/ itself
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "examples" / "nvflare-hospital" / "job.py"


def test_the_exact_opt_in_follows_the_sites_state_home_and_can_be_undone(
        tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SECAGG_NVFLARE_DIR"}
    env |= {"XDG_STATE_HOME": str(tmp_path / "state"), "PYTHONPATH": str(ROOT)}

    def job(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(JOB), "--hospitals", "3", *argv],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=400, check=False)

    ran = job("--exact", "--rounds", "1", "--workspace", str(tmp_path / "ws"))
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "round 0: summed ['site-1', 'site-2', 'site-3']" in ran.stdout
    sites = tmp_path / "state" / "secagg" / "nvflare"
    policies = [sites / f"site-{i}" / "policy.json" for i in (1, 2, 3)]
    assert all(json.loads(p.read_text())["modes"] == ["none", "distributed"] for p in policies)
    policies[1].write_text(json.dumps({"modes": ["none"], "min_threshold": 2}))  # the operator's
    undone = job("--undo-exact")
    assert undone.returncode == 0, undone.stderr
    assert not policies[0].exists() and policies[1].exists() and not policies[2].exists()
    assert "kept" in undone.stdout
    helped = subprocess.run([sys.executable, str(JOB), "--help"], env=env,
                            capture_output=True, text=True, timeout=60, check=True)
    assert "one per user" in helped.stdout
