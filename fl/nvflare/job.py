"""The job side: :class:`SecureScriptRunner`, NVFlare's ``ScriptRunner`` with the site's
secure-aggregation executor in front of the user's training script.

``job.to_clients(SecureScriptRunner(script="client.py"))`` replaces
``ScriptRunner(script="client.py")``; the server's workflow is
:class:`fl.nvflare.server.SecureFedAvg` instead of ``FedAvg`` (docs/nvflare.md). The
runner adds NVFlare's ``ClientAPIExecutor`` for the script (in-process or external
process, as ``ScriptRunner`` does) as a *component* with id :data:`TRAINER_ID`, and
:class:`fl.nvflare.client.SecAggExecutor` as the executor of the train task and of every
secure-aggregation stage, so the script's result reaches the server only as a share of a
secure sum.

The job carries only the user's code: the runner marks the project's packages
(:data:`PROJECT_PACKAGES`) as the job's app packages (NVFlare's
``FedJob.set_app_packages``), so an exported job's ``custom/`` folder holds the user's script
and nothing of secagg, and every party runs the secagg it installed. The executor is the
project's session executor (:class:`SecAggExecutor`, or a subclass) or the runner refuses
it; :func:`check_site_app` is the site's side of the same rule (a job that ships its own
copy of the project, or its own site executor, or routes the train task past the session).
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Any

from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.app_constant import AppConstants
from nvflare.job_config.script_runner import ScriptRunner

from fl.nvflare.client import SecAggExecutor
from fl.nvflare.common import STAGE_TASK, NVFlareSecAggError

TRAINER_ID = "secagg_trainer"
"""The component id of the executor that runs the user's script."""
PROJECT_PACKAGES = ("secagg", "transport", "dp", "fl")
"""The project's top-level packages: installed at every party, never shipped in a job."""


def carry_only_user_code(job: Any) -> None:
    """Add :data:`PROJECT_PACKAGES` to ``job``'s app packages (``FedJob.set_app_packages``,
    keeping any the job set before): its export copies none of the project into
    ``custom/``. Call ``set_app_packages`` of your own before ``to_clients``, or include
    these in it (a list set afterwards replaces them, and the sites refuse the job)."""
    config = getattr(job, "job", None)
    have = list(getattr(config, "app_packages", None) or [])
    job.set_app_packages(have + [p for p in PROJECT_PACKAGES if p not in have])


def check_site_app(executor: Any, app_root: str | Path, train_task_name: str) -> None:
    """The site's check of a job's client app before it trains (raises
    :class:`NVFlareSecAggError`): the train task and the stage task go to ``executor``, a
    :class:`SecAggExecutor` whose classes come from the site's own installation, and the
    app's ``custom/`` folder carries none of :data:`PROJECT_PACKAGES`. ``app_root``: the
    job's app folder at the site (``fl_ctx.get_prop(FLContextKey.APP_ROOT)``)."""
    app_root = Path(app_root)
    custom = (app_root / "custom").resolve()
    shipped = sorted(p for p in PROJECT_PACKAGES
                     if (custom / p).exists() or (custom / f"{p}.py").exists())
    if shipped:
        raise NVFlareSecAggError(
            f"the job ships its own copy of {', '.join(shipped)} in {custom}: this site runs "
            "only the secagg it installed; build the job with SecureScriptRunner (it sets "
            "the project's packages as app packages) and do not replace its app packages")
    if not isinstance(executor, SecAggExecutor):
        raise NVFlareSecAggError(f"the site executor {type(executor).__name__} is not a "
                                 "SecAggExecutor: the train task must go through the session")
    for cls in type(executor).__mro__:
        source = inspect.getsourcefile(cls) if cls.__module__ != "builtins" else None
        if source is not None and Path(source).resolve().is_relative_to(custom):
            raise NVFlareSecAggError(
                f"the job ships its own site executor ({cls.__module__}.{cls.__qualname__} "
                f"in {custom}): this site runs only executors it installed")
    path = f"{type(executor).__module__}.{type(executor).__qualname__}"
    for task in (train_task_name, STAGE_TASK):
        routed = [entry.get("executor", {}).get("path") for entry in _client_executors(app_root)
                  if task in entry.get("tasks", ())]
        if routed != [path]:
            raise NVFlareSecAggError(
                f"the job routes its {task!r} task to {routed or 'no executor'}, not to this "
                f"site's session executor {path}: refused (only SecureScriptRunner's "
                "executor may train)")


