"""Client side: a Flower mod that runs the user's own ``train`` under secure aggregation.

``ClientApp(mods=[secagg_mod])`` (or ``make_secagg_mod(NodeOptions(...))``) is the whole
change on a node. The node is one runtime of the site session (:mod:`fl.site.session`, over
the site core :mod:`fl.site.core`: the same policy, ledger, checks, replay and withdrawal
rules as ``secagg train --role site`` and the NVFlare site). For a train message that
carries a round setup (:mod:`fl.flower.setup`) the session checks the whole setup and the
layout of the arrays sent, has the core check the protocol margins and the policy and charge
the round to the node's ledger, and only then does the mod run the user's train function;
the session encodes the reply's arrays, metrics and weight, builds a ``secagg.Client`` and
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

import contextlib
import hashlib
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dp import MODE_DISTRIBUTED, MODE_NONE, SitePolicy
from fl.errors import FLError
from fl.flower.chunks import (
    CHUNK,
    MASKED,
    answer_digest,
    check_layout,
    to_records,
)
from fl.flower.encoding import (
    F64,
    U64,
    ReplyError,
    encode_reply,
    encoded_dim,
    flatten,
)
from fl.flower.guard import (
    ABORTED,
    GuardError,
    default_directory,
    hold,
    prune,
    record_name,
    remove_stale_nodes,
    snapshot_key,
)
from fl.flower.records import (
    PAYLOAD,
    PROOF,
    RECORD,
    SESSION,
    SETUP,
    STATE,
    secagg_record,
    stage_of,
)
from fl.flower.setup import RoundSetup, SetupError
from fl.round_reply import check_identity
from fl.site.core import SiteCore, open_site_core, state_directory
from fl.site.session import Joined, SiteSession
from secagg import Client, ProtocolAbort, SigningKey, Stage, encode
from secagg.messages import MaskedInput

log = logging.getLogger("fl.flower")


class RoundStateError(FLError, RuntimeError):
    """A secure-aggregation message arrived that this node has no round for (another
    session, a stale or finished round, or no setup yet); nothing was changed."""


CHARGE = "charge"
"""The round state's key of the round's ledger charge id (the session withdraws it when the
masked input never left)."""
POLICY_KEY = "secagg-policy"
"""Node config key: the path of this node's :class:`dp.policy.SitePolicy` JSON file."""
LEDGER_KEY = "secagg-ledger"
"""Node config key: the path of this node's privacy ledger (:class:`dp.ledger.Ledger`)."""
DP_KEY = "secagg-dp"
"""Node config key: the privacy modes this node takes part in, comma-separated (``none``:
exact sums, the operator's opt-in; ``distributed``), as ``--dp`` on ``secagg train --role
site``."""


