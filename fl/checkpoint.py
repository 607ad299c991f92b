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
settings it belongs to, and binds every file by its SHA-256: the model's, and each log's
committed bytes, so a log cut or edited behind the manifest's back (rows and bytes made to
match) is refused on resume -- a spent privacy event cannot go missing.

The directory is the run's own: created private (``0700``); one that others may write
(group or world write permission) is refused (:class:`CheckpointError` naming
``chmod go-w``), and every file is opened with ``O_NOFOLLOW``, so a link planted in it is
never followed (its temporary names are removed and created afresh, a link at a log or the
manifest is refused). :func:`check_directory` does these checks and a write before
training, so a directory that is read-only, or a path that is a file, fails at once, not
after the first round.

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

import contextlib
import errno
import hashlib
import io
import json
import os
import stat
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
FORMAT = 4
MODEL_FORMAT = "secagg-model/1"
StateDict = dict[str, torch.Tensor]
_FIX = "restore the checkpoint directory from a backup or start a new --checkpoint directory"


class CheckpointError(FLError, ValueError):
    """A checkpoint or saved model cannot be used; the message says why and what to do."""


class CheckpointWriteError(FLError, RuntimeError):
    """A save failed while training ran (a full disk, a file-size limit): a runtime failure
    (``secagg train`` exits 1, not the usage code 2); the message names the file, the
    cause's fix and whether a previous checkpoint is intact."""


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


_LINKS = "a checkpoint never follows a link: remove it, or choose another --checkpoint directory"


def _io_error(path: Path, exc: OSError, previous: int | None = None,
              saved: int | None = None, during: bool = True
              ) -> CheckpointError | CheckpointWriteError:
    """The message for a failed write: what failed, the fix that fits its cause, and what
    is on disk (``previous``: the round of the checkpoint the save left whole, if any;
    ``saved``: the round committed before the failure)."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ELOOP:
        fix = f"it is a symbolic link; {_LINKS}"
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space on its disk (or raise the quota) or choose another --checkpoint directory"
    elif exc.errno == errno.EFBIG:
        fix = ("a file-size limit (`ulimit -f`, or the file system's largest file) is below "
               "the checkpoint's size: raise it or choose another --checkpoint directory")
    elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = "the directory is not writable: make it writable or choose another --checkpoint"
    elif exc.errno in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
        fix = "a path in it is not what a checkpoint expects: choose another --checkpoint"
    else:
        fix = "choose another --checkpoint directory"
    if saved is not None:
        after = f"; the checkpoint of round {saved} was saved before this failed"
    elif previous is not None:
        after = f"; the previous checkpoint (round {previous}) is intact"
    else:
        after = "; no checkpoint was written yet"
    planted = exc.errno == errno.ELOOP  # the directory's content is refused, not the disk
    return (CheckpointWriteError if during and not planted else CheckpointError)(
        f"cannot write the checkpoint file {path}: {reason} (errno {exc.errno}); {fix}{after}")


def check_directory(directory: str | Path) -> Path:
    """Make ``directory`` ready for checkpoints, or refuse it now (before any training):
    create it private (``0700``), refuse a path that is not a directory or that others may
    write, and write and remove a probe file. Raises :class:`CheckpointError`."""
    directory = Path(directory)
    _private_directory(directory)
    probe = directory / f".probe-{os.getpid()}"
    try:
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()
        os.close(_open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        probe.unlink()
    except OSError as exc:
        raise _io_error(probe, exc, _round_of(directory), during=False) from None
    return directory


def check_writable(folder: str | Path, option: str) -> None:
    """Refuse now a ``folder`` that an output (``option``, e.g. ``--report``) could not be
    written into after training: missing, not a directory, or not writable."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{option}: {folder} is not an existing directory")
    probe = folder / f".secagg-probe-{os.getpid()}"
    try:
        os.close(_open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"{option}: cannot write into {folder} ({exc.strerror or exc});"
                              " make it writable or choose another path") from None


