"""Client side: a Flower mod that runs the user's own ``train`` under secure aggregation.

``ClientApp(mods=[secagg_mod])`` (or ``make_secagg_mod(...)`` for a node policy) is the
whole change on a node. For a train message that carries a round setup
(:mod:`fl.flower.setup`) the mod runs the user's train function, encodes the reply's
arrays, metrics and weight (:mod:`fl.flower.encoding`), builds a ``secagg.Client`` and
answers with its public key advertisement only. Every later message of the round goes to
the same client, rebuilt from its snapshot in the node's ``Context.state`` (Flower builds a
ClientApp per message). The snapshot holds the round's secrets; ``Context.state`` never
leaves the node, and no reply carries anything but secagg wire bytes.

The snapshot is bound to the round: it is stored with the round's setup (run id, server
round, fresh nonce, roster) and session id, a message naming another session is refused
before the snapshot is touched, and ``Client.restore`` refuses a snapshot of another
session or client (``secagg.StaleSnapshot``). A new round's setup replaces (and so erases)
an unfinished earlier round's state; a finished or aborted round's state is deleted.

Every refusal raises a typed error; Flower turns it into an error reply, which the server
wrapper counts as this node dropping out at that stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fl.flower.encoding import F64, U64, ReplyError, encode_reply, encoded_dim, flatten
from fl.flower.guard import (
    ABORTED,
    GuardError,
    default_directory,
    hold,
    prune,
    record_name,
    snapshot_key,
)
from fl.flower.records import PAYLOAD, RECORD, SESSION, SETUP, STATE, secagg_record
from fl.flower.setup import RoundSetup, SetupError
from secagg import Client, ProtocolAbort, SigningKey, Stage, encode

from ..errors import FLError


class RoundStateError(FLError, RuntimeError):
    """A secure-aggregation message arrived that this node has no round for (another
    session, a stale or finished round, or no setup yet); nothing was changed."""


@dataclass(frozen=True)
class NodePolicy:
    """What a node accepts from the server (docs/architecture.md section 9: the site is
    sovereign). ``min_clients``: the smallest roster it joins; ``require_dp``: refuse
    rounds without distributed DP; ``min_noise_stddev``: the smallest per-node noise
    standard deviation (in the update's units) it adds; ``snapshot_key``: a node secret
    that authenticates the round snapshot (HMAC, see ``secagg.resume``).

    Malicious mode: ``signing_key`` is this node's Ed25519 identity and ``trusted_keys``
    the enrolled nodes' verification keys (distributed out of band). The node joins a
    malicious-mode round only if the setup gives it its own key and every other key is
    enrolled, so the server cannot slip in identities of its own.

    ``stage_dir``: where the node records, per round, the last stage it answered and the
    round's snapshot key (:mod:`fl.flower.guard`; default
    ``<tmp>/secagg-flower-<uid>/node-<id>``; it must be private to the node's user, else
    the node refuses); ``keep_rounds``: how many of those records it keeps (the most
    recently used; each is 67 bytes; nodes sharing a ``stage_dir`` share the
    count). A pruned round can no longer be answered (its snapshot key is gone), so keep
    more records than rounds the directory's nodes can have open at once."""

    min_clients: int = 2
    require_dp: bool = False
    min_noise_stddev: float = 0.0
    snapshot_key: bytes = b""
    signing_key: SigningKey | None = None
    trusted_keys: frozenset[bytes] = frozenset()
    stage_dir: str | None = None
    keep_rounds: int = 1024

    def __post_init__(self) -> None:
        if isinstance(self.keep_rounds, bool) or not isinstance(self.keep_rounds, int) \
                or self.keep_rounds < 1:
            raise ValueError(f"NodePolicy.keep_rounds must be a positive integer (the stage "
                             f"records a node keeps), got {self.keep_rounds!r}")

    def directory(self, context: Any) -> Path:
        """Where this node keeps its forward-only stage records (fl.flower.guard)."""
        return Path(self.stage_dir) if self.stage_dir else default_directory(context.node_id)

    def check(self, setup: RoundSetup, client_id: int | None = None) -> None:
        if setup.num_clients < self.min_clients:
            raise SetupError(f"the round has {setup.num_clients} nodes; this node joins "
                             f"rounds of at least {self.min_clients}")
        if self.require_dp and setup.encoding != "ddp":
            raise SetupError("this node only joins rounds with distributed DP")
        if setup.dp is not None and setup.dp.noise_stddev < self.min_noise_stddev:
            raise SetupError(f"the round asks for noise stddev {setup.dp.noise_stddev:.4g}; "
                             f"this node adds at least {self.min_noise_stddev:.4g}")
        if setup.security == "malicious" and client_id is not None:
            if self.signing_key is None:
                raise SetupError("a malicious-mode round needs this node's signing key: "
                                 "give NodePolicy(signing_key=..., trusted_keys=...)")
            if setup.verify_keys[client_id - 1] != self.signing_key.public:
                raise SetupError("the setup gives this node a verify key that is not its own")
            strangers = [i + 1 for i, key in enumerate(setup.verify_keys)
                         if key not in self.trusted_keys]
            if strangers:
                raise SetupError(f"the setup names verify keys that are not enrolled "
                                 f"(roster positions {strangers[:10]}); refused")

    def identity(self, setup: RoundSetup) -> dict[str, Any]:
        """The keyword arguments secagg.Client needs for this round's security mode."""
        if setup.security != "malicious":
            return {}
        return {"signing_key": self.signing_key, "verify_keys": setup.peer_keys()}


