"""What the coordinator process and the site processes say to each other around secagg.

Secure aggregation itself runs over ``transport`` (one secagg round per training round,
``transport.drivers``); this module is the thin federation layer around it: who is online,
which round is open, which model it is about. Everything lives on topics the transport's
ACL already grants (docs/deployment.md section 4), under a *federation name* used as the
``<round>`` level, so no broker configuration changes:

====================================================  ==============  ====================
topic                                                 writer          carries
====================================================  ==============  ====================
``secagg/<fed>/control``                              coordinator     :class:`Waiting`,
                                                                      :class:`Announce`,
                                                                      :class:`Done`
                                                                      (retained), the
                                                                      coordinator's will
``secagg/<fed>-model/control``                        coordinator     the round's
                                                                      :class:`Blob`, framed
                                                                      and chunked
``secagg/<fed>/server/<kind>/site-<id>``              site ``<id>``   :class:`Hello`,
                                                                      :class:`Fetch`,
                                                                      :class:`Ready`, the
                                                                      site's will
====================================================  ==============  ====================

Every payload is a ``transport.framing`` frame around a msgpack map, and every decoder here
checks each field's type and range: anything else raises :class:`WireError`, which the
receiving loop logs and drops (a hostile or corrupted message never crashes a site).

The model travels once per round as a broadcast (not once per site), chunked by the
transport's framing; its SHA-256 is announced and bound into the secure-aggregation
``context`` (:func:`round_context`), so a site only contributes to a session about the
model it actually received: if the coordinator (or the broker) showed different sites
different models, their session ids differ and the round cannot mix them.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from transport.framing import frame
from transport.link import Will
from transport.mqtt import BrokerSettings, MqttLink
from transport.topics import Topics, check_round_name

F64 = npt.NDArray[np.float64]
U64 = npt.NDArray[np.uint64]

VERSION = 1
MAX_CONTROL_BYTES = 1 << 20
"""Control messages carry ids and hashes only (and, opt-in, one input vector)."""
MAX_BLOB_BYTES = 256 << 20
MAX_SITE_ID = (1 << 32) - 1
MAX_ROSTER = 1 << 16
KINDS = ("train", "scaler")
PHASES = ("open", "go")
FETCH, HELLO, READY, OFFLINE = "fetch", "hello", "ready", "offline"
SITE_KINDS = (FETCH, HELLO, READY, OFFLINE)


class WireError(ValueError):
    """A federation payload that does not decode to a valid message (logged and dropped)."""


# --------------------------------------------------------------------------- topics


@dataclass(frozen=True)
class FedTopics:
    """The federation-level topics of ``federation`` (see the module docstring)."""

    federation: str

    def __post_init__(self) -> None:
        check_round_name(self.federation)
        check_round_name(self.federation + "-model")

    @property
    def _fed(self) -> Topics:
        return Topics(self.federation)

    @property
    def control(self) -> str:
        return self._fed.control

    @property
    def model(self) -> str:
        return Topics(self.federation + "-model").control

    @property
    def server_filter(self) -> str:
        return self._fed.server_filter

    def upstream(self, site_id: int, kind: str) -> str:
        return self._fed.upstream(site_id, kind)

    def parse_upstream(self, topic: str) -> tuple[str, int] | None:
        return self._fed.parse_upstream(topic)


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Waiting:
    """The coordinator of run ``run`` is up and collecting :class:`Hello`s. Retained, so it
    replaces whatever an earlier run left on the control topic (a stale :class:`Done`)."""

    run: bytes


@dataclass(frozen=True)
class Announce:
    """Round ``round`` (attempt ``attempt``) of run ``run``.

    ``phase="open"``: the ``cohort`` should fetch the blob (``blob`` = its SHA-256, ``size``
    bytes), compute its input and answer :class:`Ready`. ``phase="go"``: the secagg round
    ``name`` runs with ``roster`` (the ready sites) and ``threshold``; sites outside the
    roster sit it out.
    """

    run: bytes
    round: int
    attempt: int
    kind: str
    name: str
    cohort: tuple[int, ...]
    blob: bytes
    size: int
    phase: str = "open"
    roster: tuple[int, ...] = ()
    threshold: int = 0
    verify: bool = False

    @property
    def key(self) -> tuple[bytes, int, int, str]:
        return (self.run, self.round, self.attempt, self.kind)


@dataclass(frozen=True)
class Done:
    """Run ``run`` is over after ``rounds`` rounds (``reason`` says why): sites exit."""

    run: bytes
    rounds: int
    reason: str = ""


@dataclass(frozen=True)
class CoordinatorOffline:
    """The coordinator's last will: it went away (it may come back with ``--resume``)."""

    reason: str = ""