@dataclass(frozen=True)
class NodeOptions:
    """What a Flower node runs with: the site core's policy and ledger (the same
    :class:`dp.policy.SitePolicy`, defaults and refusals as ``secagg train --role site``,
    :mod:`fl.site.core`), and what the Flower runtime adds (stage records, snapshot key,
    malicious-mode identity).

    ``policy``: the app's privacy policy, which only *tightens* the operator's (in a
    deployment the ClientApp's code arrives with the app bundle the server side submits, so
    only the node config is the hospital's own word: ``secagg-policy``, a policy JSON file;
    ``secagg-dp``, the modes it takes part in; :meth:`dp.policy.SitePolicy.tighten`);
    ``ledger``: the path of its write-ahead ledger (the node config's ``secagg-ledger``
    wins). Without the operator's word the policy is ``SitePolicy()`` (distributed DP only,
    with the default noise floor and budgets; exact sums need the operator's opt-in,
    ``secagg-dp="none"``) and the ledger is
    ``$XDG_STATE_HOME/secagg/ledger-flower-<sha256 of the node config>.json`` (default state
    home ``~/.local/state``; ``$SECAGG_FLOWER_DIR`` instead when set; in Flower's
    simulation engine, a folder of the run's own: :func:`ledger_directory`,
    :meth:`ledger_path`).

    ``snapshot_key``: a node secret that authenticates the round snapshot (HMAC, see
    ``secagg.resume``). Malicious mode: ``signing_key`` is this node's Ed25519 identity and
    ``trusted_keys`` the enrolled nodes' verification keys (distributed out of band). The
    node joins a malicious-mode round only if the setup gives it its own key and every
    other key is enrolled, so the server cannot slip in identities of its own; such a
    round's roster is authenticated and the ledger counts the other nodes' noise shares
    (otherwise only the node's own share, :func:`fl.site.core.lone_share`).

    ``stage_dir``: where the node records, per round, the last stage it answered and the
    round's snapshot key (:mod:`fl.flower.guard`; default
    ``<tmp>/secagg-flower-<uid>/node-<id>``; it must be private to the node's user, else
    the node refuses); ``keep_rounds``: how many of those records it keeps (the most
    recently used; each is 67 bytes; nodes sharing a ``stage_dir`` share the
    count). A pruned round can no longer be answered (its snapshot key is gone), and its
    charge is never withdrawn (whether its masked input left is no longer known), so keep
    more records than rounds the directory's nodes can have open at once."""

    policy: SitePolicy | None = None
    ledger: str | None = None
    snapshot_key: bytes = b""
    signing_key: SigningKey | None = None
    trusted_keys: frozenset[bytes] = frozenset()
    stage_dir: str | None = None
    keep_rounds: int = 1024

    def __post_init__(self) -> None:
        if isinstance(self.keep_rounds, bool) or not isinstance(self.keep_rounds, int) \
                or self.keep_rounds < 1:
            raise ValueError(f"NodeOptions.keep_rounds must be a positive integer (the stage "
                             f"records a node keeps), got {self.keep_rounds!r}")
        if self.policy is not None and not isinstance(self.policy, SitePolicy):
            raise TypeError(f"NodeOptions.policy must be a dp.policy.SitePolicy, got "
                            f"{type(self.policy).__name__}")

    def directory(self, context: Any) -> Path:
        """Where this node keeps its forward-only stage records (fl.flower.guard)."""
        return Path(self.stage_dir) if self.stage_dir else default_directory(context.node_id)

    def site_policy(self, context: Any) -> SitePolicy:
        """The node's policy: the operator's (the node config's ``secagg-policy`` file, else
        ``SitePolicy()``; ``secagg-dp`` names the modes it takes part in, e.g. ``none`` or
        ``none,distributed``), tightened by this object's ``policy`` (the app's: it arrives
        with the app bundle, so it can only narrow the operator's,
        :meth:`dp.policy.SitePolicy.tighten`)."""
        config = context.node_config
        path = config.get(POLICY_KEY)
        policy = (SitePolicy.load(_config_text(path, POLICY_KEY)) if path is not None
                  else SitePolicy())
        mode = config.get(DP_KEY)
        if mode is not None:
            modes = tuple(m.strip() for m in _config_text(mode, DP_KEY).split(","))
            policy = replace(policy, modes=modes)
        return policy.tighten(self.policy)

    def ledger_path(self, context: Any) -> str:
        """The node config's ``secagg-ledger``, else this object's ``ledger``, else the
        default: keyed by the node config without its ``secagg-`` keys (what the node's
        operator set, e.g. ``partition-id``), never by the node id, which the SuperLink
        assigns: a server that re-registers a node under a fresh id gets the same ledger.
        The default's folder: :func:`ledger_directory` (one per run in Flower's simulation
        engine, the node's own otherwise)."""
        path = context.node_config.get(LEDGER_KEY)
        if path is not None:
            return _config_text(path, LEDGER_KEY)
        if self.ledger is not None:
            return self.ledger
        own = sorted((str(k), repr(v)) for k, v in context.node_config.items()
                     if not str(k).startswith("secagg-"))
        digest = hashlib.sha256(json.dumps(own).encode()).hexdigest()[:24]
        return str(ledger_directory(context) / f"ledger-flower-{digest}.json")

    def open_core(self, context: Any) -> SiteCore:
        """The node's site core over its ledger (locked until :meth:`SiteCore.close`)."""
        policy, path = self.site_policy(context), self.ledger_path(context)
        if (path, policy) not in _ANNOUNCED:  # once per process: the node's start-up line
            _ANNOUNCED.add((path, policy))
            log.warning("node %s: %s; ledger %s", context.node_id, policy.describe(), path)
        return open_site_core(policy=policy, ledger_path=path,
                              log=lambda text: log.info("node %s: %s", context.node_id, text))

    def session(self, context: Any) -> SiteSession:
        """The node's site session (:mod:`fl.site.session`) over its core and identity."""
        return SiteSession(lambda: self.open_core(context), runtime="flower",
                           signing_key=self.signing_key, trusted_keys=self.trusted_keys,
                           log=lambda text: log.info("node %s: %s", context.node_id, text))


