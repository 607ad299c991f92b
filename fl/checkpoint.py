"""Checkpoints and saved models: torch ``state_dict`` files any torch user loads in one line.

A checkpoint is a directory written after every round, so a crash loses at most one round.
``state.json`` is its manifest and is written last: one ``os.replace`` (atomic on POSIX,
then the directory is fsynced) commits the whole round. What it names was written and
fsynced before it:

* ``model-<generation>.pt``: the global model's ``state_dict`` (``torch.save``), a new file
  every save, so the committed model is never overwritten; ``state.json`` records its
  SHA-256. ``model.pt`` is a hard link to the committed one, updated after the commit, for
  ``model.load_state_dict(torch.load("ckpt/model.pt"))``.
* ``history.jsonl`` and ``events.jsonl``: the per-round report rows and the spent privacy
  events, one JSON line each, appended (a round writes its own rows, not the whole run
  again); ``state.json`` records how many rows and bytes of each are committed, and a save
  first cuts whatever a crash appended beyond that.

``state.json`` also holds the round, the scaler, the server optimizer's moments and the
settings it belongs to.

A crash at any instruction of :func:`save` leaves the previous checkpoint or the new one,
whole (``tests/fl/test_checkpoint_crash.py``). Files of a save that never committed are
removed by the next one. Format 2 checkpoints (``state.json`` holding the history, one
``model.pt``) are still read; the next save writes format 3.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fl.vector import ParameterLayout

from .errors import FLError

STATE = "state.json"
MODEL = "model.pt"
HISTORY = "history.jsonl"
EVENTS = "events.jsonl"
FORMAT = 3
MODEL_FORMAT = "secagg-model/1"
StateDict = dict[str, torch.Tensor]
_FIX = "restore the checkpoint directory from a backup or start a new --checkpoint directory"


class CheckpointError(FLError, ValueError):
    """A checkpoint or saved model cannot be used; the message says why and what to do."""


@dataclass
class Checkpoint:
    """Everything needed to continue training after round ``round``. ``history`` and
    ``events`` only grow from one save to the next (a save appends their new rows)."""

    round: int
    model: StateDict
    fingerprint: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    scaler: dict[str, list[float]] | None = None
    stopped: str | None = None
    server: dict[str, Any] | None = None
    """The server optimizer's state (:meth:`fl.strategies.ServerStrategy.state`)."""
    charged: int | None = None
    """A round whose cost is in ``events`` (written ahead) but that did not complete."""