@dataclass(frozen=True)
class Hello:
    """A site is online. ``features``/``labels`` are its table's schema (column names and
    distinct label values, never records) so the coordinator can check every site agrees."""

    site: int
    features: tuple[str, ...]
    labels: tuple[str, ...]
    run: bytes = b""


@dataclass(frozen=True)
class Fetch:
    """A site missed the broadcast of blob ``blob``: please broadcast it again."""

    blob: bytes


@dataclass(frozen=True)
class Ready:
    """The site computed its input for the announced round and listens on its secagg topics.

    ``input`` is its encoded vector in the clear, sent only by a site started with
    ``--insecure-verify`` when the coordinator asked for it (tests: it defeats secure
    aggregation for that site)."""

    run: bytes
    round: int
    attempt: int
    kind: str
    blob: bytes
    input: bytes | None = None

    @property
    def key(self) -> tuple[bytes, int, int, str]:
        return (self.run, self.round, self.attempt, self.kind)


@dataclass(frozen=True)
class SiteOffline:
    """A site's last will (or its sign-off when it exits)."""

    reason: str = ""


CoordinatorMessage = Waiting | Announce | Done | CoordinatorOffline
SiteMessage = Hello | Fetch | Ready | SiteOffline


def _pack(body: dict[str, Any]) -> bytes:
    body["v"] = VERSION
    return msgpack.packb(body, use_bin_type=True)


def encode_message(message: CoordinatorMessage | SiteMessage) -> bytes:
    """The msgpack body of ``message`` (frame it with ``transport.framing``)."""
    if isinstance(message, Waiting):
        return _pack({"t": "waiting", "run": message.run})
    if isinstance(message, Announce):
        return _pack({"t": "announce", "run": message.run, "round": message.round,
                      "attempt": message.attempt, "kind": message.kind, "name": message.name,
                      "cohort": list(message.cohort), "blob": message.blob,
                      "size": message.size, "phase": message.phase,
                      "roster": list(message.roster), "threshold": message.threshold,
                      "verify": message.verify})
    if isinstance(message, Done):
        return _pack({"t": "done", "run": message.run, "rounds": message.rounds,
                      "reason": message.reason})
    if isinstance(message, CoordinatorOffline):
        return _pack({"t": "coordinator-offline", "reason": message.reason})
    if isinstance(message, Hello):
        return _pack({"t": "hello", "site": message.site, "features": list(message.features),
                      "labels": list(message.labels), "run": message.run})
    if isinstance(message, Fetch):
        return _pack({"t": "fetch", "blob": message.blob})
    if isinstance(message, Ready):
        return _pack({"t": "ready", "run": message.run, "round": message.round,
                      "attempt": message.attempt, "kind": message.kind, "blob": message.blob,
                      "input": message.input})
    return _pack({"t": "offline", "reason": message.reason})


def _unpack(data: bytes, limit: int) -> dict[Any, Any]:
    if len(data) > limit:
        raise WireError(f"message of {len(data)} bytes exceeds {limit}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False, max_bin_len=len(data),
                               max_str_len=1 << 16, max_array_len=1 << 20, max_map_len=64)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"not msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise WireError("not a map")
    if body.get("v") != VERSION:
        raise WireError(f"unsupported message version {body.get('v')!r} (this is {VERSION})")
    return body


def _int(body: Mapping[Any, Any], key: str, low: int = 0, high: int = MAX_SITE_ID) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise WireError(f"field {key!r} must be an integer in [{low}, {high}]")
    return value


def _bytes(body: Mapping[Any, Any], key: str, size: int | None = None) -> bytes:
    value = body.get(key)
    if not isinstance(value, bytes) or (size is not None and len(value) != size):
        raise WireError(f"field {key!r} must be {size or 'some'} bytes")
    return value


def _str(body: Mapping[Any, Any], key: str, choices: tuple[str, ...] | None = None,
         limit: int = 4096) -> str:
    value = body.get(key)
    if not isinstance(value, str) or len(value) > limit or (choices and value not in choices):
        raise WireError(f"field {key!r} must be " + (f"one of {choices}" if choices
                                                     else "a string"))
    return value


