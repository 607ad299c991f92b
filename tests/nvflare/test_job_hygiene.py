"""An NVFlare job carries only the user's code (issue 27, deployment hygiene): exported with
SecureScriptRunner its ``custom/`` folder holds the user's script and none of the project,
the runner takes only the session executor, and the site's check refuses a job that ships
the project or its own site executor, or routes the train task past the session."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("nvflare.apis")  # not the namespace of tests/nvflare/ itself

from nvflare.app_common.executors.client_api_executor import ClientAPIExecutor
from nvflare.app_common.np.np_model_persistor import NPModelPersistor
from nvflare.fuel.utils.constants import FrameworkType
from nvflare.job_config.api import FedJob
from nvflare.job_config.script_runner import ScriptRunner

from fl.nvflare.client import SecAggExecutor
from fl.nvflare.common import STAGE_TASK, NVFlareSecAggError
from fl.nvflare.job import (
    PROJECT_PACKAGES,
    SecureScriptRunner,
    carry_only_user_code,
    check_site_app,
)
from fl.nvflare.server import SecureFedAvg

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "train_script.py")


def _export(tmp: Path, build: object = None) -> Path:
    """Export a two-site job (``build(job)`` adds the clients' part); its app folder."""
    job = FedJob(name="secure", min_clients=2)
    job.to_server(SecureFedAvg(num_rounds=1))
    job.to_server(NPModelPersistor(), id="persistor")
    if build is None:
        job.to_clients(SecureScriptRunner(SCRIPT, framework=FrameworkType.NUMPY))
    else:
        build(job)  # type: ignore[operator]
    job.export_job(str(tmp / "jobs"))
    (app,) = (tmp / "jobs" / "secure").glob("app*")
    return app


def _plain() -> ClientAPIExecutor:
    """NVFlare's own executor of a script: its result goes to the server in the open."""
    return ClientAPIExecutor(task_script_path=SCRIPT, execution_mode="in_process")


def _shipped(app: Path) -> set[str]:
    return {p.relative_to(app / "custom").parts[0] for p in (app / "custom").rglob("*.py")}


def test_an_exported_job_carries_only_the_users_script_and_the_site_accepts_it(
        tmp_path: Path) -> None:
    app = _export(tmp_path)
    assert not _shipped(app) & set(PROJECT_PACKAGES)  # nothing of secagg, fl, dp, transport
    assert (app / "custom" / "train_script.py").exists() or any(
        p.name == "train_script.py" for p in (app / "custom").rglob("*.py"))
    check_site_app(SecAggExecutor(), app, "train")


def test_a_job_that_replaced_the_app_packages_ships_the_project_and_is_refused(
        tmp_path: Path) -> None:
    def build(job: FedJob) -> None:
        job.to_clients(SecureScriptRunner(SCRIPT, framework=FrameworkType.NUMPY))
        job.set_app_packages([])  # afterwards: the project's packages go into custom/

    app = _export(tmp_path, build)
    assert {"fl", "secagg"} <= _shipped(app)
    with pytest.raises(NVFlareSecAggError, match=r"ships its own copy of .*fl.*secagg"):
        check_site_app(SecAggExecutor(), app, "train")


def test_the_runner_takes_only_the_session_executor() -> None:
    for executor in (_plain(), object()):
        with pytest.raises(NVFlareSecAggError, match="session executor"):
            SecureScriptRunner(SCRIPT, executor=executor)  # type: ignore[arg-type]
    SecureScriptRunner(SCRIPT, executor=SecAggExecutor())


def test_a_train_task_routed_past_the_session_is_refused(tmp_path: Path) -> None:
    def build(job: FedJob) -> None:  # the script trains in the open; the session sees stages
        carry_only_user_code(job)  # the project's packages are the site's own
        job.to_clients(ScriptRunner(SCRIPT, framework=FrameworkType.NUMPY))
        job.to_clients(SecAggExecutor(), tasks=[STAGE_TASK])

    app = _export(tmp_path, build)
    with pytest.raises(NVFlareSecAggError, match="routes its 'train' task to"):
        check_site_app(SecAggExecutor(), app, "train")


def test_a_site_executor_shipped_in_the_job_is_refused(tmp_path: Path) -> None:
    app = _export(tmp_path)
    sneaky = app / "custom" / "sneaky.py"
    sneaky.write_text("from fl.nvflare.client import SecAggExecutor\n\n\n"
                      "class Sneaky(SecAggExecutor):\n"
                      "    def on_input(self, setup, vector):\n"
                      "        pass  # e.g. send the vector elsewhere\n")
    spec = importlib.util.spec_from_file_location("sneaky", sneaky)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sneaky"] = module
    try:
        spec.loader.exec_module(module)
        with pytest.raises(NVFlareSecAggError, match="ships its own site executor"):
            check_site_app(module.Sneaky(), app, "train")
    finally:
        del sys.modules["sneaky"]
    with pytest.raises(NVFlareSecAggError, match="not a SecAggExecutor"):
        check_site_app(_plain(), app, "train")
