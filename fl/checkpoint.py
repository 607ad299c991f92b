"""Checkpoints and saved models: torch ``state_dict`` files any torch user loads in one line.

A checkpoint is a directory written after every round, so a crash loses at most one round:
``model.pt`` (the global model's ``state_dict``, ``torch.save``) and ``state.json`` (round,
history, spent privacy events, scaler, the server optimizer's moments, the settings it
belongs to). Both are written to
temporary files and renamed into place, model first, so a crash mid-write leaves the
previous checkpoint intact (``os.replace`` is atomic on POSIX); ``state.json`` records the
model file's SHA-256, so a state paired with the wrong model is refused.

``secagg train --save-model PATH`` (:func:`save_model`) writes the final model the same way
(``PATH``, a ``state_dict``) with its layout and how to use it in ``PATH.json``: parameter
names, shapes and dtypes, the model kind and its sizes, the label values and the feature
scaler inputs need. ``model.load_state_dict(torch.load(PATH))`` restores it, as it does a
checkpoint's ``model.pt``; :func:`load_model` also rebuilds a built-in model from the JSON.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fl.vector import ParameterLayout

from .errors import FLError

STATE = "state.json"
MODEL = "model.pt"
MODEL_FORMAT = "secagg-model/1"
StateDict = dict[str, torch.Tensor]


class CheckpointError(FLError, ValueError):
    """A checkpoint or saved model cannot be used; the message says why and what to do."""


@dataclass
class Checkpoint:
    """Everything needed to continue training after round ``round``."""

    round: int
    model: StateDict
    fingerprint: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    scaler: dict[str, list[float]] | None = None
    stopped: str | None = None
    server: dict[str, Any] | None = None
    """The server optimizer's state (:meth:`fl.strategies.ServerStrategy.state`)."""


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _state_bytes(state: Mapping[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, buffer)
    return buffer.getvalue()


def _read_state(raw: bytes, where: str) -> StateDict:
    try:
        state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several unrelated types for a bad file
        raise CheckpointError(f"{where} is not a torch state_dict file: {exc}") from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise CheckpointError(f"{where} does not hold a state_dict (name -> tensor)")
    return state


def save(directory: str | Path, checkpoint: Checkpoint) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model_bytes = _state_bytes(checkpoint.model)
    _write_atomic(directory / MODEL, model_bytes)
    state = {"format": 2, "round": checkpoint.round,
             "model_sha256": hashlib.sha256(model_bytes).hexdigest(),
             "fingerprint": checkpoint.fingerprint, "history": checkpoint.history,
             "events": checkpoint.events, "scaler": checkpoint.scaler,
             "stopped": checkpoint.stopped, "server": checkpoint.server}
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
    if state.get("format") != 2:
        raise CheckpointError(f"{directory}: a checkpoint of another format "
                              f"({state.get('format')!r}); start a new checkpoint directory")
    if hashlib.sha256(raw).hexdigest() != state.get("model_sha256"):
        raise CheckpointError(f"{directory}: {MODEL} does not match {STATE} (a partial "
                              "copy?); restore both files or start a new checkpoint directory")
    return Checkpoint(round=int(state["round"]), model=_read_state(raw, str(directory / MODEL)),
                      fingerprint=dict(state["fingerprint"]), history=list(state["history"]),
                      events=list(state["events"]), scaler=state.get("scaler"),
                      stopped=state.get("stopped"), server=state.get("server"))


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume with settings that change the data, model or privacy accounting."""
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}"
             for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    if diffs:
        raise CheckpointError("the checkpoint was written with other settings ("
                              + "; ".join(diffs) + "); resume with the same options or use "
                              "a new --checkpoint directory")


# -- saved models ---------------------------------------------------------------------------
def save_model(path: str | Path, model: torch.nn.Module, info: Mapping[str, Any]) -> Path:
    """``model``'s ``state_dict`` at ``path`` and its layout plus ``info`` (model kind,
    sizes, labels, scaler, ...) at ``path.json``; returns the JSON's path."""
    path = Path(path)
    if not path.parent.is_dir():
        raise CheckpointError(f"{path}: its directory does not exist")
    layout = ParameterLayout.of(model)
    meta = {"format": MODEL_FORMAT, **info,
            "layout": [{"name": e.name, "shape": list(e.shape), "dtype": str(e.dtype)}
                       for e in layout.entries],
            "load": f"model.load_state_dict(torch.load({path.name!r}))"}
    _write_atomic(path, _state_bytes(model.state_dict()))
    meta_path = path.with_name(path.name + ".json")
    _write_atomic(meta_path, json.dumps(meta, indent=1).encode())
    return meta_path


def load_model(path: str | Path, module: torch.nn.Module | None = None
               ) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A model saved by :func:`save_model`, and its JSON. ``module``: your own module of the
    saved architecture; None rebuilds the built-in model the JSON names."""
    from fl.models import make_model

    path = Path(path)
    try:
        meta = json.loads(path.with_name(path.name + ".json").read_text(encoding="utf-8"))
        raw = path.read_bytes()
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read the saved model {path}: {exc}") from None
    if meta.get("format") != MODEL_FORMAT:
        raise CheckpointError(f"{path}.json is not a {MODEL_FORMAT} description")
    if module is None:
        if meta.get("model") is None:
            raise CheckpointError(f"{path} holds a user-defined model: pass the module")
        module = make_model(meta["model"], int(meta["in_features"]), int(meta["num_classes"]))
    recorded = [(e["name"], tuple(e["shape"])) for e in meta["layout"]]
    actual = [(e.name, e.shape) for e in ParameterLayout.of(module).entries]
    if recorded != actual:
        raise CheckpointError(f"{path}: the module's parameters {actual[:4]}... differ from "
                              f"the saved layout {recorded[:4]}...")
    module.load_state_dict(_read_state(raw, str(path)))
    return module, meta