def _ids(body: Mapping[Any, Any], key: str) -> tuple[int, ...]:
    value = body.get(key)
    if not isinstance(value, list) or len(value) > MAX_ROSTER or not all(
            isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_SITE_ID
            for v in value):
        raise WireError(f"field {key!r} must be a list of site ids")
    if len(set(value)) != len(value):
        raise WireError(f"field {key!r} repeats a site id")
    return tuple(sorted(value))


def _names(body: Mapping[Any, Any], key: str) -> tuple[str, ...]:
    value = body.get(key)
    if not isinstance(value, list) or len(value) > 100_000 or not all(
            isinstance(v, str) and len(v) <= 1024 for v in value):
        raise WireError(f"field {key!r} must be a list of strings")
    return tuple(value)


def decode_coordinator_message(data: bytes) -> CoordinatorMessage:
    """A message from the federation control topic; raises :class:`WireError`."""
    body = _unpack(data, MAX_CONTROL_BYTES)
    kind = body.get("t")
    if kind == "waiting":
        return Waiting(_bytes(body, "run", 16))
    if kind == "announce":
        name = _str(body, "name", limit=64)
        try:
            check_round_name(name)
        except ValueError as exc:
            raise WireError(str(exc)) from None
        phase = _str(body, "phase", PHASES)
        cohort = _ids(body, "cohort")
        roster = _ids(body, "roster")
        threshold = _int(body, "threshold", 0, MAX_ROSTER)
        verify = body.get("verify")
        if not isinstance(verify, bool):
            raise WireError("field 'verify' must be a boolean")
        if not cohort:
            raise WireError("the cohort is empty")
        if phase == "go" and (not set(roster) <= set(cohort) or len(roster) < 2
                              or not len(roster) / 2 < threshold <= len(roster)):
            raise WireError(f"roster {list(roster)[:10]} / threshold {threshold} is not a "
                            "valid secagg roster for the cohort")
        return Announce(_bytes(body, "run", 16), _int(body, "round", 0, 1 << 31),
                        _int(body, "attempt", 0, 1 << 16), _str(body, "kind", KINDS), name,
                        cohort, _bytes(body, "blob", 32), _int(body, "size", 1, MAX_BLOB_BYTES),
                        phase, roster, threshold, verify)
    if kind == "done":
        return Done(_bytes(body, "run", 16), _int(body, "rounds", 0, 1 << 31),
                    _str(body, "reason"))
    if kind == "coordinator-offline":
        return CoordinatorOffline(_str(body, "reason"))
    raise WireError(f"unknown coordinator message {kind!r}")


def decode_site_message(data: bytes, topic_kind: str, sender: int,
                        max_input_bytes: int = 0) -> SiteMessage:
    """A message from site ``sender`` (the ACL-authenticated topic says who) on the upstream
    topic of ``topic_kind``; the payload must be of that kind and name the same site."""
    body = _unpack(data, MAX_CONTROL_BYTES + max_input_bytes)
    kind = body.get("t")
    if kind != topic_kind:
        raise WireError(f"a {kind!r} message on the {topic_kind!r} topic")
    if kind == HELLO:
        site = _int(body, "site", 1)
        if site != sender:
            raise WireError(f"site {sender} says hello as site {site}")
        run = body.get("run", b"")
        if not isinstance(run, bytes) or len(run) not in (0, 16):
            raise WireError("field 'run' must be 16 bytes or empty")
        return Hello(site, _names(body, "features"), _names(body, "labels"), run)
    if kind == FETCH:
        return Fetch(_bytes(body, "blob", 32))
    if kind == READY:
        raw = body.get("input")
        if raw is not None and (not isinstance(raw, bytes) or len(raw) % 8
                                or len(raw) > max_input_bytes):
            raise WireError("field 'input' must be a uint64 vector within the size limit")
        return Ready(_bytes(body, "run", 16), _int(body, "round", 0, 1 << 31),
                     _int(body, "attempt", 0, 1 << 16), _str(body, "kind", KINDS),
                     _bytes(body, "blob", 32), raw)
    if kind == OFFLINE:
        return SiteOffline(_str(body, "reason"))
    raise WireError(f"unknown site message {kind!r}")


# --------------------------------------------------------------------------- the blob


