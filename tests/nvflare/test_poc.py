"""NVFlare's POC mode: the server and four sites as real processes on 127.0.0.1 (NVFlare's
own provisioning, TLS between them), a securely aggregated job, and one site killed
(its client and job processes, SIGKILL) in the middle of round 1, after it shared its keys.
The round completes without it; its sum equals the plaintext sum of the other three."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("nvflare.apis")  # not the namespace of tests/nvflare/ itself

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from nvflare.app_common.np.np_model_persistor import NPModelPersistor  # noqa: E402
from nvflare.fuel.utils.constants import FrameworkType  # noqa: E402
from nvflare.job_config.api import FedJob  # noqa: E402
from nvflare_sites import (  # noqa: E402
    PLAN_ENV,
    RecordingExecutor,
    inputs,
    plain_sum,
    poc_project,
)

from fl.nvflare.client import DIR_ENV  # noqa: E402
from fl.nvflare.job import SecureScriptRunner  # noqa: E402
from fl.nvflare.server import SecureFedAvg  # noqa: E402
from tests.pace import slowdown  # noqa: E402


def test_poc_processes_a_site_killed_mid_round(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from nvflare.recipe.poc_env import PocEnv

    sites = ["site-1", "site-2", "site-3", "site-4"]
    monkeypatch.setenv("NVFLARE_POC_WORKSPACE", str(tmp_path / "poc"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # NVFlare's ~/.nvflare
    (tmp_path / "home").mkdir()
    (tmp_path / "record").mkdir()
    (tmp_path / "plan.json").write_text(json.dumps({
        "record": str(tmp_path / "record"),
        "drops": {"site-3": {"1": ["masked_input", "kill"]}}}))
    monkeypatch.setenv(PLAN_ENV, str(tmp_path / "plan.json"))
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "sites"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
    for name in sites:
        (tmp_path / "sites" / name).mkdir(parents=True)
        (tmp_path / "sites" / name / "policy.json").write_text(
            json.dumps({"modes": ["none", "distributed"]}))
    reports_file = tmp_path / "reports.jsonl"
    job = FedJob(name="secure-poc", min_clients=len(sites))
    job.set_app_packages(["nvflare_sites"])  # the sites' own test harness, never shipped
    job.to_server(SecureFedAvg(num_rounds=2, neighbors=None, stage_timeout=2.0 * slowdown(),
                               train_timeout=60, report_path=str(reports_file)))
    job.to_server(NPModelPersistor(), id="persistor")
    job.to_clients(SecureScriptRunner(str(HERE / "train_script.py"),
                                      framework=FrameworkType.NUMPY,
                                      executor=RecordingExecutor()))
    # NVFlare logs in for each submit and status call within ``login_timeout`` (10 s by
    # default); a login that ran out of it at load 13 left NVFlare's session close waiting
    # on its own connection threads for good (py-spy: ConnManager.stop in AdminAPI.logout):
    # the wait is over as soon as the login succeeds, so a long one costs a quiet run nothing
    env = PocEnv(project_conf_path=poc_project(tmp_path / "project", sites),
                 extra={"login_timeout": 120.0})
    try:
        job_id = env.deploy(job)
        assert env.get_job_result(job_id, timeout=180) is not None
    finally:
        env.stop(clean_up=True)
    first, second = [json.loads(line) for line in reports_file.read_text().splitlines()]
    assert first["included"] == sites and first["dropped"] == {}
    assert second["dropped"] == {"site-3": "masked_input"} and second["aborted"] is None
    assert second["included"] == ["site-1", "site-2", "site-4"]
    assert second["seconds"]["masked_input"] >= 2.0  # waited out the dead site's deadline
    for report in (first, second):
        assert report["total"] == plain_sum(inputs(tmp_path / "record", report["server_round"],
                                                   report["included"]), 64)
