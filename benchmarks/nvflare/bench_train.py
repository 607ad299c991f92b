"""The benchmark's Client API script: a d-parameter numpy "model" moved by a deterministic
per-site, per-round step (the same in every variant, so the aggregates are comparable)."""

import hashlib

import numpy as np
import nvflare.client as flare
from nvflare.app_common.np.constants import NPConstants

flare.init()
site = flare.get_site_name()
seed = int.from_bytes(hashlib.sha256(site.encode()).digest()[:4], "big")
while flare.is_running():
    model = flare.receive()
    w = np.asarray(model.params[NPConstants.NUMPY_KEY], dtype=np.float32)
    step = np.random.default_rng([seed, model.current_round or 0]).normal(size=w.shape)
    flare.send(flare.FLModel(params={NPConstants.NUMPY_KEY: w + 0.01 * step.astype(np.float32)},
                             meta={"NUM_STEPS_CURRENT_ROUND": 10 + int(site.split("-")[1])}))
