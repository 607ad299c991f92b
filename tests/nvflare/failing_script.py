"""tests/nvflare/train_script.py, except that at site-3 the user's training raises."""

import nvflare.client as flare
from nvflare.app_common.np.constants import NPConstants
from site_data import local_training

flare.init()
site = flare.get_site_name()
while flare.is_running():
    model = flare.receive()
    if site == "site-3":
        raise RuntimeError("the user's training failed")
    w, loss, rows = local_training(site, model.params[NPConstants.NUMPY_KEY])
    flare.send(flare.FLModel(params={NPConstants.NUMPY_KEY: w}, metrics={"loss": loss},
                             meta={"NUM_STEPS_CURRENT_ROUND": rows}))
