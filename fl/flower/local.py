"""A Flower ``Grid`` that runs a ``ClientApp`` in this process (tests and benchmarks).

Every message crosses Flower's own protobuf serde both ways (as on the real transport),
and each node's ``Context`` is serialised after every message and rebuilt before the next
(as when a SuperNode starts a fresh ClientApp process per message), so state survives only
through ``Context.state``. ``silent`` nodes never answer from a given stage on (a crash or
a timeout); exceptions in the ClientApp become Flower error replies. ``node_config`` adds
to a node's config what its operator would pass a SuperNode (``--node-config``).

For measurements it keeps, per node, the CPU seconds its ClientApp spent (serde of its
messages included), the serialised bytes of the messages it received and sent, and the
largest serialised ``Context`` it saved between messages (``context_bytes``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.serde import (
    context_from_proto,
    context_to_proto,
    message_from_proto,
    message_to_proto,
)
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity


def wire(message: Message) -> Message:
    return message_from_proto(message_to_proto(message))


class LocalGrid(Grid):
    def __init__(self, app: Any, num_nodes: int, *, run_id: int = 7,
                 silent: Callable[[int, Message], bool] | None = None,
                 first_node: int = 1000,
                 node_config: Callable[[int], dict[str, Any]] | None = None) -> None:
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = 0
        TaskIdentity.task_id = 0
        self.app = app
        self._run = Run.create_empty(run_id)
        self.nodes = [first_node + 37 * i for i in range(num_nodes)]
        self.contexts = {
            node: context_to_proto(Context(run_id=run_id, node_id=node,
                                           node_config={"partition-id": i,
                                                        "num-partitions": num_nodes,
                                                        **(node_config(node) if node_config
                                                           else {})},
                                           state=RecordDict(), run_config={}))
            for i, node in enumerate(self.nodes)}
        self.silent = silent or (lambda node, msg: False)
        self.sent: list[Message] = []     # every message the server sent (after serde)
        self.replies: list[Message] = []  # every reply a node sent (after serde)
        self.record = True  # keep sent / replies (tests); benchmarks turn it off
        self.client_cpu: dict[int, float] = {}
        self.bytes_down: dict[int, int] = {}
        self.bytes_up: dict[int, int] = {}
        self.context_bytes: dict[int, int] = {}  # node -> its largest saved Context

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type,
                       group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("the in-process grid only does send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("the in-process grid only does send_and_receive")

    def deliver(self, message: Message) -> Message | None:
        """Run the ClientApp on one message; the reply after serde (None if silent)."""
        message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        started = time.process_time()
        proto = message_to_proto(message)
        received = message_from_proto(proto)
        node = received.metadata.dst_node_id
        self.bytes_down[node] = self.bytes_down.get(node, 0) + proto.ByteSize()
        if self.record:
            self.sent.append(wire(received))  # the ClientApp may alter its own copy
        if self.silent(node, received):
            return None
        context = context_from_proto(self.contexts[node])
        try:
            reply = self.app(received, context)
        except Exception as exc:
            reply = Message(Error(code=1, reason=f"{type(exc).__name__}: {exc}"),
                            reply_to=received)
        self.contexts[node] = context_to_proto(context)
        reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        proto = message_to_proto(reply)
        self.bytes_up[node] = self.bytes_up.get(node, 0) + proto.ByteSize()
        out = message_from_proto(proto)
        self.client_cpu[node] = self.client_cpu.get(node, 0.0) + time.process_time() - started
        self.context_bytes[node] = max(self.context_bytes.get(node, 0),
                                       self.contexts[node].ByteSize())
        if self.record:
            self.replies.append(out)
        return out

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        replies = [self.deliver(m) for m in messages]
        return [r for r in replies if r is not None]

    def state(self, node: int) -> RecordDict:
        return context_from_proto(self.contexts[node]).state