@dataclass(frozen=True)
class Blob:
    """What one round is about: the task (training settings and privacy parameters the
    site applies), the global model and the federation's feature scaler. Its SHA-256 is
    what the round announces and what the secagg context binds."""

    kind: str
    task: Mapping[str, Any]
    model: F64 | None = None
    scaler: tuple[F64, F64] | None = field(default=None)

    def encode(self) -> bytes:
        model = None if self.model is None else np.ascontiguousarray(
            self.model, dtype="<f8").tobytes()
        scaler = None if self.scaler is None else [
            np.ascontiguousarray(a, dtype="<f8").tobytes() for a in self.scaler]
        return _pack({"t": "blob", "kind": self.kind, "task": dict(self.task),
                      "model": model, "scaler": scaler})


def _floats(raw: Any, what: str, size: int | None = None) -> F64:
    if not isinstance(raw, bytes) or len(raw) % 8:
        raise WireError(f"blob field {what!r} must be float64 bytes")
    values = np.frombuffer(raw, dtype="<f8").astype(np.float64)
    if size is not None and values.size != size:
        raise WireError(f"blob field {what!r} has {values.size} values, expected {size}")
    if not np.all(np.isfinite(values)):
        raise WireError(f"blob field {what!r} contains NaN or inf")
    return values


def decode_blob(data: bytes) -> Blob:
    """A round's blob; the task is validated by :mod:`fl.remote` (it knows the fields)."""
    body = _unpack(data, MAX_BLOB_BYTES)
    if body.get("t") != "blob":
        raise WireError("not a blob")
    kind = _str(body, "kind", KINDS)
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
    return Blob(kind, task, model, scaler)


def blob_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def round_context(federation: str, announce: Announce) -> bytes:
    """The secagg ``context`` of a round: federation, run, round, attempt, kind and the
    SHA-256 of the blob. Each site computes it from the blob *it received*."""
    return b"|".join([b"secagg-fl/1", federation.encode(), announce.run.hex().encode(),
                      b"round=%d" % announce.round, b"attempt=%d" % announce.attempt,
                      announce.kind.encode(), b"blob=sha256:" + announce.blob.hex().encode()])


# --------------------------------------------------------------------------- task fields


def task_int(task: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = task.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise WireError(f"task field {key!r} must be an integer in [{low}, {high}]")
    return value


def task_float(task: Mapping[str, Any], key: str, low: float = 0.0,
               high: float = math.inf, *, low_open: bool = False) -> float:
    value = task.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WireError(f"task field {key!r} must be a number")
    value = float(value)
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        raise WireError(f"task field {key!r}={value} is out of range")
    return value


def task_str(task: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> str:
    value = task.get(key)
    if not isinstance(value, str) or value not in choices:
        raise WireError(f"task field {key!r} must be one of {choices}")
    return value


# --------------------------------------------------------------------------- connections


def framed(message: CoordinatorMessage | SiteMessage) -> bytes:
    """``message`` as one frame (control messages are small; retained ones must be one)."""
    body = encode_message(message)
    return frame(body, len(body) + 4096)[0]


def site_will(topics: FedTopics, site_id: int) -> Will:
    return Will(topics.upstream(site_id, OFFLINE), framed(SiteOffline("connection lost")))


def coordinator_will(topics: FedTopics) -> Will:
    return Will(topics.control, framed(CoordinatorOffline("the coordinator disconnected")))


class PartyNetwork:
    """``transport.mqtt.MqttNetwork`` with a suffix on the MQTT client identifier.

    A party holds two connections at once: its long-lived federation link and the link of
    the current secagg round (which needs a will naming that round). Both authenticate as
    the same user (the ACL is per user), but MQTT closes an older connection that reuses a
    client identifier, so the federation link gets ``<user><suffix>``. ``MqttNetwork`` has
    no such option; ``MqttLink``'s ``client_factory`` parameter gives it without touching
    ``transport``.
    """

    def __init__(self, settings: BrokerSettings, suffix: str = "") -> None:
        self.settings = settings
        self.suffix = suffix

    @asynccontextmanager
    async def connect(self, username: str, *, will: Will | None = None
                      ) -> AsyncIterator[MqttLink]:
        import aiomqtt

        suffix = self.suffix

        def factory(*args: Any, **kwargs: Any) -> aiomqtt.Client:
            kwargs["identifier"] = f"{kwargs.get('identifier') or username}{suffix}"
            return aiomqtt.Client(*args, **kwargs)

        link = MqttLink(self.settings, username, will, client_factory=factory)
        await link.open()
        try:
            yield link
        finally:
            with contextlib.suppress(Exception):
                await link.close()
