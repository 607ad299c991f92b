"""What the coordinator and the site processes say to each other around secure aggregation.

Secure aggregation itself runs over ``transport`` (``transport.drivers``, one secagg round
per training round); these messages are the thin federation layer around it: who is online,
which round is open, which model it is about. They live on topics the transport's ACL
already grants (``transport.topics``), under a *federation name* used as the ``<round>``
level, so no broker configuration changes:

======================================  ============  ===========================================
topic                                   writer        carries
======================================  ============  ===========================================
``secagg/<fed>/control``                coordinator   :class:`Waiting`, :class:`Announce`,
                                                      :class:`Done` (retained), its last will
``secagg/<fed>-model/control``          coordinator   the round's blob (:mod:`fl.remote.blob`),
                                                      framed and chunked, once to every site
``secagg/<fed>-model/client/site-<id>/  coordinator   the blob again, to site <id> alone (its
blob``                                                :class:`Fetch`)
``secagg/<fed>/server/<kind>/site-<id>``  site <id>   :class:`Hello`, :class:`Fetch`,
                                                      :class:`Ready`, :class:`Decline`,
                                                      its last will
======================================  ============  ===========================================

The codec is transport's (:mod:`transport.fields`, shared with ``transport.control``): a
bounded msgpack map with a type tag ``t``, every field checked for type and range by the
same helpers on decoding; anything else raises :class:`WireError` (a
``transport.control.ControlError``), which the receiving loop logs and drops.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from secagg import SECURITY_MODES
from transport import HEADER_BYTES, ControlError, Topics, Will, check_round_name, fields, frame

from ..errors import FLError

VERSION = 1
MAX_CONTROL_BYTES = 1 << 20
"""Federation messages carry ids, names and hashes only (and, opt-in, one input vector)."""
MAX_BLOB_BYTES = 256 << 20
KINDS = ("train", "scaler")
PHASES = ("open", "go")
FETCH, HELLO, READY, DECLINE, OFFLINE = "fetch", "hello", "ready", "decline", "offline"
SITE_KINDS = (FETCH, HELLO, READY, DECLINE, OFFLINE)


class WireError(ControlError, FLError):
    """A federation payload that does not decode to a valid message (logged and dropped)."""


@dataclass(frozen=True)
class FedTopics:
    """The federation-level topics of ``federation`` (see the module docstring)."""

    federation: str

    def __post_init__(self) -> None:
        check_round_name(self.federation)
        check_round_name(self.federation + "-model")

    @property
    def fed(self) -> Topics:
        return Topics(self.federation)

    @property
    def control(self) -> str:
        return self.fed.control

    @property
    def model(self) -> str:
        return Topics(self.federation + "-model").control

    def model_to(self, site_id: int) -> str:
        """Where the coordinator answers site ``site_id``'s :class:`Fetch`: the blob to that
        site alone (a topic the transport's ACL lets only that site read)."""
        return Topics(self.federation + "-model").downstream(site_id, "blob")

    def model_filter(self, site_id: int) -> str:
        """What site ``site_id`` subscribes to for the answers to its fetches."""
        return Topics(self.federation + "-model").client_filter(site_id)

    def upstream(self, site_id: int, kind: str) -> str:
        return self.fed.upstream(site_id, kind)


# --------------------------------------------------------------------------- messages
@dataclass(frozen=True)
class Waiting:
    """The coordinator of run ``run`` is up and collecting :class:`Hello`s. Retained, so it
    replaces whatever an earlier run left on the control topic (a stale :class:`Done`)."""

    run: bytes


@dataclass(frozen=True)
class Announce:
    """Round ``round`` (attempt ``attempt``) of run ``run``.

    ``phase="open"``: the ``cohort`` fetches the blob (``blob`` = its SHA-256, ``size``
    bytes), computes its input and answers :class:`Ready`. ``phase="go"``: the secagg round
    ``name`` runs with ``roster`` (the ready sites) and ``threshold``; sites outside the
    roster sit it out. ``security``: the secagg mode of the round; ``"malicious"`` when the
    coordinator has the sites' public keys (``--peer-keys``, fl/site/identity.py), and a site with
    its own peer keys refuses any other.
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
    security: str = "semi-honest"

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
    """A site is online. ``features`` are its table's column names (never records, never its
    label values) so the coordinator can check that every site has the same columns."""

    site: int
    features: tuple[str, ...]
    run: bytes = b""


@dataclass(frozen=True)
class Fetch:
    """A site missed (part of) the broadcast of blob ``blob``: please send it again, to this
    site alone (:meth:`FedTopics.model_to`; :class:`fl.remote.blob.FetchPacer` says when a
    site asks)."""

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
class Decline:
    """The site refuses the announced round (its policy, or a task it cannot run); the
    coordinator stops waiting for it and reports why."""

    run: bytes
    round: int
    attempt: int
    kind: str
    reason: str = ""

    @property
    def key(self) -> tuple[bytes, int, int, str]:
        return (self.run, self.round, self.attempt, self.kind)


@dataclass(frozen=True)
class SiteOffline:
    """A site's last will (or its sign-off when it exits)."""

    reason: str = ""


CoordinatorMessage = Waiting | Announce | Done | CoordinatorOffline
SiteMessage = Hello | Fetch | Ready | Decline | SiteOffline
_TAGS: dict[type, str] = {Waiting: "waiting", Announce: "announce", Done: "done",
                          CoordinatorOffline: "coordinator-offline", Hello: HELLO,
                          Fetch: FETCH, Ready: READY, Decline: DECLINE,
                          SiteOffline: OFFLINE}


def pack(tag: str, body: Mapping[str, Any]) -> bytes:
    """A msgpack map with type tag ``t`` and version ``v`` (the blob uses it too)."""
    return fields.pack_map({**body, "t": tag, "v": VERSION})


