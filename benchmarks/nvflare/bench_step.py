"""The benchmark's local training step (one deterministic update per site and round, the same
in every variant, so the aggregates are comparable) and the plan of a dropping site."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

PLAN_ENV = "SECAGG_BENCH_PLAN"
"""A JSON file: {"record": folder of the models the sites received, "silent": [site, round,
"before" | "after"] or null} (read at every round, so one POC deployment runs many jobs)."""


def local_update(site: str, server_round: int, w: np.ndarray) -> tuple[np.ndarray, int]:
    """The site's new weights (float32) and its NUM_STEPS_CURRENT_ROUND."""
    seed = int.from_bytes(hashlib.sha256(site.encode()).digest()[:4], "big")
    step = np.random.default_rng([seed, server_round]).normal(size=w.shape)
    return (w + 0.01 * step.astype(np.float32)).astype(np.float32), 10 + int(site.split("-")[1])


def plan() -> dict:
    path = os.environ.get(PLAN_ENV)
    return json.loads(Path(path).read_text()) if path else {"record": None, "silent": None}


def record(site: str, server_round: int, w: np.ndarray) -> None:
    """Keep the model ``site`` received in ``server_round`` (the previous round's aggregate)."""
    folder = plan().get("record")
    if folder:
        np.save(Path(folder) / f"{site}-r{server_round}.npy", w)


def silent(site: str, server_round: int, when: str) -> None:
    """Go silent for good (the site hangs: a dead machine that the server cannot tell from a
    slow one) when the plan says so for this site, round and moment."""
    if plan().get("silent") == [site, server_round, when]:
        time.sleep(86_400)
