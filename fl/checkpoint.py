"""Coordinator checkpoints: written after every round, so a crash loses at most one round.

A checkpoint is a directory with ``state.json`` (round, history, spent privacy events,
scaler, the settings it belongs to) and ``model.npy`` (the global model vector). Both are
written to temporary files and renamed into place, model first, so a crash mid-write leaves
the previous checkpoint intact (``os.replace`` is atomic on POSIX). ``state.json`` records
the model file's SHA-256, so a state paired with the wrong model is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]
STATE = "state.json"
MODEL = "model.npy"


class CheckpointError(ValueError):
    """A checkpoint cannot be used to resume; the message says why and what to do."""


@dataclass
class Checkpoint:
    """Everything needed to continue training after round ``round``."""

    round: int
    model: F64
    fingerprint: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    scaler: dict[str, list[float]] | None = None
    stopped: str | None = None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def save(directory: str | Path, checkpoint: Checkpoint) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = np.ascontiguousarray(checkpoint.model, dtype=np.float64)
    model_bytes = model.tobytes()
    _write_atomic(directory / MODEL, model_bytes)
    state = {"format": 1, "round": checkpoint.round,
             "model_sha256": hashlib.sha256(model_bytes).hexdigest(),
             "model_size": int(model.size), "fingerprint": checkpoint.fingerprint,
             "history": checkpoint.history, "events": checkpoint.events,
             "scaler": checkpoint.scaler, "stopped": checkpoint.stopped}
    _write_atomic(directory / STATE, json.dumps(state, indent=1).encode())


def load(directory: str | Path) -> Checkpoint | None:
    """The checkpoint in ``directory``, or None if there is none yet."""
    directory = Path(directory)
    if not (directory / STATE).exists():
        return None
    try:
        state = json.loads((directory / STATE).read_text(encoding="utf-8"))
        raw = (directory / MODEL).read_bytes()
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read the checkpoint in {directory}: {exc}") from None
    if hashlib.sha256(raw).hexdigest() != state.get("model_sha256"):
        raise CheckpointError(f"{directory}: model.npy does not match state.json (a partial "
                              "copy?); restore both files or start a new checkpoint directory")
    model = np.frombuffer(raw, dtype=np.float64).copy()
    return Checkpoint(round=int(state["round"]), model=model,
                      fingerprint=dict(state["fingerprint"]), history=list(state["history"]),
                      events=list(state["events"]), scaler=state.get("scaler"),
                      stopped=state.get("stopped"))


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume with settings that change the data, model or privacy accounting."""
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}"
             for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    if diffs:
        raise CheckpointError("the checkpoint was written with other settings ("
                              + "; ".join(diffs) + "); resume with the same options or use "
                              "a new --checkpoint directory")
