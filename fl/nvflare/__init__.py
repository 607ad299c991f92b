"""Secure aggregation and distributed DP for NVIDIA FLARE jobs (nvflare 2.9):
``pip install 'secagg[nvflare]'`` (docs/nvflare.md).

* :class:`fl.nvflare.server.SecureFedAvg`: a ``ModelController`` workflow (the API NVFlare
  2.9 recommends for new algorithm code) that runs each round's secure-aggregation stages
  as NVFlare tasks with deadlines and applies FedAvg to the securely summed aggregate;
* :class:`fl.nvflare.client.SecAggExecutor`: the site's executor; it calls the user's own
  Client API training script (``flare.receive()`` ... ``flare.send()``, run by NVFlare's
  ``ClientAPIExecutor``) and puts the result through the site core (:mod:`fl.site_core`);
* :func:`fl.nvflare.job.secure_fedavg_job`: the job (``FedJob``) that wires both.

Nothing here imports torch; nvflare is imported only in this package.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("nvflare") is None:  # pragma: no cover - exercised on a core install
    raise ImportError("fl.nvflare needs NVIDIA FLARE: pip install 'secagg[nvflare]' "
                      "(nvflare==2.9.0, pinned in constraints.txt)")
