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


class _Engine:
    """What START_RUN reads of NVFlare's client engine: the trainer component; events
    (a system panic) are recorded."""

    def __init__(self, trainer: object) -> None:
        self.trainer = trainer
        self.events: list[str] = []

    def get_component(self, component_id: str) -> object:
        return self.trainer if component_id == "secagg_trainer" else None

    def fire_event(self, event_type: str, fl_ctx: object) -> None:
        self.events.append(event_type)


def _started(app: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
             ) -> tuple[SecAggExecutor, _Engine]:
    """A site's SecAggExecutor after NVFlare's START_RUN on the job's app folder ``app``."""
    from nvflare.apis.event_type import EventType
    from nvflare.apis.fl_constant import FLContextKey, ReservedKey
    from nvflare.apis.fl_context import FLContext

    monkeypatch.setenv("SECAGG_NVFLARE_DIR", str(tmp_path / "sites"))
    engine = _Engine(_plain())
    ctx = FLContext()
    ctx.set_prop(ReservedKey.ENGINE, engine, private=True, sticky=False)
    ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-1", private=False, sticky=False)
    ctx.set_prop(FLContextKey.APP_ROOT, str(app), private=True, sticky=False)
    executor = SecAggExecutor()
    executor.handle_event(EventType.START_RUN, ctx)
    return executor, engine


def test_the_site_checks_the_job_at_start_run_and_refuses_to_train_past_its_session(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check runs in the executor itself: at START_RUN a site whose job routes the
    train task past its session (or ships the project) panics, keeps no policy and trains
    nothing; a job built with SecureScriptRunner starts."""
    from nvflare.apis.event_type import EventType
    from nvflare.apis.fl_constant import ReturnCode
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.shareable import Shareable
    from nvflare.apis.signal import Signal

    from fl.nvflare.common import REFUSAL_HEADER

    def past(job: FedJob) -> None:
        carry_only_user_code(job)
        job.to_clients(ScriptRunner(SCRIPT, framework=FrameworkType.NUMPY))
        job.to_clients(SecAggExecutor(), tasks=[STAGE_TASK])

    good, _ = _started(_export(tmp_path / "good"), tmp_path, monkeypatch)
    assert good.config is not None and good.trainer is not None
    for build in (past, None):
        app = _export(tmp_path / ("past" if build else "shipped"), build)
        if build is None:  # the same job, with the project copied into custom/
            (app / "custom" / "fl").mkdir(parents=True)
            (app / "custom" / "fl" / "__init__.py").write_text("")
        executor, engine = _started(app, tmp_path, monkeypatch)
        assert EventType.FATAL_SYSTEM_ERROR in engine.events
        assert executor.config is None and executor.trainer is None
        reply = executor.execute("train", Shareable(), FLContext(), Signal())
        assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
        assert "not started" in str(reply.get_header(REFUSAL_HEADER))
