"""The benchmark's job components: the secure site's executor (fl.nvflare's SecAggExecutor
that goes silent for good after its masked input, the secure round's upload, when the plan
says so: bench_step) and the HE job's numpy persistor (NVFlare's NPModelPersistor cannot
save the encrypted global model: its HE recipe is for torch, whose persistor takes
HEModelSerializeFilter)."""

from pathlib import Path
from typing import Any

import tenseal as ts
from bench_step import silent
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.app_common.np.constants import NPConstants
from nvflare.app_common.np.np_model_persistor import NPModelPersistor

from fl.nvflare.client import SecAggExecutor
from fl.nvflare.common import SETUP_HEADER, STAGE_TASK
from fl.round_setup import RoundSetup


class BenchExecutor(SecAggExecutor):
    def __init__(self, trainer_id: str = "secagg_trainer", train_task_name: str = "train"
                 ) -> None:
        super().__init__(trainer_id=trainer_id, train_task_name=train_task_name)
        self._round, self._stages = -1, 0

    def execute(self, task_name: str, shareable: Any, fl_ctx: Any, abort_signal: Any) -> Any:
        if task_name == STAGE_TASK:
            self._stages += 1
            if self._stages == 3:  # the stage after masked_input: the upload was sent
                silent(self.site, self._round, "after")
        elif task_name == self.train_task_name and shareable.get_header(SETUP_HEADER):
            self._round = RoundSetup.from_bytes(shareable.get_header(SETUP_HEADER)).server_round
            self._stages = 0
        return super().execute(task_name, shareable, fl_ctx, abort_signal)


class EncryptedNPModelPersistor(NPModelPersistor):
    """NPModelPersistor that saves an encrypted global model as its CKKS bytes."""

    def save_model(self, model_learnable: Any, fl_ctx: Any) -> None:
        weights = model_learnable[ModelLearnableKey.WEIGHTS][NPConstants.NUMPY_KEY]
        if isinstance(weights, ts.CKKSVector | bytes):
            folder = Path(fl_ctx.get_workspace().get_result_root(fl_ctx.get_job_id()))
            folder.mkdir(parents=True, exist_ok=True)
            raw = weights if isinstance(weights, bytes) else weights.serialize()
            (folder / "server.ckks").write_bytes(raw)
            return
        super().save_model(model_learnable, fl_ctx)


class TaskRequestInterval:
    """Added to a job's server (``job.to_server``): the server's ``task_request_interval``
    (NVFlare's default 2 s), which SecureFedAvg sets for its own jobs, for the other
    variants' jobs too."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def add_to_fed_job(self, job: Any, ctx: Any, **kwargs: Any) -> None:
        job.add_params({"server": {"task_request_interval": self.seconds}}, ctx)
