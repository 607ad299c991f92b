"""docs/nvflare.md's distributed-DP job, run from the docs' own code blocks (issue 27: every
documented example pair of sites and server trains, and "One epsilon a user can trust"):
each hospital enrolls its key with the docs' ``enroll``/``trust``, the job is the docs'
block (its client script swapped for the tests' numpy one, its persistor NVFlare's numpy
one), against sites with no ``policy.json`` (the default policy).

What is checked: the workflow's own round setups (``SecureFedAvg._setup``) are admitted by
each default site's core round after round and charged what the workflow spends; the noise
each configuration puts on the average (without the authenticated roster a site's own
share carries its whole epsilon, so three sites' average carries more noise than any
clipped update; with it, ten sites' average carries about a third of the clip); the mean
update is the noisy sum over the number of sites in it; and on NVFlare's simulator the
job runs its four rounds, each site's ledger holds the epsilon each round reports and the
model trains (the sites' mean squared error falls)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nvflare.apis")  # not the namespace of tests/nvflare/ itself

from dp.budget import PrivacyBudget
from dp.ledger import read_charges
from dp.policy import PolicyRefused, SitePolicy
from fl.codec import DistributedCodec
from fl.nvflare.server import SecureFedAvg
from fl.round_plan import round_plan
from fl.round_reply import charged_event, decode_sum, encode_reply, round_release
from fl.round_setup import dp_params
from fl.site.core import open_site_core
from fl.vector import ArrayLayout

DOC = Path(__file__).resolve().parents[2] / "docs" / "nvflare.md"
HERE = Path(__file__).resolve().parent
INITIAL = np.arange(1.0, 10.0).reshape(3, 3)
"""NVFlare's ``NPModelPersistor`` initial model, the job's starting point."""


def block(marker: str) -> str:
    """The docs' Python block containing ``marker`` (exactly one)."""
    found = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
             if marker in b]
    assert len(found) == 1, (marker, len(found))
    return found[0]


class _Job:
    """Stands for NVFlare's ``FedJob`` where only the workflow the docs build is needed."""

    def __init__(self) -> None:
        self.server: Any = None

    def to_server(self, obj: Any, **_: Any) -> None:
        self.server = obj

    def to_clients(self, obj: Any, **_: Any) -> None:
        pass


def docs_job(job: Any, runner: Any) -> dict[str, Any]:
    """Runs the docs' enrolment block and DP job block (``job`` and ``SecureScriptRunner``
    given); the hospitals' keys go to the folders their sites read (``$XDG_STATE_HOME``,
    set by the test)."""
    space: dict[str, Any] = {"__name__": "docs_nvflare"}
    exec(compile(block("def enroll(site: str)"), str(DOC), "exec"), space)
    space |= {"job": job, "SecureFedAvg": SecureFedAvg, "SecureScriptRunner": runner}
    exec(compile(block("verify_keys = {site: enroll(site)"), str(DOC), "exec"), space)
    return space


def site_loss(w: np.ndarray, sites: list[str]) -> float:
    """The sites' mean squared error of ``w`` on their own data (tests/nvflare/site_data.py)."""
    from site_data import TRUTH  # type: ignore[import-not-found]

    losses = []
    for site in sites:
        rng = np.random.default_rng(int.from_bytes(hashlib.sha256(site.encode()).digest()[:4],
                                                   "big"))
        x = rng.normal(size=(16 + len(site), 3))
        losses.append(float(np.mean((x @ w - x @ TRUTH) ** 2)))
    return float(np.mean(losses))


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from fl.nvflare.client import DIR_ENV

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the sites' folders
    monkeypatch.delenv(DIR_ENV, raising=False)
    return tmp_path


def _variant(server: SecureFedAvg, **changes: Any) -> SecureFedAvg:
    args = {"num_clients": server.num_clients, "num_rounds": server.num_rounds,
            "dp": server.dp, "security": server.security, "verify_keys": server.verify_keys}
    made = SecureFedAvg(**(args | changes))
    made.fl_ctx = SimpleNamespace(get_job_id=lambda: "job-docs")
    return made


