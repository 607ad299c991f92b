"""A user's NVFlare Client API training script, unchanged by secure aggregation: a small
linear model (the persistor's 3x3 matrix) fitted on the site's own synthetic data
(site_data.local_training)."""

import nvflare.client as flare
from nvflare.app_common.np.constants import NPConstants
from site_data import local_training

flare.init()
site = flare.get_site_name()
while flare.is_running():
    model = flare.receive()
    w, loss, rows = local_training(site, model.params[NPConstants.NUMPY_KEY])
    flare.send(flare.FLModel(params={NPConstants.NUMPY_KEY: w}, metrics={"loss": loss},
                             meta={"NUM_STEPS_CURRENT_ROUND": rows}))
