"""One secure-aggregation round driven through a Flower ``Grid``: the stage loop.

The first stage's messages are the strategy's own train messages plus the round setup;
every later stage sends each node the ``secagg.Server``'s message for it. A stage closes
when every node it was sent to answered or the stage timeout passed (``Grid.send_and_receive``
returns what arrived); an error reply, a missing reply and a reply the server rejects all
count as that node dropping out at that stage, exactly as the protocol allows. The round
aborts (``ProtocolAbort``) only when the protocol cannot finish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from fl.flower.records import PAYLOAD, RECORD, SESSION, SETUP, payload_of
from fl.flower.setup import RoundSetup
from secagg import ProtocolAbort, ProtocolError, Server, Stage, encode

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
    ``epsilon``: the privacy budget spent after this round (distributed DP with a budget).
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

    @property
    def server_round(self) -> int:
        return self.setup.server_round


def _content(payload: bytes, session: bytes) -> Any:
    from flwr.app import ConfigRecord, RecordDict

    return RecordDict({RECORD: ConfigRecord({SESSION: session, PAYLOAD: payload})})


class RoundDriver:
    """Runs the stages of one round; ``run`` returns the report (``total`` set on success)."""

    def __init__(self, grid: Any, setup: RoundSetup, server: Server, message_type: str,
                 timeout: float | None, *, first_timeout: float | None = None) -> None:
        """``timeout``: each stage after the first; ``first_timeout``: the first (the
        nodes train in it; default ``timeout``)."""
        self.grid = grid
        self.setup = setup
        self.server = server
        self.message_type = message_type
        self.timeout = timeout
        self.first_timeout = timeout if first_timeout is None else first_timeout
        self.report = RoundReport(setup)
        self._cpu = 0.0

    def run(self, first: Iterable[Any]) -> RoundReport:
        from flwr.app import ConfigRecord, Message, RecordDict

        report = self.report
        setup_bytes = self.setup.to_bytes()
        outgoing = []
        for message in first:
            content = RecordDict(dict(message.content.items()))
            content[RECORD] = ConfigRecord({SETUP: setup_bytes})
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
        report.server_cpu = self._cpu
        if result is not None and report.aborted is None:
            report.total = result.total
            report.included = frozenset(self.setup.node_of(c) for c in result.included)
        return report

    def _messages(self, to_send: Mapping[int, Any]) -> list[Any]:
        from flwr.app import Message

        session = self.server.session_id
        out = []
        for cid, message in sorted(to_send.items()):
            node = self.setup.node_of(cid)
            payload = encode(message)
            self.report.bytes_down[node] = self.report.bytes_down.get(node, 0) + len(payload)
            out.append(Message(content=_content(payload, session), dst_node_id=node,
                               message_type=self.message_type,
                               group_id=str(self.setup.server_round)))
        return out

    def _exchange(self, stage: Stage, outgoing: list[Any]) -> None:
        started = time.perf_counter()
        timeout = self.first_timeout if stage == Stage.ADVERTISE_KEYS else self.timeout
        replies = self.grid.send_and_receive(outgoing, timeout=timeout)
        sent_to = {m.metadata.dst_node_id for m in outgoing}
        cpu = time.process_time()
        for reply in replies:
            node = reply.metadata.src_node_id
            if node not in sent_to:
                continue
            cid = self.setup.client_id(node)
            if reply.has_error():
                log.info("node %d dropped in %s: %s", node, stage.label, reply.error.reason)
                continue
            try:
                payload = payload_of(reply)
                self.report.bytes_up[node] = self.report.bytes_up.get(node, 0) + len(payload)
                self.server.receive(cid, payload)
            except (ValueError, ProtocolError) as exc:
                log.info("node %d's %s reply rejected: %s", node, stage.label, exc)
        self._cpu += time.process_time() - cpu
        self.report.seconds[stage.label] = time.perf_counter() - started
