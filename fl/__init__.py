"""Federated learning on torch: sites, coordinator, FedAvg/FedProx, datasets, the CLI.

The top layer: it may import ``secagg``, ``transport`` and ``dp``.
"""
