"""One secure-aggregation round driven through a Flower ``Grid``: the stage loop.

The first stage's messages carry the round setup only; every later stage sends each node
the ``secagg.Server``'s message for it, and the masked-input request also carries the
strategy's own train message content (the arrays and config the node trains from: the node
trains then, as in Flower's SecAgg+, so it keeps nothing model-sized between messages). A
stage closes when every node it was sent to answered or the stage timeout passed
(``Grid.send_and_receive`` returns what arrived); an error reply, a missing reply and a
reply the server rejects all count as that node dropping out at that stage, exactly as the
protocol allows. The round aborts (``ProtocolAbort``) only when the protocol cannot finish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from fl.flower.chunks import CHUNK, DEFAULT_CHUNK_BYTES, ChunkError, assemble, chunk_elements
from fl.flower.records import PAYLOAD, PROOF, RECORD, SESSION, SETUP, payload_of, secagg_record
from fl.flower.setup import RoundSetup
from secagg import Config, InputRefused, ProtocolAbort, ProtocolError, Server, Stage, encode
from transport import validation_allowance

log = logging.getLogger("fl.flower")
U64 = npt.NDArray[np.uint64]


@dataclass
class RoundReport:
    """What one secure round did, by Flower node id.

    ``included``: nodes whose input is in the sum; ``dropped``: node -> the stage it
    dropped in; ``total``: the modular sum secagg output (None if the round aborted);
    ``seconds``: wall time per stage; ``bytes_up`` / ``bytes_down``: secagg payload bytes
    each node sent / was sent (the train message's own arrays are not counted);
    ``server_cpu``: the server process's CPU seconds spent in the secagg state machine;
    ``epsilon``: the privacy budget spent after this round (distributed DP with a budget);
    ``rejected``: the secagg server's rejections (client id -> reason, mapped to node ids);
    ``chunk_rejected``: masked inputs whose chunks did not have the round's layout (node,
    reason; :mod:`fl.flower.chunks`), each a dropout at masked_input; ``input_refused``:
    input validation (``norm_bound``, docs/protocol.md 10): node -> why its proof failed
    (left out of the sum and named; an honest node never is).
    """

    setup: RoundSetup
    included: frozenset[int] = frozenset()
    dropped: dict[int, str] = field(default_factory=dict)
    total: U64 | None = None
    aborted: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    bytes_up: dict[int, int] = field(default_factory=dict)
    bytes_down: dict[int, int] = field(default_factory=dict)
    server_cpu: float = 0.0
    epsilon: float | None = None
    rejected: list[tuple[int, str]] = field(default_factory=list)
    chunk_rejected: list[tuple[int, str]] = field(default_factory=list)
    node_epsilon: float | None = None
    """Distributed DP: the epsilon each node's ledger holds after this run's rounds whose
    masked inputs may have left the nodes, released or not (its own noise share unless the
    roster is authenticated, the replace-one sensitivity of its one row:
    :func:`fl.round_reply.charged_event`); with a budget the server plans and
    spends that same figure, so ``epsilon`` equals it."""
    input_refused: dict[int, str] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)
    """Nodes whose error reply named a reason (node -> the reason, e.g. ``refused by site
    policy [exact-release]: ...``; the server names the rule and the fix)."""

    @property
    def server_round(self) -> int:
        return self.setup.server_round


def proof_allowance(config: Config) -> float:
    """Seconds the masked_input stage adds for input validation (each node's proof and the
    server's n verifications: the cost model's :func:`transport.validation_allowance`); 0
    without ``norm_bound``."""
    if config.norm_bound is None:
        return 0.0
    return validation_allowance(clients=config.num_clients, dim=config.dim)


def _content(payload: bytes, session: bytes, chunk: int | None = None) -> Any:
    from flwr.app import ConfigRecord, RecordDict

    fields: dict[str, Any] = {SESSION: session, PAYLOAD: payload}
    if chunk is not None:
        fields[CHUNK] = chunk
    return RecordDict({RECORD: ConfigRecord(fields)})


def _one_by_one(replies: list[Any]) -> Iterator[Any]:
    """The replies in order, each taken out of ``replies`` as it is handed out (so nothing
    else keeps it once its handler lets it go)."""
    replies.reverse()
    while replies:
        yield replies.pop()


class RoundDriver:
    """Runs the stages of one round; ``run`` returns the report (``total`` set on success)."""

    def __init__(self, grid: Any, setup: RoundSetup, server: Server, message_type: str,
                 timeout: float | None, *, train_timeout: float | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        """``timeout``: each stage but masked_input; ``train_timeout``: masked_input
        (the nodes train in it; default ``timeout``); ``chunk_bytes``: the bytes of one chunk
        of a node's masked input (:mod:`fl.flower.chunks`)."""
        self.grid = grid
        self.setup = setup
        self.server = server
        self.message_type = message_type
        self.timeout = timeout
        self.train_timeout = timeout if train_timeout is None else train_timeout
        self.report = RoundReport(setup)
        self.chunk = chunk_elements(chunk_bytes, server.config.bits, server.config.dim)
        self._cpu = 0.0
        self._train: dict[int, Any] = {}  # node -> the strategy's train content

    def run(self, first: Iterable[Any]) -> RoundReport:
        from flwr.app import ConfigRecord, Message, RecordDict

        report = self.report
        setup_bytes = self.setup.to_bytes()
        outgoing = []
        for message in first:
            # the strategy's own content (the arrays to train from, its config) goes with the
            # masked-input request, where the node trains (Flower's SecAgg+ does the same)
            self._train[message.metadata.dst_node_id] = message.content
            content = RecordDict({RECORD: ConfigRecord({SETUP: setup_bytes})})
            outgoing.append(Message(content=content, dst_node_id=message.metadata.dst_node_id,
                                    message_type=self.message_type,
                                    group_id=str(self.setup.server_round),
                                    ttl=message.metadata.ttl))
            report.bytes_down[message.metadata.dst_node_id] = len(setup_bytes)
        try:
            self._exchange(Stage.ADVERTISE_KEYS, outgoing)
            while True:
                started = time.process_time()
                to_send = self.server.advance()
                self._cpu += time.process_time() - started
                if self.server.finished:
                    break
                self._exchange(self.server.stage, self._messages(to_send))
        except ProtocolAbort as exc:
            report.aborted = str(exc)
            log.warning("secure aggregation round %d aborted: %s", self.setup.server_round, exc)
        result = self.server.result
        report.dropped = {self.setup.node_of(cid): st.label
                          for cid, st in self.server.dropped.items()}
        report.rejected = [(self.setup.node_of(cid) if 0 < cid <= self.setup.num_clients
                            else cid, reason) for cid, reason in self.server.rejected]
        report.input_refused = {self.setup.node_of(cid): reason
                                 for cid, reason in self.server.refused.items()}
        report.server_cpu = self._cpu
        if result is not None and report.aborted is None:
            report.total = result.total
            report.included = frozenset(self.setup.node_of(c) for c in result.included)
        return report

    def _messages(self, to_send: Mapping[int, Any]) -> list[Any]:
        from flwr.app import Message

        session = self.server.session_id
        train = self.server.stage == Stage.MASKED_INPUT
        chunk = self.chunk if train else None
        out = []
        for cid, message in sorted(to_send.items()):
            node = self.setup.node_of(cid)
            payload = encode(message)
            self.report.bytes_down[node] = self.report.bytes_down.get(node, 0) + len(payload)
            content = _content(payload, session, chunk)
            if train:  # the node trains now: the strategy's arrays and config come along
                for key, value in self._train.pop(node).items():
                    content[key] = value
            out.append(Message(content=content, dst_node_id=node,
                               message_type=self.message_type,
                               group_id=str(self.setup.server_round)))
        return out

    def _exchange(self, stage: Stage, outgoing: list[Any]) -> None:
        started = time.perf_counter()
        # the nodes train at the masked-input request: that stage waits for train_timeout
        timeout = self.train_timeout if stage == Stage.MASKED_INPUT else self.timeout
        if stage == Stage.MASKED_INPUT and timeout is not None:
            timeout += proof_allowance(self.server.config)
        sent_to = {m.metadata.dst_node_id for m in outgoing}
        cpu = 0.0
        for reply in self._replies(outgoing, timeout):  # each let go once handled
            started_cpu = time.process_time()
            self._handle(stage, reply, sent_to)
            del reply
            cpu += time.process_time() - started_cpu
        self._cpu += cpu
        self.report.seconds[stage.label] = time.perf_counter() - started

    def _replies(self, outgoing: list[Any], timeout: float | None) -> Iterator[Any]:
        """The stage's replies as they arrive (push, then pull until every node answered or
        the timeout passed, as ``Grid.send_and_receive`` does), so a node's masked input is
        checked and summed while others are still on their way and the server never holds
        every reply of a stage because it waited for the last; a grid without push and
        pull (``fl.flower.local.LocalGrid``) answers them all at once."""
        try:
            pending = set(self.grid.push_messages(outgoing))
        except NotImplementedError:
            yield from _one_by_one(list(self.grid.send_and_receive(outgoing, timeout=timeout)))
            return
        del outgoing
        end = time.time() + (timeout if timeout is not None else 0.0)
        interval = float(getattr(self.grid, "pull_interval", 3.0))  # Flower's HTTP grid: 3 s
        while timeout is None or time.time() < end:
            replies = list(self.grid.pull_messages(pending))
            pending.difference_update(r.metadata.reply_to_message_id for r in replies)
            yield from _one_by_one(replies)
            if not pending:
                return
            time.sleep(interval)

    def _handle(self, stage: Stage, reply: Any, sent_to: set[int]) -> None:
        """Check one node's reply and hand it to the secagg server (a rejection is logged:
        that node drops out at this stage)."""
        node = reply.metadata.src_node_id
        if node not in sent_to:
            return
        cid = self.setup.client_id(node)
        if reply.has_error():
            log.info("node %d dropped in %s: %s", node, stage.label, reply.error.reason)
            self.report.refused[node] = str(reply.error.reason)[:1000]
            return
        try:
            payload = payload_of(reply)
            message: Any = payload
            if stage == Stage.MASKED_INPUT:
                if not self._proof(cid, node, reply):
                    return  # refused (named in the report): its masked input never counts
                message = assemble(reply.content, payload, self.server.config.dim,
                                   self.server.config.bits, self.chunk)
                size = len(payload) + len(message.masked)
            else:
                size = len(payload)
            del reply
            self.report.bytes_up[node] = self.report.bytes_up.get(node, 0) + size
            self.server.receive(cid, message)
        except ChunkError as exc:
            self.report.chunk_rejected.append((node, str(exc)))
            log.warning("node %d's masked input rejected: %s", node, exc)
        except (ValueError, ProtocolError) as exc:
            log.info("node %d's %s reply rejected: %s", node, stage.label, exc)

    def _proof(self, cid: int, node: int, reply: Any) -> bool:
        """With input validation: the node's input proof into the server before its masked
        input; False when the server refuses it (the node is named in ``input_refused``). A
        missing proof is left to the server, which then rejects the masked input."""
        record = secagg_record(reply)
        proof = None if record is None else record.get(PROOF)
        if self.server.config.norm_bound is None or not isinstance(proof, bytes):
            return True
        self.report.bytes_up[node] = self.report.bytes_up.get(node, 0) + len(proof)
        try:
            self.server.receive(cid, proof)
        except InputRefused as exc:
            log.warning("node %d refused in masked_input: %s", node, exc)
            return False
        return True
