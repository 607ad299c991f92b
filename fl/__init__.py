"""Federated learning on torch: sites, coordinator, FedAvg/FedProx, datasets, the CLI.

The top layer: it may import ``secagg``, ``transport`` and ``dp``. This module is the layer's
front door: what users and the docs import comes from here (``from fl import PrivateSite,
train_federated, FixedPointCodec``); every error the layer raises is an ``FLError``. The
names that need torch are imported on first use, so ``import fl`` works on a core install.
The Flower adapter's front door is ``fl.flower`` (it needs the ``flower`` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from secagg.lazy import lazy_exports

from .errors import FLError

if TYPE_CHECKING:
    from .api import FederatedResult, PrivateSite, save_model, train_federated
    from .checkpoint import CheckpointError
    from .codec import DistributedCodec, EncodingOverflow, FixedPointCodec
    from .data import DataError, Table, dirichlet_split, load_csv, load_dataset, split_patients
    from .models import make_model

__getattr__ = lazy_exports(__name__, {
    "FederatedResult": ".api", "PrivateSite": ".api", "save_model": ".api",
    "train_federated": ".api", "CheckpointError": ".checkpoint", "DistributedCodec": ".codec",
    "EncodingOverflow": ".codec", "FixedPointCodec": ".codec", "DataError": ".data",
    "Table": ".data", "dirichlet_split": ".data", "load_csv": ".data", "load_dataset": ".data",
    "split_patients": ".data", "make_model": ".models",
})

__all__ = [
    "CheckpointError",
    "DataError",
    "DistributedCodec",
    "EncodingOverflow",
    "FLError",
    "FederatedResult",
    "FixedPointCodec",
    "PrivateSite",
    "Table",
    "dirichlet_split",
    "load_csv",
    "load_dataset",
    "make_model",
    "save_model",
    "split_patients",
    "train_federated",
]