DIR_ENV = "SECAGG_FLOWER_DIR"
"""Environment variable: the folder of the nodes' default ledgers, set by the node's
operator (the SuperNode's environment); set, it is used in a simulation too."""


def ledger_directory(context: Any) -> Path:
    """The folder of a node's default ledger: ``$SECAGG_FLOWER_DIR`` when the operator set
    it; else, when Flower's simulation engine runs the ClientApp
    (:func:`simulation_run_id`), the run's own folder ``$XDG_STATE_HOME/secagg/flower-runs/
    run-<run id>`` (a simulation draws a fresh run id), so one simulation does not spend
    another's budget; else (a SuperNode) ``$XDG_STATE_HOME/secagg``, which persists across
    apps and runs: the node's patients are the same whatever app asks."""
    explicit = os.environ.get(DIR_ENV)
    run = None if explicit else simulation_run_id(context)
    if explicit:
        folder = Path(explicit)
    elif run is None:
        return state_directory()
    else:
        folder = state_directory() / "flower-runs" / f"run-{run}"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder


def simulation_run_id(context: Any) -> int | None:
    """``context.run_id`` when Flower's simulation engine runs this ClientApp (its Ray
    actor, ``flwr.simulation.ray_transport.ray_actor.VirtualClientEngineActor.run``, is on
    the call stack: the runtime that runs the app, not the app or its server, says so),
    else None (a SuperNode, or an in-process grid that stands for one)."""
    actor = sys.modules.get("flwr.simulation.ray_transport.ray_actor")
    engine = getattr(getattr(actor, "VirtualClientEngineActor", None), "run", None)
    code = getattr(engine, "__code__", None)
    if code is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return int(context.run_id)
        frame = frame.f_back  # type: ignore[assignment]
    return None


_ANNOUNCED: set[tuple[str, SitePolicy]] = set()
"""The (ledger, policy) pairs whose policy line this process logged."""