def _client_executors(app_root: Path) -> list[dict[str, Any]]:
    """The ``executors`` of the app's ``config_fed_client.json`` (in ``config/`` or the app
    root, as NVFlare looks)."""
    for folder in (app_root / "config", app_root):
        path = folder / "config_fed_client.json"
        if path.is_file():
            try:
                config = json.loads(path.read_text(encoding="utf-8"))
                return list(config.get("executors", []))
            except (OSError, ValueError, AttributeError, TypeError) as exc:
                raise NVFlareSecAggError(f"cannot read {path}: {exc}") from None
    raise NVFlareSecAggError(f"no config_fed_client.json in {app_root}")


SCRIPT_LOGGERS = ("nvflare.client.in_process.api.InProcessClientAPI",
                  "nvflare.app_common.executors.task_script_runner.TaskScriptRunner")
"""NVFlare's loggers of an in-process training script that ended with an error."""


class _ScriptFailureRecords(logging.Filter):
    """NVFlare logs an in-process script that raised as "fire abort event" and "ask to abort
    job" at ERROR, though only this site's script ends: the site drops out of the round
    (and, its script gone, of every later one) and the job goes on with the other sites.
    Those two records are replaced by one WARNING that says so; the traceback stays."""

    def __init__(self) -> None:
        super().__init__()
        self.script_failed = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message == "fire abort event":
            return False
        if not message.startswith("ask to abort job"):
            return True
        if "Traceback" in message:
            self.script_failed = True
            record.msg = ("this site's training script ended with an error (the traceback "
                          "above): the site drops out of this round and, NVFlare not "
                          "restarting an in-process script, of the job's later rounds; the "
                          "job goes on with the other sites")
        elif self.script_failed:  # the train tasks that follow, failed for the same reason
            record.msg = ("this site's training script has ended (the error above): the "
                          "site drops out of this round too; the job goes on")
        else:
            return True  # the job itself is being aborted
        record.levelno, record.levelname, record.args = logging.WARNING, "WARNING", ()
        return True


class ScriptFailureLog(FLComponent):
    """The site's log of a failed in-process training script, as it is
    (:class:`_ScriptFailureRecords`), from the job's start."""

    def __init__(self) -> None:
        super().__init__()
        self._filter = _ScriptFailureRecords()

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_RUN:
            for name in SCRIPT_LOGGERS:
                logging.getLogger(name).addFilter(self._filter)
        elif event_type == EventType.END_RUN:
            for name in SCRIPT_LOGGERS:
                logging.getLogger(name).removeFilter(self._filter)


class _TrainerAsComponent:
    """The job, as ``ScriptRunner.add_to_fed_job`` sees it: its executor becomes a component
    (the secure executor calls it) instead of the executor of the job's tasks."""

    def __init__(self, job: Any) -> None:
        self._job = job

    def __getattr__(self, name: str) -> Any:
        return getattr(self._job, name)

    def add_executor(self, obj: Any, tasks: Any, ctx: Any) -> None:
        self._job.add_component(TRAINER_ID, obj, ctx)


class SecureScriptRunner(ScriptRunner):
    """``ScriptRunner``'s arguments, unchanged; ``train_task_name``: the job's train task.
    ``executor``: the site executor to use (default a :class:`SecAggExecutor` over the
    script's executor; a subclass must keep ``trainer_id`` :data:`TRAINER_ID`); anything
    that is not a :class:`SecAggExecutor` is refused (:class:`NVFlareSecAggError`)."""

    def __init__(self, script: str, *, train_task_name: str = AppConstants.TASK_TRAIN,
                 executor: SecAggExecutor | None = None, **kwargs: Any) -> None:
        if executor is not None and not isinstance(executor, SecAggExecutor):
            raise NVFlareSecAggError(
                f"SecureScriptRunner(executor=) takes the project's session executor "
                f"(fl.nvflare.client.SecAggExecutor), not {type(executor).__name__}: any "
                "other executor would send the script's result past the secure sum")
        super().__init__(script, **kwargs)
        self._train_task_name = train_task_name
        self._executor = executor

    def add_to_fed_job(self, job: Any, ctx: Any, **kwargs: Any) -> dict[str, Any]:
        carry_only_user_code(job)
        super().add_to_fed_job(_TrainerAsComponent(job), ctx, **kwargs)
        executor = self._executor or SecAggExecutor(trainer_id=TRAINER_ID,
                                                    train_task_name=self._train_task_name)
        job.add_executor(executor, tasks=[self._train_task_name, STAGE_TASK], ctx=ctx)
        job.add_component("secagg_script_failure_log", ScriptFailureLog(), ctx)
        return {}
