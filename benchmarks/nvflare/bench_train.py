"""The benchmark's Client API script: a d-parameter numpy "model" moved by a deterministic
per-site, per-round step (bench_step.local_update, the same in every variant)."""

import numpy as np
import nvflare.client as flare
from bench_step import local_update, record, silent
from nvflare.app_common.np.constants import NPConstants

flare.init()
site = flare.get_site_name()
while flare.is_running():
    model = flare.receive()
    server_round = model.current_round or 0
    w = np.asarray(model.params[NPConstants.NUMPY_KEY], dtype=np.float32).ravel()
    record(site, server_round, w)
    silent(site, server_round, "before")
    new, steps = local_update(site, server_round, w)
    flare.send(flare.FLModel(params={NPConstants.NUMPY_KEY: new},
                             meta={"NUM_STEPS_CURRENT_ROUND": steps}))
    silent(site, server_round, "after")
