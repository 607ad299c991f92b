"""The round's blob: what one round is about, broadcast once to every site.

It holds the task (the public :class:`fl.contribution.RoundTask` plus the federation's
schema and model kind), the global model, the federation's feature scaler and, under
SCAFFOLD, the server's control variate. Its SHA-256
is what the round announces and what the secure-aggregation context binds
(:func:`fl.remote.messages.round_context`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from fl.remote.messages import KINDS, MAX_BLOB_BYTES, WireError, get_str, pack, unpack

F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Blob:
    """``kind`` is ``train`` (model and task) or ``scaler`` (the feature-sum round)."""

    kind: str
    task: Mapping[str, Any]
    model: F64 | None = None
    scaler: tuple[F64, F64] | None = field(default=None)
    control: F64 | None = None
    """``--strategy scaffold``: the server's control variate ``c`` (one per parameter)."""

    def encode(self) -> bytes:
        model = None if self.model is None else _raw(self.model)
        scaler = None if self.scaler is None else [_raw(a) for a in self.scaler]
        body = {"kind": self.kind, "task": dict(self.task), "model": model, "scaler": scaler}
        if self.control is not None:
            body["control"] = _raw(self.control)
        return pack("blob", body)

    @classmethod
    def decode(cls, data: bytes) -> Blob:
        """Validates the envelope; :func:`fl.contribution.RoundTask.from_wire` the task."""
        body = unpack(data, MAX_BLOB_BYTES)
        if body.get("t") != "blob":
            raise WireError("not a blob")
        kind = get_str(body, "kind", KINDS)
        task = body.get("task")
        if not isinstance(task, dict) or not all(isinstance(k, str) for k in task):
            raise WireError("blob field 'task' must be a map")
        model = None if body.get("model") is None else _floats(body["model"], "model")
        scaler_raw = body.get("scaler")
        scaler = None
        if scaler_raw is not None:
            if not isinstance(scaler_raw, list) or len(scaler_raw) != 2:
                raise WireError("blob field 'scaler' must be [mean, std]")
            mean = _floats(scaler_raw[0], "scaler mean")
            std = _floats(scaler_raw[1], "scaler std", mean.size)
            if np.any(std <= 0):
                raise WireError("blob field 'scaler' has a non-positive std")
            scaler = (mean, std)
        if kind == "train" and model is None:
            raise WireError("a training blob without a model")
        control = None
        if body.get("control") is not None:
            control = _floats(body["control"], "control",
                              None if model is None else model.size)
        return cls(kind, task, model, scaler, control)


def _raw(values: F64) -> bytes:
    return np.ascontiguousarray(values, dtype="<f8").tobytes()


def _floats(raw: Any, what: str, size: int | None = None) -> F64:
    if not isinstance(raw, bytes) or len(raw) % 8:
        raise WireError(f"blob field {what!r} must be float64 bytes")
    values = np.frombuffer(raw, dtype="<f8").astype(np.float64)
    if size is not None and values.size != size:
        raise WireError(f"blob field {what!r} has {values.size} values, expected {size}")
    if not np.all(np.isfinite(values)):
        raise WireError(f"blob field {what!r} contains NaN or inf")
    return values


def blob_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class FetchPacer:
    """When a site asks the coordinator for the round's blob again (:class:`Fetch`).

    Only once no frame of any blob has arrived for ``delay`` seconds (a site on a slow link
    whose blob is still coming in never asks), and ``delay`` doubles with every ask up to
    ``cap``: a site that keeps missing the blob costs the coordinator one blob every
    ``cap`` seconds, not one a second. The coordinator answers the asker alone
    (:meth:`fl.remote.messages.FedTopics.model_to`)."""

    def __init__(self, first: float = 2.0, cap: float = 30.0) -> None:
        self.first, self.cap = first, cap
        self.delay = first
        self.asked_at = self.heard_at = 0.0
        self.asks = 0

    def start(self, now: float) -> None:
        """A new blob is awaited: the first ask comes ``first`` seconds after silence."""
        self.delay, self.asked_at = self.first, now

    def heard(self, now: float) -> None:
        """A frame of a blob arrived (the broadcast or an answer is still coming in)."""
        self.heard_at = now

    def due(self, now: float) -> bool:
        """Whether to ask now; counts the ask and backs off when it is."""
        if now - max(self.asked_at, self.heard_at) < self.delay:
            return False
        self.asked_at, self.delay = now, min(self.cap, 2 * self.delay)
        self.asks += 1
        return True

    def wait(self, now: float) -> float:
        """Seconds until :meth:`due` could next be true (at least a tenth of a second)."""
        return max(0.1, max(self.asked_at, self.heard_at) + self.delay - now)