Mod = Callable[[Any, Any, Callable[[Any, Any], Any]], Any]


def make_secagg_mod(policy: NodePolicy | Callable[[Any], NodePolicy] | None = None) -> Mod:
    """A Flower mod with this node's policy (see :class:`NodePolicy`), or a function of the
    node's ``Context`` that returns it (e.g. loading the node's signing key from a path in
    ``context.node_config``)."""

    def secagg_mod(msg: Any, context: Any, call_next: Callable[[Any, Any], Any]) -> Any:
        if msg.metadata.message_type.split(".")[0] != "train":
            return call_next(msg, context)
        record = secagg_record(msg)
        if record is None:
            return call_next(msg, context)
        node_policy = (policy if isinstance(policy, NodePolicy)
                       else NodePolicy() if policy is None else policy(context))
        if SETUP in record:
            return _start(msg, context, call_next, record, node_policy)
        return _continue(msg, context, record, node_policy)

    return secagg_mod


secagg_mod = make_secagg_mod()
"""The mod with the default :class:`NodePolicy`: ``ClientApp(mods=[secagg_mod])``."""


def _reply(msg: Any, session: bytes, payload: bytes) -> Any:
    from flwr.app import ConfigRecord, Message, RecordDict

    return Message(RecordDict({RECORD: ConfigRecord({SESSION: session, PAYLOAD: payload})}),
                   reply_to=msg)


def _single(records: Any, what: str) -> Any:
    if len(records) != 1:
        raise ReplyError(f"the train reply must carry exactly one {what}, it has "
                         f"{len(records)}")
    return next(iter(records.values()))


def _number(record: Any, key: str) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReplyError(f"the reply's metric {key!r} must be one number, got {value!r}")
    return float(value)


