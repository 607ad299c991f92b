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

import logging
from typing import Any

from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.app_constant import AppConstants
from nvflare.job_config.script_runner import ScriptRunner

from fl.nvflare.client import SecAggExecutor
from fl.nvflare.client import check_site_app as check_site_app  # the site's side, here too
from fl.nvflare.common import PROJECT_PACKAGES, STAGE_TASK, NVFlareSecAggError

TRAINER_ID = "secagg_trainer"
"""The component id of the executor that runs the user's script."""


def carry_only_user_code(job: Any) -> None:
    """Add :data:`PROJECT_PACKAGES` to ``job``'s app packages (``FedJob.set_app_packages``,
    keeping any the job set before): its export copies none of the project into
    ``custom/``. Call ``set_app_packages`` of your own before ``to_clients``, or include
    these in it (a list set afterwards replaces them, and the sites refuse the job)."""
    config = getattr(job, "job", None)
    have = list(getattr(config, "app_packages", None) or [])
    job.set_app_packages(have + [p for p in PROJECT_PACKAGES if p not in have])


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
