"""Input validation through the NVFlare runtime (``SecureFedAvg(norm_bound=...)``, the
executor's site session sends its proof with its masked input, docs/protocol.md 10), on
NVFlare's simulator: a site that scales its update (tests/scaling_site.py) is refused and
named in the round's report, the sum is the honest sites' and the saved model is their
weighted average, exactly as in a round without the attacker."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("nvflare.apis")  # not the namespace of tests/nvflare/ itself
pytest.importorskip("py_arkworks_bls12381")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from nvflare_sites import inputs, plain_sum, run_job  # noqa: E402
from site_data import local_training  # noqa: E402

from fl.nvflare.server import SecureFedAvg  # noqa: E402

BOUND = 1000.0  # an honest site's row [w x, w]: w ~ 23 rows, x near arange(1, 10): ~400


def test_a_scaling_site_is_refused_named_and_the_model_is_the_honest_sites(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = [f"site-{i}" for i in range(1, 5)]
    server = SecureFedAvg(num_rounds=1, neighbors=None, norm_bound=BOUND, stage_timeout=60.0,
                          train_timeout=120, report_path=str(tmp_path / "reports.jsonl"))
    run_job(tmp_path, monkeypatch, server, {n: {"modes": ["none"]} for n in names}, {},
            scaling=("site-3",))
    (report,) = [json.loads(line) for line in
                 Path(server.report_path).read_text().splitlines()]
    honest = [n for n in names if n != "site-3"]
    assert list(report["input_refused"]) == ["site-3"]  # named; no honest site is
    assert "input proof refused" in report["input_refused"]["site-3"]
    assert report["included"] == honest and report["aborted"] is None
    assert report["dropped"] == {"site-3": "masked_input"}
    assert report["total"] == plain_sum(inputs(tmp_path / "record", 0, honest), 64)
    x = np.arange(1, 10, dtype=np.float32).reshape(3, 3)  # NPModelPersistor's default model
    trained = [local_training(s, x) for s in honest]
    mean = sum(n * w for w, _, n in trained) / sum(n for _, _, n in trained)
    saved = np.load(next((tmp_path / "ws").rglob("server.npy")))
    np.testing.assert_allclose(saved, mean, rtol=1e-6, atol=1e-6)