def _round_of(directory: Path) -> int | None:
    """The round of the checkpoint in ``directory`` as its manifest says, or None."""
    try:
        state = json.loads(_read_bytes(directory / STATE))
        return int(state["round"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _private_directory(directory: Path) -> None:
    """Create ``directory`` (``0700``) or check the existing one: a directory no one else
    may write into."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.stat()
    except FileExistsError:
        raise CheckpointError(f"--checkpoint {directory} is a file, not a directory: choose "
                              "a directory (it is created if missing)") from None
    except OSError as exc:
        raise _io_error(directory, exc, during=False) from None
    if not stat.S_ISDIR(info.st_mode):
        raise CheckpointError(f"--checkpoint {directory} is a file, not a directory: choose "
                              "a directory (it is created if missing)")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CheckpointError(
            f"--checkpoint {directory} may be written by other users (mode "
            f"{stat.S_IMODE(info.st_mode):o}): anyone who can could replace the model or cut "
            f"the spent privacy events; run `chmod go-w {directory}` (or `chmod 700`) or "
            "choose a private directory")


def _open(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that never follows a link at ``path`` (ELOOP instead)."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def _read_bytes(path: Path, size: int | None = None) -> bytes:
    """``path``'s bytes (the first ``size``), never through a link."""
    fd = _open(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as handle:
        return handle.read() if size is None else handle.read(size)


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
    """``data`` in a new file at ``path`` (whatever was there, a link too, is removed
    first, never followed), fsynced."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = _open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
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


def _append(path: Path, committed: int, digest: str | None,
            rows: Sequence[Mapping[str, Any]]) -> tuple[int, str]:
    """Cut ``path`` to its ``committed`` bytes (a crashed save's rows go), check them
    against the manifest's ``digest`` (None: a format-3 manifest, which had none), append
    ``rows`` as JSON lines, fsync; returns the new length and the SHA-256 of the whole."""
    fd = _open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, committed)
        os.lseek(fd, 0, os.SEEK_SET)
        prefix = b""
        while len(prefix) < committed:
            chunk = os.read(fd, committed - len(prefix))
            if not chunk:
                break
            prefix += chunk
        if (len(prefix) != committed
                or (digest is not None and hashlib.sha256(prefix).hexdigest() != digest)):
            raise CheckpointError(f"{path} does not match {path.parent / STATE} (edited or "
                                  f"cut since the last save?); {_FIX}")
        data = b"".join(json.dumps(row, separators=(",", ":")).encode() + b"\n"
                        for row in rows)
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return committed + len(data), hashlib.sha256(prefix + data).hexdigest()


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
    """The manifest's log lengths (and digests), generation and round (zeros when there is
    none, or it is of format 2, whose history lives in ``state.json``)."""
    try:
        state = json.loads(_read_bytes(directory / STATE))
    except FileNotFoundError:
        state = {}
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {directory / STATE}: {exc}; {_FIX}") from None
    if not isinstance(state, dict) or state.get("format") not in (3, FORMAT):
        return {"generation": 0, "logs": {}, "round": state.get("round")
                if isinstance(state, dict) else None}
    try:
        return {"generation": int(state["generation"]), "logs": dict(state["logs"]),
                "round": int(state["round"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{directory / STATE} does not have the shape of a secagg "
                              f"checkpoint ({type(exc).__name__}: {exc}); {_FIX}") from None


def save(directory: str | Path, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` as one atomic unit (see the module docstring). A write that
    fails (a full disk) raises :class:`CheckpointWriteError` naming the file and its cause;
    the previous checkpoint, if there is one, stays whole. A directory others may write, a
    link in it or a log that does not match the manifest raise :class:`CheckpointError`."""
    directory = Path(directory)
    _private_directory(directory)
    path: Path = directory
    previous: int | None = None
    saved: int | None = None
    try:
        before = _committed(directory)
        previous = before["round"]
        generation = before["generation"] + 1
        model_bytes = _state_bytes(checkpoint.model)
        model_name = f"model-{generation}.pt"
        path = directory / model_name
        _write_new(path, model_bytes)
        logs = {}
        for name, rows in ((HISTORY, checkpoint.history), (EVENTS, checkpoint.events)):
            had = before["logs"].get(name, {"rows": 0, "bytes": 0, "sha256": None})
            if len(rows) < had["rows"]:  # not an append: write the log again
                had = {"rows": 0, "bytes": 0, "sha256": None}
            path = directory / name
            size, digest = _append(path, had["bytes"], had.get("sha256"), rows[had["rows"]:])
            logs[name] = {"rows": len(rows), "bytes": size, "sha256": digest}
        _fsync_dir(directory)  # the new files' names are durable before the commit
        state = {"format": FORMAT, "generation": generation, "round": checkpoint.round,
                 "model": model_name, "model_sha256": hashlib.sha256(model_bytes).hexdigest(),
                 "logs": logs, "fingerprint": checkpoint.fingerprint,
                 "scaler": checkpoint.scaler, "stopped": checkpoint.stopped,
                 "charged": checkpoint.charged, "server": checkpoint.server}
        path = directory / STATE
        _write_atomic(path, json.dumps(state, indent=1).encode())  # the commit
        saved = checkpoint.round
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
        raise _io_error(path, exc, previous, saved) from None


def _read_log(directory: Path, name: str, spec: Any, fmt: int) -> list[dict[str, Any]]:
    path = directory / name
    rows, size = int(spec["rows"]), int(spec["bytes"])
    data = _read_bytes(path, size)
    lines = data.split(b"\n")
    if len(data) != size or lines[-1] != b"" or len(lines) - 1 != rows:
        raise CheckpointError(f"{path} holds fewer rows than {directory / STATE} records "
                              f"({rows} rows, {size} bytes): a truncated copy? {_FIX}")
    if ((fmt == FORMAT or "sha256" in spec)  # format 3 had no digests
            and hashlib.sha256(data).hexdigest() != spec.get("sha256")):
        raise CheckpointError(f"{path} does not match {directory / STATE} (its SHA-256 "
                                  "differs: edited, cut or swapped since it was saved); "
                                  f"{_FIX}")
    return [json.loads(line) for line in lines[:-1]]


def load(directory: str | Path) -> Checkpoint | None:
    """The checkpoint in ``directory``, or None if there is none yet."""
    directory = Path(directory)
    state_path = directory / STATE
    if not state_path.exists():
        return None
    try:
        state = json.loads(_read_bytes(state_path))
    except OSError as exc:
        links = f"it is a symbolic link; {_LINKS}" if exc.errno == errno.ELOOP else _FIX
        raise CheckpointError(f"cannot read {state_path}: {exc.strerror or exc}; {links}"
                              ) from None
    except ValueError as exc:
        raise CheckpointError(f"cannot read {state_path}: {exc}; {_FIX}") from None
    fmt = state.get("format") if isinstance(state, dict) else None
    if fmt not in (2, 3, FORMAT):
        raise CheckpointError(f"{state_path} is not a secagg checkpoint of format 2 to "
                              f"{FORMAT} (format {fmt!r}); {_FIX}")
    try:
        model_path = directory / (MODEL if fmt == 2 else str(state["model"]))
        if model_path.parent != directory:
            raise ValueError(f"model file {state['model']!r} outside the directory")
        raw = _read_bytes(model_path)
        if fmt == 2:
            history, events = list(state["history"]), list(state["events"])
        else:
            history = _read_log(directory, HISTORY, state["logs"][HISTORY], fmt)
            events = _read_log(directory, EVENTS, state["logs"][EVENTS], fmt)
        round_number = int(state["round"])
        fingerprint = dict(state["fingerprint"])
        expected = str(state["model_sha256"])
        charged = None if state.get("charged") is None else int(state["charged"])
    except CheckpointError:
        raise
    except OSError as exc:
        links = f"a file in it is a symbolic link; {_LINKS}" if exc.errno == errno.ELOOP \
            else _FIX
        raise CheckpointError(f"cannot read the checkpoint in {directory}: {exc}; {links}"
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
