"""NVFlare's simulator runs securely aggregated jobs (fl.nvflare): several sites, a few
rounds, sites dropped at chosen stages (failing or stalling past the stage deadline), a
site whose policy refuses the job, and a dishonest zero-noise round. Every round's secure
sum is checked exactly against the plaintext sum of the inputs the included sites recorded,
and the saved model against its decode."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nvflare.apis")  # not the namespace of tests/nvflare/ itself

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from nvflare_sites import (  # noqa: E402
    ZeroNoiseFedAvg,
    inputs,
    lost_at_start,
    plain_sum,
    run_job,
)

from dp.ledger import Ledger, read_charges  # noqa: E402
from dp.policy import SitePolicy  # noqa: E402
from fl.codec import FixedPointCodec, decode_weighted  # noqa: E402
from fl.nvflare.server import SecureFedAvg  # noqa: E402
from secagg import SigningKey  # noqa: E402
from tests.pace import slowdown  # noqa: E402


def _run(tmp: Path, monkeypatch: pytest.MonkeyPatch, server: Any, sites: dict[str, dict],
         drops: dict[str, dict[str, list[Any]]], zero_round: int = -1
         ) -> list[dict[str, Any]]:
    """Run a job of ``server`` on the simulator (nvflare_sites.run_job); the round reports
    (``_run.status``: the simulator's exit status)."""
    run_job(tmp, monkeypatch, server, sites, drops, zero_round)
    _run.status = run_job.status  # type: ignore[attr-defined]
    return [json.loads(line) for line in Path(server.report_path).read_text().splitlines()]


STAGE = 5.0  # seconds: the stage deadline of the drop test below
TRAIN = 60.0
"""Seconds: the train stage's deadline on an idle host, times the host's pace in every test
(tests/pace.py). Every site trains honestly here, so it is only a ceiling: a fixed 60 s
dropped an honest site of the FedAdam test once on a host at load average 9 (the test
then took 199 s and failed on its ``included``)."""


def test_secagg_rounds_with_drops_at_three_stages_and_a_refusing_site(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exact = {"modes": ["none", "distributed"]}
    sites = {f"site-{i}": exact for i in range(1, 5)} | {"site-5": {}}  # site-5: DP only
    # The stage deadline is what drops site-1 in round 2, so it must be long enough that an
    # honest site on a loaded host never misses it (1 s failed under a CPU hog on two
    # cores), and site-1 stalls three times as long so its late answer cannot be taken.
    stage = STAGE * slowdown()  # the host's pace (tests/pace.py)
    server = SecureFedAvg(num_rounds=3, neighbors=None, stage_timeout=stage,
                          train_timeout=TRAIN * slowdown(),
                          report_path=str(tmp_path / "reports.jsonl"))
    reports = _run(tmp_path, monkeypatch, server, sites, {
        "site-2": {"0": ["advertise_keys", "fail"]},  # its training fails
        "site-3": {"1": ["masked_input", "fail"]},  # after sharing its keys: mask recovered
        "site-1": {"2": ["unmasking", "stall", 3 * stage]},  # silent past the deadline
    })
    assert [r["server_round"] for r in reports] == [0, 1, 2]
    expected_drops = [{"site-2": "advertise_keys", "site-5": "advertise_keys"},
                      {"site-3": "masked_input", "site-5": "advertise_keys"},
                      {"site-1": "unmasking", "site-5": "advertise_keys"}]
    for report, dropped in zip(reports, expected_drops, strict=True):
        assert report["dropped"] == dropped and report["aborted"] is None
        included = sorted(set(sites) - set(dropped) | ({"site-1"} if "site-1" in dropped
                                                       else set()))
        assert report["included"] == included  # site-1's masked input is in round 2's sum
        assert report["total"] == plain_sum(inputs(tmp_path / "record", report["server_round"],
                                                     included), 64)
        assert set(report["seconds"]) == {"advertise_keys", "share_keys", "masked_input",
                                          "unmasking"}
        assert all(report["bytes_up"][s] > 0 for s in included)
    assert reports[2]["seconds"]["unmasking"] >= stage  # waited out site-1's deadline
    # no input of the refusing site was ever computed, and its ledger has no charge
    assert not list((tmp_path / "record").glob("site-5-*"))
    with Ledger.open(tmp_path / "sites" / "site-5" / "ledger.json", SitePolicy()) as ledger:
        assert ledger.releases == 0
    # the saved model is the decoded weighted average of the last round's plaintext inputs
    codec = FixedPointCodec(10, bits=64, frac_bits=24, max_summands=5)
    plain = np.array(plain_sum(inputs(tmp_path / "record", 2, reports[2]["included"]), 64),
                     dtype=np.uint64)
    average, _ = decode_weighted(codec, plain)
    saved = next((tmp_path / "ws").rglob("server.npy"))
    np.testing.assert_array_equal(np.load(saved).ravel(), average[:9].astype(np.float32))


def test_malicious_distributed_dp_budget_and_a_zero_noise_round_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = [f"site-{i}" for i in range(1, 5)]
    keys = {name: SigningKey.generate() for name in names}
    trusted = [k.public.hex() for k in keys.values()]
    for name, key in keys.items():
        folder = tmp_path / "sites" / name
        folder.mkdir(parents=True)
        (folder / "signing-key").write_text(key.private_bytes().hex())
        (folder / "trusted-keys.json").write_text(json.dumps(trusted))
    dp = {"clip_norm": 1.0, "epsilon": 8.0, "delta": 1e-5, "rounds": 2}
    server = ZeroNoiseFedAvg(num_rounds=4, neighbors=None, security="malicious",
                             verify_keys={n: k.public.hex() for n, k in keys.items()}, dp=dp,
                             stage_timeout=1.0 * slowdown(), train_timeout=TRAIN * slowdown(),
                             report_path=str(tmp_path / "reports.jsonl"))
    uncapped = {"min_noise_multiplier": 0, "round_epsilon": None, "epsilon": None}
    reports = _run(tmp_path, monkeypatch, server, {n: uncapped for n in names},
                   {"site-2": {"2": ["consistency_check", "fail"]}}, zero_round=1)
    first, zero, third, fourth = reports
    # round 1: every site's policy refuses the zero-noise release before training
    assert zero["aborted"] is not None and zero["total"] is None
    assert zero["dropped"] == {n: "advertise_keys" for n in names}
    assert not list((tmp_path / "record").glob("*-r1.npy"))
    # rounds 0 and 2 run (site-2 drops in round 2's consistency check); round 3 would
    # overshoot the budget and is not run
    assert first["included"] == names and first["dropped"] == {}
    assert third["dropped"] == {"site-2": "consistency_check"}
    assert third["included"] == names  # its masked input arrived before it dropped
    assert set(third["seconds"]) >= {"consistency_check", "unmasking"}
    for report in (first, third):
        assert report["mode"] == "distributed" and report["security"] == "malicious"
        assert report["total"] == plain_sum(inputs(tmp_path / "record", report["server_round"],
                                                     report["included"]), report["bits"])
    assert 0 < first["epsilon"] < third["epsilon"] <= dp["epsilon"]
    assert fourth["skipped"] is not None and "budget" in fourth["skipped"]
    for name in names:  # each site charged rounds 0 and 2, never the refused round
        charges = read_charges(tmp_path / "sites" / name / "ledger.json")
        assert len([c for c in charges if c.withdrawn is None]) == 2


def test_secure_fedadam_equals_numpy_fedadam_over_the_plain_weighted_mean_and_averages_loss(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SecureFedAvg(strategy="fedadam"): three rounds of three sites of unequal weights;
    each round's model equals Adam (Reddi et al. 2021, written out here in numpy) over the
    plain weighted mean of the sites' own training from the model sent, and the round's
    securely averaged train loss equals the weighted mean of the sites' losses."""
    from site_data import local_training

    names = ["site-1", "site-22", "site-333"]  # 23, 24 and 25 rows: unequal weights
    lr, beta1, beta2, tau = 0.1, 0.9, 0.99, 1e-3
    server = SecureFedAvg(num_rounds=3, neighbors=None, strategy="fedadam", server_lr=lr,
                          server_beta1=beta1, server_beta2=beta2, server_tau=tau,
                          metrics=["loss"], stage_timeout=60.0 * slowdown(),
                          train_timeout=TRAIN * slowdown(),
                          report_path=str(tmp_path / "reports.jsonl"))
    reports = _run(tmp_path, monkeypatch, server,
                   {n: {"modes": ["none"]} for n in names}, {})
    x = np.arange(1, 10, dtype=np.float32).reshape(3, 3)  # NPModelPersistor's default model
    m = v = np.zeros((3, 3))
    for report in reports:
        assert report["included"] == names and report["dropped"] == {}
        trained = [local_training(s, x) for s in names]
        rows = sum(n for _, _, n in trained)
        mean = sum(n * w for w, _, n in trained) / rows
        loss = sum(n * f for _, f, n in trained) / rows
        assert report["metrics"]["loss"] == pytest.approx(loss, rel=1e-6)
        delta = mean - x
        m = beta1 * m + (1 - beta1) * delta
        v = beta2 * v + (1 - beta2) * delta ** 2
        x = (x + lr * m / (np.sqrt(v) + tau)).astype(np.float32)
    assert float(np.max(np.abs(x - np.arange(1, 10).reshape(3, 3)))) > 0.1  # it moved
    saved = np.load(next((tmp_path / "ws").rglob("server.npy")))
    np.testing.assert_allclose(saved, x, rtol=1e-6, atol=1e-6)


def test_secagg_plus_on_a_sparse_graph_with_drops(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """SecAgg+ through NVFlare: seven sites, each masking with 4 of its 6 peers (neighbors=5
    with itself); a site that fails after sharing its keys has its masks recovered from its
    neighbours' shares, a site silent at unmasking stays in the sum; every total equals the
    plaintext sum of the included sites' inputs."""
    names = [f"site-{i}" for i in range(1, 8)]
    stage = 2.0 * slowdown()  # the host's pace (tests/pace.py)
    server = SecureFedAvg(num_rounds=2, neighbors=5, stage_timeout=stage,
                          train_timeout=TRAIN * slowdown(),
                          report_path=str(tmp_path / "reports.jsonl"))
    reports = _run(tmp_path, monkeypatch, server, {n: {"modes": ["none"]} for n in names}, {
        "site-2": {"0": ["masked_input", "fail"]},
        "site-5": {"1": ["unmasking", "stall", 3 * stage]},
    })
    first, second = reports
    for report in reports:
        assert report["neighbors"] == 5 and report["threshold"] == 3
        assert report["aborted"] is None
        assert report["total"] == plain_sum(inputs(tmp_path / "record", report["server_round"],
                                                   report["included"]), 64)
    assert first["dropped"] == {"site-2": "masked_input"}
    assert first["included"] == [n for n in names if n != "site-2"]
    assert second["dropped"] == {"site-5": "unmasking"} and second["included"] == names


def test_a_job_asking_exact_sums_from_default_sites_fails_naming_the_opt_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Before: every site refused every round, the simulator exited 0 and no model file was
    written. Now each refusal carries its public reason back, the server logs the rule, how
    many sites and the fix at WARNING, and the run ends in a typed error, not a success."""
    names = ["site-1", "site-2", "site-3"]
    server = SecureFedAvg(num_rounds=2, neighbors=None, stage_timeout=1.0 * slowdown(),
                          train_timeout=TRAIN * slowdown(),
                          report_path=str(tmp_path / "reports.jsonl"))
    reports = _run(tmp_path, monkeypatch, server, {n: {} for n in names}, {})
    assert all(r["total"] is None for r in reports) and len(reports) == 2
    assert _run.status != 0  # type: ignore[attr-defined]
    out = capfd.readouterr()
    text = out.out + out.err
    assert "3 of 3 sites refused by their site policy ([exact-release] 3)" in text
    assert "NothingReleased" in text and "secagg-dp='none'" in text
    assert "no secure round released anything in 2 rounds: 3 of 3 sites refused" in text
    # the model kept is the initial one, and the log says so (docs/nvflare.md)
    assert "no secure round of 2 completed: the model saved is the initial model" in text


def test_the_harness_reruns_only_a_job_whose_site_never_started(tmp_path: Path) -> None:
    """run_job's rerun condition (nvflare_sites.lost_at_start), on the simulator's own log
    lines: a site lost before its worker wrote its log is matched; a site that died later
    (a plan's "kill": its log exists) and a clean log are not."""
    ws = tmp_path / "ws"
    (ws / "server").mkdir(parents=True)
    for site in ("site-1", "site-3"):
        (ws / site).mkdir()
        (ws / site / "log.txt").write_text("ClientTaskWorker started to run\n")
    (ws / "site-2").mkdir()
    log = ws / "server" / "log.txt"
    log.write_text("2026-11-29 11:57:54,670 - SimulatorClientRunner - INFO - Simulate Run "
                   "client: site-2 on GPU group: None\n")
    assert lost_at_start(ws) is None
    with log.open("a") as f:
        f.write("2026-11-29 12:00:01,000 - SimulatorClientRunner - ERROR - Subprocess died "
                "for client site-3, exit code: -9\n")
    assert lost_at_start(ws) is None  # killed mid-round: it had started
    with log.open("a") as f:
        f.write("2026-11-29 11:57:54,769 - SimulatorClientRunner - ERROR - Communication "
                "error with client site-2: [Errno 104] Connection reset by peer\n")
    assert lost_at_start(ws) == "site-2"