def encode_message(message: CoordinatorMessage | SiteMessage) -> bytes:
    """The msgpack body of ``message`` (frame it with :func:`framed`)."""
    body = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(message).items()}
    return pack(_TAGS[type(message)], body)


def unpack(data: bytes, limit: int) -> dict[Any, Any]:
    body = fields.unpack_map(data, limit, error=WireError)
    if body.get("v") != VERSION:
        raise WireError(f"unsupported message version {body.get('v')!r} (this is {VERSION})")
    return body


get_int = partial(fields.integer, error=WireError)
get_bytes = partial(fields.raw, error=WireError)
get_str = partial(fields.text, error=WireError)
get_ids = partial(fields.site_ids, error=WireError)
get_names = partial(fields.names, error=WireError)


def _announce(body: Mapping[Any, Any]) -> Announce:
    name = get_str(body, "name", limit=64)
    try:
        check_round_name(name)
    except ValueError as exc:
        raise WireError(str(exc)) from None
    phase = get_str(body, "phase", PHASES)
    cohort, roster = get_ids(body, "cohort"), get_ids(body, "roster")
    threshold = get_int(body, "threshold", 0, fields.MAX_ROSTER)
    verify = body.get("verify")
    if not isinstance(verify, bool):
        raise WireError("field 'verify' must be a boolean")
    if not cohort:
        raise WireError("the cohort is empty")
    security = body.get("security", "semi-honest")
    if security not in SECURITY_MODES:
        raise WireError(f"field 'security' must be one of {SECURITY_MODES}")
    if phase == "go" and (not set(roster) <= set(cohort) or len(roster) < 2
                          or not len(roster) / 2 < threshold <= len(roster)):
        raise WireError(f"roster {list(roster)[:10]} / threshold {threshold} is not a valid "
                        "secagg roster for the cohort")
    return Announce(get_bytes(body, "run", (16,)), get_int(body, "round", 0, 1 << 31),
                    get_int(body, "attempt", 0, 1 << 16), get_str(body, "kind", KINDS), name,
                    cohort, get_bytes(body, "blob", (32,)),
                    get_int(body, "size", 1, MAX_BLOB_BYTES), phase, roster, threshold, verify,
                    security)


def decode_coordinator_message(data: bytes) -> CoordinatorMessage:
    """A message from the federation control topic; raises :class:`WireError`."""
    body = unpack(data, MAX_CONTROL_BYTES)
    kind = body.get("t")
    if kind == "waiting":
        return Waiting(get_bytes(body, "run", (16,)))
    if kind == "announce":
        return _announce(body)
    if kind == "done":
        return Done(get_bytes(body, "run", (16,)), get_int(body, "rounds", 0, 1 << 31),
                    get_str(body, "reason"))
    if kind == "coordinator-offline":
        return CoordinatorOffline(get_str(body, "reason"))
    raise WireError(f"unknown coordinator message {kind!r}")


def decode_site_message(data: bytes, topic_kind: str, sender: int,
                        max_input_bytes: int = 0) -> SiteMessage:
    """A message from site ``sender`` (the ACL-authenticated topic says who) on the upstream
    topic of ``topic_kind``; the payload must be of that kind and name the same site."""
    body = unpack(data, MAX_CONTROL_BYTES + max_input_bytes)
    kind = body.get("t")
    if kind != topic_kind:
        raise WireError(f"a {kind!r} message on the {topic_kind!r} topic")
    if kind == HELLO:
        site = get_int(body, "site", 1)
        if site != sender:
            raise WireError(f"site {sender} says hello as site {site}")
        return Hello(site, get_names(body, "features"), get_bytes(body, "run", (0, 16)))
    if kind == FETCH:
        return Fetch(get_bytes(body, "blob", (32,)))
    if kind == READY:
        raw = body.get("input")
        if raw is not None and (not isinstance(raw, bytes) or len(raw) % 8
                                or len(raw) > max_input_bytes):
            raise WireError("field 'input' must be a uint64 vector within the size limit")
        return Ready(get_bytes(body, "run", (16,)), get_int(body, "round", 0, 1 << 31),
                     get_int(body, "attempt", 0, 1 << 16), get_str(body, "kind", KINDS),
                     get_bytes(body, "blob", (32,)), raw)
    if kind == DECLINE:
        return Decline(get_bytes(body, "run", (16,)), get_int(body, "round", 0, 1 << 31),
                       get_int(body, "attempt", 0, 1 << 16), get_str(body, "kind", KINDS),
                       get_str(body, "reason"))
    if kind == OFFLINE:
        return SiteOffline(get_str(body, "reason"))
    raise WireError(f"unknown site message {kind!r}")


def framed(message: CoordinatorMessage | SiteMessage) -> bytes:
    """``message`` as one frame (retained messages must be one)."""
    body = encode_message(message)
    return frame(body, len(body) + HEADER_BYTES)[0]


def site_will(topics: FedTopics, site_id: int) -> Will:
    return Will(topics.upstream(site_id, OFFLINE), framed(SiteOffline("connection lost")))


def coordinator_will(topics: FedTopics) -> Will:
    return Will(topics.control, framed(CoordinatorOffline("the coordinator disconnected")))


def round_context(federation: str, announce: Announce) -> bytes:
    """The secagg ``context`` of a round: federation, run, round, attempt, kind and the
    SHA-256 of the blob. Each site computes it from the blob *it received*, so sites shown
    different models get different sessions and the round cannot mix them."""
    return b"|".join([b"secagg-fl/1", federation.encode(), announce.run.hex().encode(),
                      b"round=%d" % announce.round, b"attempt=%d" % announce.attempt,
                      announce.kind.encode(), b"blob=sha256:" + announce.blob.hex().encode()])
