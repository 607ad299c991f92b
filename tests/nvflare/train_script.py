"""A user's NVFlare Client API training script, unchanged by secure aggregation: a small
linear model (the persistor's 3x3 matrix) fitted with a few numpy gradient steps on the
site's own synthetic data."""

import hashlib

import numpy as np
import nvflare.client as flare
from nvflare.app_common.np.constants import NPConstants

flare.init()
site = flare.get_site_name()
rng = np.random.default_rng(int.from_bytes(hashlib.sha256(site.encode()).digest()[:4], "big"))
x = rng.normal(size=(16 + len(site), 3))
y = x @ np.array([[1.0, -2.0, 0.5], [0.0, 1.0, 2.0], [3.0, 0.0, -1.0]])
while flare.is_running():
    model = flare.receive()
    w = np.asarray(model.params[NPConstants.NUMPY_KEY], dtype=np.float64)
    for _ in range(5):
        w = w - 0.05 * x.T @ (x @ w - y) / len(x)
    loss = float(np.mean((x @ w - y) ** 2))
    flare.send(flare.FLModel(params={NPConstants.NUMPY_KEY: w}, metrics={"loss": loss},
                             meta={"NUM_STEPS_CURRENT_ROUND": len(x)}))
