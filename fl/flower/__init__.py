"""Secure aggregation for Flower apps (flwr 1.42, Message API): ``pip install -e ".[flower]"``.

Two lines change in a Flower app (docs/flower.md)::

    app = ClientApp(mods=[secagg_mod])                  # client_app.py
    strategy = SecureAggregation(FedAvg(...))           # server_app.py

:mod:`fl.flower.client` is the node's mod, :mod:`fl.flower.server` the strategy wrapper,
:mod:`fl.flower.rounds` the stage loop over the ``Grid``, :mod:`fl.flower.setup` the public
round setup, :mod:`fl.flower.encoding` the reply <-> vector encoding both sides share and
:mod:`fl.flower.chunks` the masked input as checked ``ArrayRecord`` chunks.
Nothing here needs torch; flwr is imported only in this package.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("flwr") is None:  # pragma: no cover - exercised on a core install
    raise ImportError("fl.flower needs Flower: pip install -e '.[flower]' -c constraints.txt "
                      "in a clone of the secagg repository (secagg is not on PyPI; "
                      "flwr[simulation]==1.42.0, pinned in constraints.txt)")

from fl.flower.client import NodeOptions, RoundStateError, make_secagg_mod, secagg_mod
from fl.flower.rounds import RoundReport
from fl.flower.server import SecureAggregation
from fl.flower.setup import RoundSetup, SetupError
from fl.round_plan import DistributedDP

__all__ = [
    "DistributedDP",
    "NodeOptions",
    "RoundReport",
    "RoundSetup",
    "RoundStateError",
    "SecureAggregation",
    "SetupError",
    "make_secagg_mod",
    "secagg_mod",
]
