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
"""

from __future__ import annotations

from typing import Any

from nvflare.app_common.app_constant import AppConstants
from nvflare.job_config.script_runner import ScriptRunner

from fl.nvflare.client import SecAggExecutor
from fl.nvflare.common import STAGE_TASK

TRAINER_ID = "secagg_trainer"
"""The component id of the executor that runs the user's script."""


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
    script's executor; a subclass must keep ``trainer_id`` :data:`TRAINER_ID`)."""

    def __init__(self, script: str, *, train_task_name: str = AppConstants.TASK_TRAIN,
                 executor: SecAggExecutor | None = None, **kwargs: Any) -> None:
        super().__init__(script, **kwargs)
        self._train_task_name = train_task_name
        self._executor = executor

    def add_to_fed_job(self, job: Any, ctx: Any, **kwargs: Any) -> dict[str, Any]:
        super().add_to_fed_job(_TrainerAsComponent(job), ctx, **kwargs)
        executor = self._executor or SecAggExecutor(trainer_id=TRAINER_ID,
                                                    train_task_name=self._train_task_name)
        job.add_executor(executor, tasks=[self._train_task_name, STAGE_TASK], ctx=ctx)
        return {}