@pytest.mark.parametrize("doc_rounds", [None, 3])
def test_the_docs_job_is_taken_by_default_sites_at_the_epsilon_it_reports(
        doc_rounds: int | None, state: Path) -> None:
    """As written, every site's default policy admits each of the job's rounds, counting
    the enrolled sites' noise, and its ledger ends at the workflow's epsilon, within the
    job's 8; planned over 3 rounds a round costs 4.2, above a default site's cap of 4 per
    release ([round_epsilon]), which is why the docs plan over 4."""
    job = _Job()
    space = docs_job(job, lambda *a, **k: None)
    server: SecureFedAvg = job.server
    assert server.security == "malicious" and server.verify_keys == space["verify_keys"]
    dp = dict(server.dp or {})
    if doc_rounds is not None:
        dp["rounds"] = doc_rounds
    server = _variant(server, dp=dp)
    sites = space["hospitals"]
    specs = ArrayLayout.of({"w": np.zeros((3, 3), dtype=np.float32)}).specs
    spent = PrivacyBudget(dp["epsilon"], 1e-5)
    refused: list[str] = []
    for r in range(min(server.num_rounds, dp["rounds"])):
        setup = server._setup(sites, r, specs)
        assert setup is not None and setup.mode == "distributed" and setup.security == "malicious"
        spent.spend(charged_event(setup))  # what the workflow spends for a released round
        for site in sites:
            core = open_site_core(policy=SitePolicy(), ledger_path=str(state / site))
            core.authenticated_roster = True  # the session's, for an enrolled roster
            try:
                charge = core.admit(round_release(setup)(core.policy),
                                    secagg_threshold=setup.threshold, label=f"r{r}")
            except PolicyRefused as exc:  # the refusal is the finding
                refused.append(str(exc))
                continue
            finally:
                core.close()
            assert charge.epsilon_after == pytest.approx(spent.spent[0], rel=1e-9)
    if doc_rounds is None:
        assert not refused and spent.spent[0] <= dp["epsilon"]
    else:
        assert refused and all("[round_epsilon]" in r for r in refused)


def test_the_noise_on_the_average_with_and_without_the_roster(state: Path) -> None:
    """The numbers docs/nvflare.md gives: each site's noise share (over the clip) and the
    noise per coordinate on the sites' average, for the docs' job (ten enrolled sites) and
    for three sites without the roster; a clipped update is at most 1 x clip."""
    job = _Job()
    docs_job(job, lambda *a, **k: None)
    specs = ArrayLayout.of({"w": np.zeros((3, 3), dtype=np.float32)}).specs

    def noise(server: SecureFedAvg, sites: list[str]) -> tuple[float, float]:
        setup = server._setup(sites, 0, specs)
        assert server.privacy is not None and setup is not None
        params = round_plan(server.privacy, setup, {}).params
        share = params.noise_stddev / params.clip_norm
        return share, share * math.sqrt(len(sites)) / len(sites)

    ten = job.server
    share, average = noise(_variant(ten), [f"site-{i}" for i in range(1, 11)])
    assert share == pytest.approx(1.14, abs=0.005) and average == pytest.approx(0.36, abs=0.005)
    three = _variant(ten, num_clients=3, security="semi-honest", verify_keys=None)
    share, average = noise(three, ["site-1", "site-2", "site-3"])
    assert share == pytest.approx(2.56, abs=0.005) and average == pytest.approx(1.48, abs=0.02)
    assert "about 1.5 x clip per coordinate" in DOC.read_text()
    with pytest.raises(ValueError, match="no safe parameters"):  # malicious mode: > 3 sites
        noise(_variant(ten, num_clients=3, verify_keys={
            s: k for s, k in ten.verify_keys.items() if s in ("site-1", "site-2", "site-3")}),
            ["site-1", "site-2", "site-3"])


def test_the_mean_update_is_the_noisy_sum_over_the_sites_in_it(state: Path) -> None:
    """The workflow decodes a DP round as the noisy sum of the clipped updates over the
    number of sites in the sum (public), not over the row's noisy count."""
    job = _Job()
    space = docs_job(job, lambda *a, **k: None)
    server, sites = _variant(job.server), space["hospitals"]
    setup = server._setup(sites, 0, ArrayLayout.of({"w": np.zeros(9)}).specs)
    assert setup is not None
    sent = np.zeros(9)
    rng = np.random.default_rng(5)
    inputs = [encode_reply(setup, rng.normal(scale=0.1, size=9), {}, 1.0, sent)
              for _ in sites]
    total = np.sum(inputs, axis=0, dtype=np.uint64) & np.uint64((1 << setup.bits) - 1)
    mean, _, count = decode_sum(setup, total, len(sites), sent)
    sums, noisy_count = DistributedCodec(dp_params(setup)).decode(total, len(sites))
    np.testing.assert_allclose(mean, sums / len(sites), rtol=1e-12)
    assert count == max(noisy_count, 1.0) and noisy_count != len(sites)