def _io_error(path: Path, exc: OSError) -> CheckpointError:
    reason = exc.strerror or str(exc)
    return CheckpointError(f"cannot write the checkpoint file {path}: {reason} (errno "
                           f"{exc.errno}); free space or choose another --checkpoint directory"
                           "; the previous checkpoint is intact")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_new(path: Path, data: bytes) -> None:
    """``data`` at ``path`` (replacing any file there), fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    _write_new(tmp, data)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _append(path: Path, committed: int, rows: Sequence[Mapping[str, Any]]) -> int:
    """Cut ``path`` to its ``committed`` bytes (a crashed save's rows go), append ``rows``
    as JSON lines, fsync; returns the new length."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, committed)
        os.lseek(fd, committed, os.SEEK_SET)
        data = b"".join(json.dumps(row, separators=(",", ":")).encode() + b"\n"
                        for row in rows)
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return committed + len(data)


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


def _committed(directory: Path) -> dict[str, Any]:
    """The manifest's log lengths and generation (zeros when there is none, or it is of
    format 2, whose history lives in ``state.json``)."""
    try:
        state = json.loads((directory / STATE).read_bytes())
    except FileNotFoundError:
        state = {}
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {directory / STATE}: {exc}; {_FIX}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        return {"generation": 0, "logs": {}}
    try:
        return {"generation": int(state["generation"]), "logs": dict(state["logs"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{directory / STATE} does not have the shape of a secagg "
                              f"checkpoint ({type(exc).__name__}: {exc}); {_FIX}") from None


def save(directory: str | Path, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` as one atomic unit (see the module docstring). A write that
    fails (a full disk) raises :class:`CheckpointError` naming the file; the previous
    checkpoint stays whole."""
    directory = Path(directory)
    path = directory
    try:
        directory.mkdir(parents=True, exist_ok=True)
        before = _committed(directory)
        generation = before["generation"] + 1
        model_bytes = _state_bytes(checkpoint.model)
        model_name = f"model-{generation}.pt"
        path = directory / model_name
        _write_new(path, model_bytes)
        logs = {}
        for name, rows in ((HISTORY, checkpoint.history), (EVENTS, checkpoint.events)):
            had = before["logs"].get(name, {"rows": 0, "bytes": 0})
            if len(rows) < had["rows"]:  # not an append: write the log again
                had = {"rows": 0, "bytes": 0}
            path = directory / name
            size = _append(path, had["bytes"], rows[had["rows"]:])
            logs[name] = {"rows": len(rows), "bytes": size}
        _fsync_dir(directory)  # the new files' names are durable before the commit
        state = {"format": FORMAT, "generation": generation, "round": checkpoint.round,
                 "model": model_name, "model_sha256": hashlib.sha256(model_bytes).hexdigest(),
                 "logs": logs, "fingerprint": checkpoint.fingerprint,
                 "scaler": checkpoint.scaler, "stopped": checkpoint.stopped,
                 "charged": checkpoint.charged, "server": checkpoint.server}
        path = directory / STATE
        _write_atomic(path, json.dumps(state, indent=1).encode())  # the commit
        path = directory / MODEL
        tmp = directory / (MODEL + ".tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(directory / model_name, tmp)
        except OSError:  # a file system without hard links: a copy
            _write_new(tmp, model_bytes)
        os.replace(tmp, path)
        for stale in directory.glob("model-*.pt"):
            if stale.name != model_name:
                path = stale
                stale.unlink()
    except OSError as exc:
        raise _io_error(path, exc) from None


def _read_log(directory: Path, name: str, spec: Any) -> list[dict[str, Any]]:
    path = directory / name
    rows, size = int(spec["rows"]), int(spec["bytes"])
    with open(path, "rb") as handle:
        data = handle.read(size)
    lines = data.split(b"\n")
    if len(data) != size or lines[-1] != b"" or len(lines) - 1 != rows:
        raise CheckpointError(f"{path} holds fewer rows than {directory / STATE} records "
                              f"({rows} rows, {size} bytes): a truncated copy? {_FIX}")
    return [json.loads(line) for line in lines[:-1]]


def load(directory: str | Path) -> Checkpoint | None:
    """The checkpoint in ``directory``, or None if there is none yet."""
    directory = Path(directory)
    state_path = directory / STATE
    if not state_path.exists():
        return None
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {state_path}: {exc}; {_FIX}") from None
    fmt = state.get("format") if isinstance(state, dict) else None
    if fmt not in (2, FORMAT):
        raise CheckpointError(f"{state_path} is not a secagg checkpoint of format 2 or "
                              f"{FORMAT} (format {fmt!r}); {_FIX}")
    try:
        model_path = directory / (MODEL if fmt == 2 else str(state["model"]))
        if model_path.parent != directory:
            raise ValueError(f"model file {state['model']!r} outside the directory")
        raw = model_path.read_bytes()
        if fmt == 2:
            history, events = list(state["history"]), list(state["events"])
        else:
            history = _read_log(directory, HISTORY, state["logs"][HISTORY])
            events = _read_log(directory, EVENTS, state["logs"][EVENTS])
        round_number = int(state["round"])
        fingerprint = dict(state["fingerprint"])
        expected = str(state["model_sha256"])
        charged = None if state.get("charged") is None else int(state["charged"])
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot read the checkpoint in {directory}: {exc}; {_FIX}"
                              ) from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        what = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
        raise CheckpointError(f"{state_path} does not have the shape of a secagg checkpoint "
                              f"({type(exc).__name__}: {what}); {_FIX}") from None
    if hashlib.sha256(raw).hexdigest() != expected:
        raise CheckpointError(f"{model_path} does not match {state_path} (a partial copy?); "
                              f"{_FIX}")
    return Checkpoint(round=round_number, model=_read_state(raw, str(model_path)),
                      fingerprint=fingerprint, history=history, events=events,
                      scaler=state.get("scaler"), stopped=state.get("stopped"),
                      charged=charged, server=state.get("server"))


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume with settings that change the data, model or privacy accounting."""
    current = json.loads(json.dumps(current))  # as saved: tuples are lists
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