def _config_text(value: object, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise SetupError(f"node config {key!r} must be a non-empty string, got {value!r}")
    return value


Mod = Callable[[Any, Any, Callable[[Any, Any], Any]], Any]


def make_secagg_mod(options: NodeOptions | Callable[[Any], NodeOptions] | None = None) -> Mod:
    """A Flower mod with this node's :class:`NodeOptions` (policy, ledger, identity), or a
    function of the node's ``Context`` that returns them (e.g. loading the node's signing
    key from a path in ``context.node_config``)."""

    def secagg_mod(msg: Any, context: Any, call_next: Callable[[Any, Any], Any]) -> Any:
        if msg.metadata.message_type.split(".")[0] != "train":
            return call_next(msg, context)
        record = secagg_record(msg)
        if record is None:  # a plain train message would return the raw update
            raise RoundStateError("a train message without a secure-aggregation setup: this "
                                  "node sends its update only through secure aggregation "
                                  "(wrap the server's strategy in SecureAggregation)")
        node = (options if isinstance(options, NodeOptions)
                else NodeOptions() if options is None else options(context))
        if SETUP in record:
            return _start(msg, context, record, node)
        return _continue(msg, context, call_next, record, node)

    return secagg_mod


secagg_mod = make_secagg_mod()
"""The mod with the default :class:`NodeOptions`: ``ClientApp(mods=[secagg_mod])``."""


def _reply(msg: Any, session: bytes, payload: bytes, masked: Any = None,
           proof: bytes | None = None) -> Any:
    from flwr.app import ConfigRecord, Message, RecordDict

    fields: dict[str, Any] = {SESSION: session, PAYLOAD: payload}
    if proof is not None:
        fields[PROOF] = proof
    content = RecordDict({RECORD: ConfigRecord(fields)})
    if masked is not None:
        content[MASKED] = masked
    return Message(content, reply_to=msg)


def _single(records: Any, what: str) -> Any:
    if len(records) != 1:
        raise ReplyError(f"the train reply must carry exactly one {what}, it has "
                         f"{len(records)}")
    return next(iter(records.values()))


def _number(record: Any, key: str) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReplyError(f"the reply's metric {key!r} must be one number, got a "
                         f"{type(value).__name__}")
    return float(value)


def _start(msg: Any, context: Any, record: Any, options: NodeOptions) -> Any:
    """Join a round through the site session (:mod:`fl.site.session`): the whole setup is
    checked and the round charged to the node's ledger (a refused round never trains); an
    unfinished earlier round is abandoned. The node advertises a client without its input:
    it trains at the masked-input request (:func:`_train`), so nothing model-sized waits in
    its ``Context`` between messages."""
    session = options.session(context)
    directory = options.directory(context)
    saved = context.state.config_records.get(STATE)
    joined = session.join(record.get(SETUP), run_id=msg.metadata.run_id,
                          node_id=msg.metadata.dst_node_id, sent=None,
                          previous=None if saved is None else _previous(saved, directory,
                                                                        msg),
                          erase=lambda: _erase(context, saved, directory, msg))
    context.state.config_records.pop(STATE, None)  # an unfinished earlier round is gone
    client, advertisement = session.advertise(joined, None)
    with hold(directory, client.session_id, joined.client_id) as stage_record:
        stage_record.join_round(int(client.stage), advertisement)
        _save(context, joined.setup, client, snapshot_key(stage_record, options.snapshot_key),
              joined.charge)
    prune(directory, options.keep_rounds, record_name(client.session_id, joined.client_id))
    if options.stage_dir is None:  # the default base: other runs' node directories too
        remove_stale_nodes(directory.parent, directory)
    return _reply(msg, client.session_id, advertisement)


def _previous(saved: Any, directory: Path, msg: Any) -> tuple[int, int | None] | None:
    """The unfinished round in the node's state: its charge and the last stage the node
    answered in it (from its stage record), for the session to abandon."""
    charge = saved.get(CHARGE)
    if not isinstance(charge, int):
        return None
    try:
        setup = RoundSetup.from_bytes(saved.get(SETUP))
        with hold(directory, saved.get(SESSION), setup.client_id(
                msg.metadata.dst_node_id)) as stage_record:
            stage = stage_record.stage
    except (SetupError, GuardError, TypeError):
        return None  # no trustworthy record of it: the charge stays (conservative)
    if stage is None or stage == ABORTED:
        # None: the record is gone (pruned by other runs' rounds, NodeOptions.keep_rounds)
        # although the node advertised (the record is written before the state is saved),
        # so whether its masked input left is unknown; ABORTED: the abort itself already
        # withdrew the charge if the masked input never existed. The charge stays.
        return None
    return charge, stage


def _erase(context: Any, saved: Any, directory: Path, msg: Any) -> None:
    """Forget the unfinished round the session abandons: out of the node's state, and its
    stage record marked aborted (``_continue`` refuses an aborted round), since Flower need
    not save the Context of a message whose mod raised (the new setup may be refused)."""
    context.state.config_records.pop(STATE, None)
    with contextlib.suppress(SetupError, GuardError, TypeError):
        setup = RoundSetup.from_bytes(saved.get(SETUP))
        with hold(directory, saved.get(SESSION), setup.client_id(
                msg.metadata.dst_node_id)) as stage_record:
            if stage_record.stage is not None:  # a pruned record is not written again
                stage_record.abort()


def _continue(msg: Any, context: Any, call_next: Callable[[Any, Any], Any], record: Any,
              options: NodeOptions) -> Any:
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
    with hold(options.directory(context), session, client_id) as stage_record:
        if stage_record.stage == ABORTED:
            raise GuardError("this node aborted the round; it answers nothing more in it")
        key = snapshot_key(stage_record, options.snapshot_key)
        session_site = options.session(context)
        identity = check_identity(setup, client_id, options.signing_key,
                                  options.trusted_keys)
        client = Client.restore(
            saved.get("snapshot"), config=setup.config(encoded_dim(setup)),
            client_id=client_id, context=setup.context(),
            roster=range(1, setup.num_clients + 1), key=key,
            min_stage=None if stage_record.stage is None else Stage(stage_record.stage),
            **identity)
        if client.stage == Stage.SHARE_KEYS and stage_of(msg) == "masked_input":
            joined = Joined(session, int(saved.get(CHARGE)), setup, client_id, client.config,
                            None, identity)
            trained = _train(msg, context, call_next, session_site, joined, client,
                             stage_record)
            if trained is not None:
                return trained  # the node's own training failed: its charge stays
        try:
            proof, message = session_site.answer_with_proof(client, payload,
                                                            int(saved.get(CHARGE)))
        except ProtocolAbort as exc:
            # returned, not raised: Flower saves the Context (the round's secrets are gone)
            stage_record.abort()
            context.state.config_records.pop(STATE, None)
            return _error(msg, f"ProtocolAbort: {exc}")
        if isinstance(message, MaskedInput):  # chunked, in its natural width
            # the chunk length the server asked for, checked before anything is answered
            out, arrays = to_records(message, check_layout(record.get(CHUNK), message.bits,
                                                           message.dim))
            stage_record.answer(int(client.stage), answer_digest(message))
        else:
            out, arrays = encode(message), None
            stage_record.answer(int(client.stage), out)
        if client.done:
            context.state.config_records.pop(STATE, None)
        else:
            _save(context, setup, client, key, int(saved.get(CHARGE)))
    return _reply(msg, client.session_id, out, arrays, proof)


def _train(msg: Any, context: Any, call_next: Callable[[Any, Any], Any],
           session: SiteSession, joined: Joined, client: Client, stage_record: Any
           ) -> Any | None:
    """At the masked-input request: check the arrays it carries against the setup, run the
    user's training on them and give the client its encoded input; None when it has it, or
    the training's own error reply. The round was charged at its setup, before this. A
    layout refusal ends the round with its charge withdrawn (nothing of the node's data was
    computed); a failed training ends it with its charge kept (the failure may depend on
    the data). Either way the round answers nothing more."""
    setup = joined.setup
    try:
        sent: F64 | None = session.check_sent(setup, lambda s: flatten(
            _single(msg.content.array_records, "ArrayRecord"), s.arrays))
        if setup.mode != MODE_DISTRIBUTED:
            sent = None  # only checked: not held through the training
    except SetupError:
        _end(context, stage_record)
        session.end(joined, client, "the arrays sent with the masked-input request do not "
                    "match the round setup")
        raise
    del msg.content.config_records[RECORD]  # the user's train sees its own message only
    try:
        reply = call_next(msg, context)
        if reply.has_error():
            _end(context, stage_record)
            return reply
        arrays, metrics, weight = _trained(setup, reply.content)
        # neither the reply's arrays nor the arrays sent are needed to encode (the flat
        # copies are): let them go before the encoding's working copies exist
        _let_go(reply.content)
        _let_go(msg.content)
        del reply
        client.provide_input(session.encode(replace(joined, sent=sent), arrays, metrics,
                                            weight))
    except Exception:
        _end(context, stage_record)
        raise
    return None


def _let_go(content: Any) -> None:
    """Empty a message's array records: Flower's records sit in reference cycles, so a
    model-sized array they hold would otherwise live until Python's cycle collector runs."""
    for key, record in list(content.array_records.items()):
        for name in list(record):
            del record[name]
        del content[key]


def _end(context: Any, stage_record: Any) -> None:
    """The round ends on this node before its masked input existed: nothing more is
    answered in it (its stage record says aborted), its state is dropped."""
    stage_record.abort()
    context.state.config_records.pop(STATE, None)


def _error(msg: Any, reason: str) -> Any:
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode

    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                   reply_to=msg)


def _save(context: Any, setup: RoundSetup, client: Client, key: bytes, charge: int) -> None:
    from flwr.app import ConfigRecord

    context.state.config_records[STATE] = ConfigRecord({
        SETUP: setup.to_bytes(), SESSION: client.session_id,
        "snapshot": client.snapshot(key), CHARGE: charge})


def _trained(setup: RoundSetup, content: Any) -> tuple[F64, dict[str, float], float]:
    """The arrays, averaged metrics and weight of a node's train reply."""
    arrays = flatten(_single(content.array_records, "ArrayRecord"), setup.arrays)
    metrics: dict[str, float] = {}
    weight = 0.0
    if setup.mode == MODE_NONE:
        metric_record = _single(content.metric_records, "MetricRecord")
        metrics = {name: _number(metric_record, name) for name in setup.metrics}
        weight = _number(metric_record, setup.weight_key)
    return arrays, metrics, weight


def reply_vector(setup: RoundSetup, content: Any, sent: F64 | None) -> U64:
    """The secagg input of a node from its train reply's content (``sent``: the flattened
    arrays the server sent, for mode ``distributed``). Deterministic for mode ``none``, so a
    test can compute the plaintext sum the round must equal."""
    return encode_reply(setup, *_trained(setup, content), sent)