def test_the_docs_dp_job_trains_on_the_simulator_and_each_ledger_holds_the_reported_epsilon(
        state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nvflare.app_common.np.np_model_persistor import NPModelPersistor
    from nvflare.fuel.utils.constants import FrameworkType
    from nvflare.job_config.api import FedJob

    from fl.nvflare.job import SecureScriptRunner

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(HERE.parents[1]), str(HERE), os.environ.get("PYTHONPATH", "")]))
    job = FedJob(name="secure", min_clients=10)
    space = docs_job(job, lambda script: SecureScriptRunner(
        str(HERE / "train_script.py"), framework=FrameworkType.NUMPY))
    job.to_server(NPModelPersistor(), id="persistor")
    sites: list[str] = space["hospitals"]
    workspace = state / "ws"
    assert job.simulator_run(str(workspace), clients=sites, threads=len(sites)) == 0
    reports = [json.loads(line) for line in (workspace / "server" / "simulate_job" /
                                             "secure_rounds.jsonl").read_text().splitlines()]
    assert [r["server_round"] for r in reports] == [0, 1, 2, 3]
    assert all(sorted(r["included"]) == sorted(sites) and r["aborted"] is None
               and r["security"] == "malicious" for r in reports), reports
    epsilons = [r["epsilon"] for r in reports]
    assert epsilons == sorted(epsilons) and epsilons[0] > 0 and epsilons[-1] <= 8.0
    assert f"{epsilons[-1]:.3f}" == "7.997"  # the docs' figure
    for site in sites:
        charges = read_charges(workspace / site / "simulate_job" / "secagg" / "ledger.json")
        assert [c.epsilon_after for c in charges] == pytest.approx(epsilons, rel=1e-9)
    (saved,) = workspace.rglob("server.npy")
    before, after = site_loss(INITIAL, sites), site_loss(np.load(saved), sites)
    assert before == pytest.approx(99, abs=0.5)
    assert after < 0.95 * before, (before, after)  # about 63 +- 7 (Monte Carlo, 1,000 runs)


def test_the_two_changed_lines_train_exact_sums_at_sites_that_opted_in(
        state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The docs' two changed lines as written (exact secure sums) against three sites whose
    operators wrote the docs' opt-in into their policy.json: every round sums every site
    and the model trains."""
    from nvflare.app_common.np.np_model_persistor import NPModelPersistor
    from nvflare.fuel.utils.constants import FrameworkType
    from nvflare.job_config.api import FedJob

    from fl.nvflare.client import SiteConfig
    from fl.nvflare.job import SecureScriptRunner

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(HERE.parents[1]), str(HERE), os.environ.get("PYTHONPATH", "")]))
    opt_in = re.search(r'`(\{"modes": \["none"\]\})` in its `policy.json`', DOC.read_text())
    assert opt_in is not None
    line = "job.to_server(SecureFedAvg(num_clients=3, num_rounds=4))"
    code = block(line)
    assert "from fl.nvflare import SecureFedAvg, SecureScriptRunner" in code
    assert line in (DOC.parents[1] / "README.md").read_text()  # the README's, the same job
    job = FedJob(name="secure", min_clients=3)
    space = {"job": job, "SecureFedAvg": SecureFedAvg,
             "SecureScriptRunner": lambda script: SecureScriptRunner(
                 str(HERE / "train_script.py"), framework=FrameworkType.NUMPY)}
    exec(compile(code.replace("from fl.nvflare import SecureFedAvg, SecureScriptRunner", ""),
                 str(DOC), "exec"), space)
    job.to_server(NPModelPersistor(), id="persistor")
    sites = ["site-1", "site-2", "site-3"]
    for site in sites:  # each operator's opt-in, in the folder its site reads
        (SiteConfig.for_site(site).folder / "policy.json").write_text(opt_in.group(1))
    workspace = state / "ws"
    assert job.simulator_run(str(workspace), clients=sites, threads=len(sites)) == 0
    reports = [json.loads(line) for line in (workspace / "server" / "simulate_job" /
                                             "secure_rounds.jsonl").read_text().splitlines()]
    assert [r["server_round"] for r in reports] == [0, 1, 2, 3]
    assert all(sorted(r["included"]) == sites and r["aborted"] is None
               and r["epsilon"] is None for r in reports), reports
    (saved,) = workspace.rglob("server.npy")
    before, after = site_loss(INITIAL, sites), site_loss(np.load(saved), sites)
    assert after < 0.5 * before, (before, after)
