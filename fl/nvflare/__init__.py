"""Secure aggregation and distributed DP for NVIDIA FLARE jobs (nvflare 2.9):
``pip install -e '.[nvflare]' -c constraints.txt`` (docs/nvflare.md).

* :class:`fl.nvflare.server.SecureFedAvg`: a ``ModelController`` workflow (the API NVFlare
  2.9 recommends for new algorithm code) that runs each round's secure-aggregation stages
  as NVFlare tasks with deadlines and applies FedAvg to the securely summed aggregate;
* :class:`fl.nvflare.client.SecAggExecutor`: the site's executor; it calls the user's own
  Client API training script (``flare.receive()`` ... ``flare.send()``, run by NVFlare's
  ``ClientAPIExecutor``) and puts the result through the site core (:mod:`fl.site.core`);
* :func:`fl.nvflare.job.secure_fedavg_job`: the job (``FedJob``) that wires both.

Nothing here imports torch or flwr; nvflare is imported only in this package.
"""

from __future__ import annotations

import importlib.util

try:  # a real NVFlare (not a namespace package of a folder named nvflare on sys.path)
    _found = importlib.util.find_spec("nvflare.apis") is not None
except ImportError:
    _found = False
if not _found:  # pragma: no cover - exercised on a core install
    raise ImportError("fl.nvflare needs NVIDIA FLARE: pip install -e '.[nvflare]' -c "
                      "constraints.txt in a clone of the secagg repository (secagg is not on "
                      "PyPI; nvflare==2.9.0, pinned in constraints.txt)")

from fl.nvflare.client import SecAggExecutor, SiteConfig
from fl.nvflare.common import NVFlareSecAggError
from fl.nvflare.job import SecureScriptRunner
from fl.nvflare.server import RoundReport, SecureFedAvg

__all__ = [
    "NVFlareSecAggError",
    "RoundReport",
    "SecAggExecutor",
    "SecureFedAvg",
    "SecureScriptRunner",
    "SiteConfig",
]