def _start(msg: Any, context: Any, call_next: Callable[[Any, Any], Any], record: Any,
           policy: NodePolicy) -> Any:
    setup = RoundSetup.from_bytes(record.get(SETUP))
    if setup.run_id != msg.metadata.run_id:
        raise SetupError(f"the setup names run {setup.run_id}; this message belongs to run "
                         f"{msg.metadata.run_id}")
    client_id = setup.client_id(msg.metadata.dst_node_id)
    policy.check(setup, client_id)
    config = setup.config(encoded_dim(setup))
    context.state.config_records.pop(STATE, None)  # an unfinished earlier round is gone
    sent = None
    if setup.encoding == "ddp":
        sent = flatten(_single(msg.content.array_records, "ArrayRecord"), setup.arrays)
    del msg.content.config_records[RECORD]  # the user's train sees its own message only
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    client = Client(config, client_id, reply_vector(setup, reply.content, sent),
                    roster=range(1, setup.num_clients + 1), context=setup.context(),
                    nonce=setup.nonce, **policy.identity(setup))
    advertisement = encode(client.advertise())
    directory = policy.directory(context)
    with hold(directory, client.session_id, client_id) as record:
        record.join_round(int(client.stage), advertisement)
        _save(context, setup, client, snapshot_key(record, policy.snapshot_key))
    prune(directory, policy.keep_rounds, record_name(client.session_id, client_id))
    return _reply(msg, client.session_id, advertisement)


def _continue(msg: Any, context: Any, record: Any, policy: NodePolicy) -> Any:
    saved = context.state.config_records.get(STATE)
    if saved is None:
        raise RoundStateError("no secure-aggregation round is in progress on this node "
                              "(it never received this round's setup, or the round ended)")
    session = record.get(SESSION)
    if not isinstance(session, bytes) or session != saved.get(SESSION):
        raise RoundStateError("the message belongs to another secure-aggregation session "
                              "than the round in progress on this node; refused")
    payload = record.get(PAYLOAD)
    if not isinstance(payload, bytes):
        raise RoundStateError("the message carries no secure-aggregation payload")
    setup = RoundSetup.from_bytes(saved.get(SETUP))
    if setup.run_id != msg.metadata.run_id:
        raise RoundStateError("the round in progress belongs to another run")
    client_id = setup.client_id(msg.metadata.dst_node_id)
    with hold(policy.directory(context), session, client_id) as stage_record:
        if stage_record.stage == ABORTED:
            raise GuardError("this node aborted the round; it answers nothing more in it")
        key = snapshot_key(stage_record, policy.snapshot_key)
        client = Client.restore(
            saved.get("snapshot"), config=setup.config(encoded_dim(setup)),
            client_id=client_id, context=setup.context(),
            roster=range(1, setup.num_clients + 1), key=key,
            min_stage=None if stage_record.stage is None else Stage(stage_record.stage),
            **policy.identity(setup))
        try:
            out = encode(client.handle(payload))
        except ProtocolAbort as exc:
            # returned, not raised: Flower saves the Context (the round's secrets are gone)
            stage_record.abort()
            context.state.config_records.pop(STATE, None)
            return _error(msg, f"ProtocolAbort: {exc}")
        stage_record.answer(int(client.stage), out)
        if client.done:
            context.state.config_records.pop(STATE, None)
        else:
            _save(context, setup, client, key)
    return _reply(msg, client.session_id, out)


def _error(msg: Any, reason: str) -> Any:
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode

    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                   reply_to=msg)


def _save(context: Any, setup: RoundSetup, client: Client, key: bytes) -> None:
    from flwr.app import ConfigRecord

    context.state.config_records[STATE] = ConfigRecord({
        SETUP: setup.to_bytes(), SESSION: client.session_id,
        "snapshot": client.snapshot(key)})


def reply_vector(setup: RoundSetup, content: Any, sent: F64 | None) -> U64:
    """The secagg input of a node from its train reply's content (``sent``: the flattened
    arrays the server sent, for ``ddp``). Deterministic for ``fixed``, so a test can
    compute the plaintext sum the round must equal."""
    arrays = flatten(_single(content.array_records, "ArrayRecord"), setup.arrays)
    metrics: dict[str, float] = {}
    weight = 0.0
    if setup.encoding == "fixed":
        metric_record = _single(content.metric_records, "MetricRecord")
        metrics = {name: _number(metric_record, name) for name in setup.metrics}
        weight = _number(metric_record, setup.weight_key)
    return encode_reply(setup, arrays, metrics, weight, sent)
