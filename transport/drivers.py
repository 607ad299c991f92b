"""asyncio drivers that bind the sans-IO ``secagg.Server`` and ``secagg.Client`` to a bus.

The state machines decide; the drivers own time and the wire (docs/architecture.md section 5):

* every payload is framed (``transport.framing``): chunked above ``max_payload``, reassembled
  in bounded buffers; garbage, truncated, oversized and spliced payloads are logged and
  dropped, never handed to a state machine;
* the server learns a sender from the topic (which the broker's ACL authenticates) and the
  state machine checks the payload's own client id against it;
* delivery is confirmed at the protocol level: the server answers every client message with
  a ``Receipt`` (sha256 of the message, accepted or why not) and its next-stage message is
  the client's real confirmation. A client re-publishes a message that got no receipt after
  ``retry`` seconds, and re-publishes it again when no next message came for ``answer``
  seconds; the server treats an identical message as a duplicate and re-sends its answer;
* each stage closes when every expected client answered, is known to be gone (its sign-off
  arrived, or its last will and then ``will_grace`` seconds without the server's own
  connection failing: a broker that shuts down publishes every will), or the stage deadline
  passed;
* duplicates are harmless everywhere: the same message id is the same bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from secagg import DecodeError, ProtocolAbort, ProtocolError, Stage, decode, encode, round_stages
from secagg.client import Client
from secagg.server import AggregateResult, Server

from .control import (
    MAX_CONTROL_BYTES,
    ClientAbort,
    ControlError,
    Offline,
    Receipt,
    RoundAbort,
    RoundEnd,
    RoundStart,
    config_fields,
    decode_control,
    encode_control,
)
from .framing import (
    DEFAULT_MAX_PAYLOAD,
    HEADER_BYTES,
    FrameError,
    Reassembler,
    frame,
    message_id,
)
from .link import Delivery, Link, LinkLost, Reconnected, Will
from .tasks import stop_task
from .topics import ABORT, OFFLINE, RECEIPT, Topics, stage_of

logger = logging.getLogger(__name__)


class TransportError(Exception):
    """The round could not be run over the bus (broker unreachable, lost for too long)."""


@dataclass(frozen=True)
class Timeouts:
    """Seconds. ``stage``: a stage's deadline after it opens (``per_stage`` overrides by stage
    label); ``start``: how long a client waits for the round start; ``retry``: re-publish a
    message without receipt; ``answer``: re-publish a confirmed message when the next one does
    not come; ``give_up``: a client abandons the round after this long without progress;
    ``resend_interval``: the server re-sends an answer to one client at most this often;
    ``will_grace``: how long a last will must stand before the server stops waiting."""

    stage: float = 60.0
    per_stage: Mapping[str, float] = field(default_factory=dict)
    start: float = 120.0
    retry: float = 5.0
    answer: float = 30.0
    give_up: float = 300.0
    resend_interval: float = 1.0
    will_grace: float = 0.5

    def deadline(self, stage: Stage) -> float:
        return float(self.per_stage.get(stage.label, self.stage))


async def publish_framed(link: Link, topic: str, message: bytes, max_payload: int, *,
                         retain: bool = False) -> int:
    """Publish ``message`` as frames; returns the bytes put on the wire (0 if the link
    refused any frame)."""
    # A retained message must be one frame (a topic retains one payload); control messages
    # are O(1) in size (no roster, no vectors), far below any broker's limit.
    frames = frame(message, max(max_payload, len(message) + HEADER_BYTES) if retain
                   else max_payload)
    sent = 0
    for data in frames:
        if not await link.publish(topic, data, retain=retain):
            return 0
        sent += len(data)
    return sent


def server_will(server: Server, topics: Topics) -> Will:
    """The server's last will: clients learn at once that the aggregator may be gone (and
    give up after ``Timeouts.answer`` seconds unless it comes back: a broker that shuts down
    publishes every will, the server's too)."""
    del server
    payload = encode_control(Offline("the aggregation server disconnected", final=False))
    return Will(topics.control, frame(payload)[0])


def client_will(topics: Topics, client_id: int) -> Will:
    """A site's last will: the server stops waiting for it before the stage deadline."""
    payload = encode_control(Offline("connection lost", final=False))
    return Will(topics.offline(client_id), frame(payload)[0])


@dataclass(frozen=True)
class StageProgress:
    """What the server driver reports when a stage closes (for progress displays)."""

    stage: Stage
    seconds: float
    responded: int
    expected: int
    gone: int
    deadline_hit: bool


# --------------------------------------------------------------------------- server


class ServerDriver:
    """Runs ``server`` over ``link`` until the round has a result or aborts.

    The caller connects the link (with ``server_will``) and subscribes it to
    ``topics.server_filter``; ``run()`` publishes the round start, drives every stage and
    publishes the round end (or abort). Raises ``ProtocolAbort`` when too few clients remain
    and ``TransportError`` when the bus is lost for good.
    """

    def __init__(self, server: Server, link: Link, topics: Topics, *,
                 timeouts: Timeouts | None = None, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 on_stage: Callable[[StageProgress], None] | None = None,
                 on_message: Callable[[int, Stage], None] | None = None) -> None:
        self.server = server
        self.link = link
        self.topics = topics
        self.timeouts = timeouts or Timeouts()
        self.max_payload = max_payload
        self.on_stage = on_stage
        self.on_message = on_message
        self.seconds: dict[str, float] = {}
        self.bytes_received: dict[int, dict[str, int]] = {}
        self.gone: dict[int, str] = {}
        self._wills: dict[int, float] = {}  # client -> when its last will arrived
        self.client_aborts: dict[int, str] = {}
        self.invalid_payloads = 0
        self.rejected = 0
        self.resends = 0
        self._reassembler = Reassembler(server.max_message_bytes() + 4096)
        self._outbox: dict[int, tuple[Stage, bytes]] = {}
        self._answered: dict[int, bytes] = {}  # client -> digest its outbox message answers
        self._accepted: dict[int, bytes] = {}  # this stage: client -> digest accepted
        self._seen: set[tuple[int, bytes]] = set()  # every (client, digest) accepted
        self._last_resend: dict[int, float] = {}
        self._progress = asyncio.Event()
        self._failure: BaseException | None = None
        self._control: bytes | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._deadlines = {s.label: self.timeouts.deadline(s)
                           for s in round_stages(server.config)}
        self._stage_kinds = frozenset(self._deadlines)

    # -- public ----------------------------------------------------------------------

    async def run(self) -> AggregateResult:
        server = self.server
        start = RoundStart(server.session_id, config_fields(server.config),
                           len(server.roster), self._deadlines, server.nonce)
        await self._publish_control(encode_control(start))
        pump = asyncio.create_task(self._pump(), name="secagg-server-pump")
        round_started = asyncio.get_running_loop().time()
        try:
            while server.result is None:
                await self._run_stage()
            self.seconds["total"] = asyncio.get_running_loop().time() - round_started
            result = server.result
            end = RoundEnd(server.session_id, tuple(sorted(result.included)),
                           {c: s.label for c, s in result.dropped.items()})
            await self._publish_control(encode_control(end))
            return result
        except ProtocolAbort as exc:
            await self._publish_control(encode_control(RoundAbort(server.session_id,
                                                                  str(exc))))
            raise
        finally:
            await stop_task(pump)
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=5.0)

    # -- stages ----------------------------------------------------------------------

    def _waiting_for(self) -> frozenset[int]:
        now = asyncio.get_running_loop().time()
        for cid, at in list(self._wills.items()):
            if now - at >= self.timeouts.will_grace:
                del self._wills[cid]
                logger.info("server: client %d is gone (last will)", cid)
                self.gone[cid] = "offline"
        return self.server.pending - set(self.gone)

    def _next_wake(self, deadline: float) -> float:
        if not self._wills:
            return deadline
        return min(deadline, min(self._wills.values()) + self.timeouts.will_grace)

    async def _run_stage(self) -> None:
        loop = asyncio.get_running_loop()
        stage = self.server.stage
        opened = loop.time()
        deadline = opened + self._deadlines[stage.label]
        expected = len(self.server.pending)
        deadline_hit = False
        while self._waiting_for():
            if self._failure is not None:
                raise TransportError(str(self._failure)) from self._failure
            remaining = deadline - loop.time()
            if remaining <= 0:
                deadline_hit = True
                logger.info("%s: deadline passed; %d clients did not answer", stage.label,
                            len(self._waiting_for()))
                break
            self._progress.clear()
            wake = self._next_wake(deadline) - loop.time()
            with contextlib.suppress(TimeoutError):  # asyncio.timeout: a cancel is never lost
                async with asyncio.timeout(max(0.0, wake)):
                    await self._progress.wait()
        if self._failure is not None:
            raise TransportError(str(self._failure)) from self._failure
        responded = len(self.server.received)
        answered = dict(self._accepted)
        out = self.server.advance()  # raises ProtocolAbort when too few remain
        self._accepted = {}
        self._answered = {cid: answered[cid] for cid in out if cid in answered}
        encoded = {cid: (self.server.stage, encode(msg)) for cid, msg in out.items()}
        self._outbox = encoded
        await asyncio.gather(*(self._send(cid) for cid in encoded))
        seconds = loop.time() - opened
        self.seconds[stage.label] = seconds
        gone = sum(1 for cid in self.gone if cid in self.server.dropped)
        if self.on_stage is not None:
            self.on_stage(StageProgress(stage, seconds, responded, expected, gone,
                                        deadline_hit))

    async def _send(self, cid: int) -> None:
        stage, raw = self._outbox[cid]
        await publish_framed(self.link, self.topics.downstream(cid, stage.label), raw,
                             self.max_payload)

    def _spawn(self, coro: Awaitable[object]) -> None:
        async def wrapped() -> None:
            try:
                await coro
            except Exception:
                logger.exception("server: background publish failed")

        task = asyncio.create_task(wrapped())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish_control(self, payload: bytes) -> None:
        self._control = payload
        await publish_framed(self.link, self.topics.control, payload, self.max_payload,
                             retain=True)

    # -- receiving -------------------------------------------------------------------

    async def _pump(self) -> None:
        try:
            while True:
                event = await self.link.receive()
                if isinstance(event, Reconnected):
                    self._on_reconnected()
                elif isinstance(event, Delivery):
                    self._on_delivery(event)
        except LinkLost as exc:
            self._failure = exc
            self._progress.set()

    def _on_reconnected(self) -> None:
        logger.info("server: reconnected; re-publishing the round state")
        # Wills published while the broker went down say nothing about the clients.
        self._wills.clear()
        for cid in [c for c, why in self.gone.items() if why == "offline"]:
            del self.gone[cid]
        if self._control is not None:
            self._spawn(publish_framed(self.link, self.topics.control, self._control,
                                       self.max_payload, retain=True))
        for cid in self.server.pending:
            if cid in self._outbox:
                self._spawn(self._send(cid))

    def _on_delivery(self, event: Delivery) -> None:
        parsed = self.topics.parse_upstream(event.topic)
        if parsed is None:
            logger.warning("server: message on unexpected topic %s dropped", event.topic)
            return
        kind, cid = parsed
        stage = stage_of(kind)
        if cid not in self.server.roster or (
                kind not in self._stage_kinds if stage is not None else
                kind not in (OFFLINE, ABORT)):
            # Dropped before any buffering: a site (even one outside the roster) may write
            # any <kind> under its own name, and must not make the server keep anything.
            self.invalid_payloads += 1
            logger.debug("server: message from client %d on kind %r dropped", cid, kind)
            return
        limit = None if stage is not None else MAX_CONTROL_BYTES
        now = asyncio.get_running_loop().time()
        try:
            message = self._reassembler.feed((cid, kind), event.payload, now, limit,
                                             quota=cid)
        except FrameError as exc:
            self.invalid_payloads += 1
            logger.warning("server: invalid payload from client %d on %s dropped: %s", cid,
                           kind, exc)
            return
        if message is None:
            return
        if stage is None:
            self._on_notice(cid, kind, message.payload)
        else:
            self._on_client_message(cid, message.digest, message.payload)
        self._progress.set()  # the stage loop re-evaluates (answers, wills, grace timers)

    def _on_notice(self, cid: int, kind: str, payload: bytes) -> None:
        try:
            notice = decode_control(payload)
        except ControlError as exc:
            self.invalid_payloads += 1
            logger.warning("server: invalid %s notice from client %d dropped: %s", kind, cid,
                           exc)
            return
        if kind == OFFLINE and isinstance(notice, Offline):
            if cid in self.server.roster and cid not in self.gone:
                logger.info("server: client %d is offline (%s)", cid, notice.reason)
                if notice.final:
                    self.gone[cid] = "offline"
                else:
                    self._wills.setdefault(cid, asyncio.get_running_loop().time())
        elif kind == ABORT and isinstance(notice, ClientAbort):
            if cid in self.server.roster:
                logger.warning("server: client %d aborted: %s", cid, notice.reason)
                self.gone[cid] = "aborted"
                self.client_aborts[cid] = notice.reason
        else:
            self.invalid_payloads += 1
            logger.warning("server: unexpected %s notice from client %d dropped", kind, cid)

    def _on_client_message(self, cid: int, digest: bytes, payload: bytes) -> None:
        if self._answered.get(cid) == digest and cid in self._outbox:
            # The client did not get our answer (it re-published): send it again.
            now = asyncio.get_running_loop().time()
            if now - self._last_resend.get(cid, -1e9) >= self.timeouts.resend_interval:
                self._last_resend[cid] = now
                self.resends += 1
                logger.info("server: client %d re-sent its %s message; answering again", cid,
                            self._outbox[cid][0].label)
                self._spawn(self._send(cid))
            return
        if (cid, digest) in self._seen:
            # A duplicate of an accepted message (also after the round finished): confirm.
            self._spawn(self._receipt(cid, Receipt(digest, True)))
            return
        stage = self.server.stage
        try:
            self.server.receive(cid, payload)
        except ProtocolError as exc:
            self.rejected += 1
            logger.warning("server: %s", exc)
            self._spawn(self._receipt(cid, Receipt(digest, False, str(exc))))
            return
        self._accepted.setdefault(cid, digest)
        self._seen.add((cid, digest))
        self.gone.pop(cid, None)
        self._wills.pop(cid, None)
        counts = self.bytes_received.setdefault(cid, {})
        counts.setdefault(stage.label, len(payload))
        if self.on_message is not None:
            self.on_message(cid, stage)
        self._spawn(self._receipt(cid, Receipt(digest, True)))

    async def _receipt(self, cid: int, receipt: Receipt) -> None:
        await publish_framed(self.link, self.topics.downstream(cid, RECEIPT),
                             encode_control(receipt), self.max_payload)


# --------------------------------------------------------------------------- client


@dataclass
class ClientOutcome:
    """How one client's round went, from its own side.

    ``status``: ``done`` (its last message was confirmed or the round ended after it),
    ``dropped`` (it stopped at ``drop_at``), ``aborted`` (its state machine aborted),
    ``excluded`` (the server no longer accepts its messages), ``round-aborted``,
    ``timeout`` or ``lost`` (the bus).
    """

    client_id: int
    status: str = "running"
    stage: str = ""
    reason: str = ""
    bytes_sent: dict[str, int] = field(default_factory=dict)
    wire_bytes: int = 0
    republished: int = 0


DropHook = Callable[[Stage], Awaitable[None]]

_TURNS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary())


@contextlib.asynccontextmanager
async def _compute_turn() -> AsyncIterator[None]:
    """The clients on one event loop compute their answers one at a time, each in a loop
    iteration of its own: between two of them the loop serves I/O (keepalive pings, receipts,
    the next deliveries). Without it, hundreds of sites in one ``secagg simulate`` worker whose
    messages arrived together compute in one iteration for tens of seconds, the broker drops
    them for a missed keepalive and they re-publish for want of receipts they did not read.
    The turn is taken, then the loop is yielded once, so every client woken in the same
    iteration queues behind it instead of finding the lock free after it."""
    loop = asyncio.get_running_loop()
    lock = _TURNS.get(loop)
    if lock is None:
        lock = _TURNS[loop] = asyncio.Lock()
    async with lock:
        await asyncio.sleep(0)
        yield


class ClientDriver:
    """Runs one ``secagg.Client`` over ``link`` for one round.

    The caller connects the link (with ``client_will``) and subscribes it to
    ``topics.client_filter(id)`` and ``topics.control``. ``drop_at`` makes the client stop
    before sending its message of that stage (a simulated dropout): ``drop_mode="leave"``
    signs off on the offline topic (as its last will would), ``"silent"`` just stops, and
    ``on_drop`` runs first (it may kill the process).
    """

    def __init__(self, client: Client, link: Link, topics: Topics, *,
                 timeouts: Timeouts | None = None, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 drop_at: Stage | None = None, drop_mode: str = "leave",
                 on_drop: DropHook | None = None) -> None:
        if drop_mode not in ("leave", "silent"):
            raise ValueError("drop_mode must be 'leave' or 'silent'")
        self.client = client
        self.link = link
        self.topics = topics
        self.timeouts = timeouts or Timeouts()
        self.max_payload = max_payload
        self.drop_at = drop_at
        self.drop_mode = drop_mode
        self.on_drop = on_drop
        self.outcome = ClientOutcome(client.client_id)
        n = len(client.roster)
        self._reassembler = Reassembler((1 << 20) + 1024 * n, max_partial=2)
        self._handled: dict[bytes, int] = {}  # digest of each server message -> order
        self._last_handled: bytes | None = None
        self._current: tuple[Stage, bytes, bytes] | None = None  # stage, raw, digest
        self._confirmed = False
        self._sent_at = 0.0
        self._progress_at = 0.0
        self._started = False
        self._server_lost_at: float | None = None

    @property
    def client_id(self) -> int:
        return self.client.client_id

    async def run(self) -> ClientOutcome:
        """Take part in the round; returns when this client's part is over."""
        loop = asyncio.get_running_loop()
        self._progress_at = loop.time()
        try:
            await self._run(loop)
        except LinkLost as exc:
            self._finish("lost", str(exc))
        if self.outcome.status == "running":
            self._finish("timeout", "no progress")
        return self.outcome

    def _finish(self, status: str, reason: str = "") -> None:
        if self.outcome.status == "running":
            self.outcome.status = status
            self.outcome.reason = reason

    async def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        while self.outcome.status == "running":
            now = loop.time()
            if not self._started:
                wake = self._progress_at + self.timeouts.start
                if now >= wake:
                    self._finish("timeout", "the round start never arrived")
                    return
            else:
                lost = self._server_lost_at
                if lost is not None and now - lost >= self.timeouts.answer:
                    self._finish("round-aborted", "the aggregation server disconnected")
                    return
                if now - self._progress_at >= self.timeouts.give_up:
                    self._finish("timeout", f"no progress for {self.timeouts.give_up} s")
                    return
                wait = self.timeouts.retry if not self._confirmed else self.timeouts.answer
                wake = min(self._sent_at + wait, self._progress_at + self.timeouts.give_up)
                if lost is not None:
                    wake = min(wake, lost + self.timeouts.answer)
                if self._current is not None and now >= self._sent_at + wait:
                    await self._republish("no receipt" if not self._confirmed
                                          else "no answer")
                    continue
            event = await self.link.receive(max(0.0, wake - now))
            if event is None:
                continue
            if isinstance(event, Reconnected):
                self._server_lost_at = None
                if self._current is not None:
                    await self._republish("reconnected")
                continue
            await self._on_delivery(event, loop)

    async def _on_delivery(self, event: Delivery, loop: asyncio.AbstractEventLoop) -> None:
        cid = self.client_id
        if event.topic == self.topics.control:
            kind = "control"
        else:
            parsed = self.topics.parse_downstream(event.topic)
            if parsed is None or parsed[0] != cid:
                logger.warning("client %d: message on unexpected topic %s dropped", cid,
                               event.topic)
                return
            kind = parsed[1]
        if not event.payload:
            return  # a cleared retained message
        if kind not in ("control", RECEIPT) and stage_of(kind) is None:
            logger.warning("client %d: message of unknown kind %r dropped", cid, kind)
            return
        if kind != "control":
            self._server_lost_at = None  # the server is publishing: it is there
        is_stage = stage_of(kind) is not None
        try:
            message = self._reassembler.feed(kind, event.payload, loop.time(),
                                             None if is_stage else MAX_CONTROL_BYTES)
        except FrameError as exc:
            logger.warning("client %d: invalid payload on %s dropped: %s", cid, kind, exc)
            return
        if message is None:
            return
        if is_stage:
            await self._on_server_message(message.digest, message.payload, loop)
            return
        try:
            control = decode_control(message.payload)
        except ControlError as exc:
            logger.warning("client %d: invalid %s payload dropped: %s", cid, kind, exc)
            return
        if kind == "control":
            await self._on_control(control, loop)
        elif kind == RECEIPT and isinstance(control, Receipt):
            self._on_receipt(control, loop)
        else:
            logger.warning("client %d: unexpected %s payload dropped", cid, kind)

    async def _on_control(self, control: object, loop: asyncio.AbstractEventLoop) -> None:
        cid = self.client_id
        session = self.client.session_id
        if isinstance(control, Offline):
            logger.warning("client %d: %s", cid, control.reason)
            self._server_lost_at = loop.time()
        elif isinstance(control, RoundStart):
            self._server_lost_at = None
            if control.session_id != session:
                logger.error("client %d: the round start names another session (config %s, "
                             "%d clients); this client's configuration, roster or context "
                             "differs; ignoring it", cid, dict(control.config),
                             control.clients)
                return
            if self._started:
                return
            if control.nonce:
                try:
                    self.client.bind_nonce(control.nonce)
                except ProtocolError as exc:
                    logger.error("client %d: round start refused: %s", cid, exc)
                    return
            self._started = True
            self._progress_at = loop.time()
            await self._send(self.client.advertise())
        elif isinstance(control, RoundEnd) and control.session_id == session:
            if self.client.done:
                self._finish("done")
            else:
                self._finish("excluded", "the round ended without this client")
        elif isinstance(control, RoundAbort) and control.session_id == session:
            self._finish("round-aborted", control.reason)

    def _on_receipt(self, receipt: Receipt, loop: asyncio.AbstractEventLoop) -> None:
        if self._current is None or receipt.digest != self._current[2]:
            return  # a receipt for something this client did not send (garbage, replays)
        if receipt.ok:
            self._confirmed = True
            self._progress_at = loop.time()
            if self.client.done:
                self._finish("done")
        else:
            logger.warning("client %d: the server rejected its %s message: %s",
                           self.client_id, self._current[0].label, receipt.reason)
            self._finish("excluded", receipt.reason)

    async def _on_server_message(self, digest: bytes, raw: bytes,
                                 loop: asyncio.AbstractEventLoop) -> None:
        cid = self.client_id
        if digest == self._last_handled:
            if self._current is not None:
                await self._republish("the server re-sent its message")
            return
        if digest in self._handled:
            logger.warning("client %d: replay of an earlier server message dropped", cid)
            return
        try:
            decoded = decode(raw)
        except DecodeError as exc:
            logger.warning("client %d: undecodable server message dropped: %s", cid, exc)
            return
        if decoded.session_id != self.client.session_id:
            logger.warning("client %d: server message of another session dropped (replay?)",
                           cid)
            return
        try:
            async with _compute_turn():
                reply = self.client.handle(raw)
        except ProtocolAbort as exc:
            logger.error("%s", exc)
            self._finish("aborted", str(exc))
            await publish_framed(self.link, self.topics.upstream(cid, ABORT),
                                 encode_control(ClientAbort(str(exc))), self.max_payload)
            return
        except ProtocolError as exc:
            logger.warning("client %d: server message rejected: %s", cid, exc)
            return
        self._handled[digest] = len(self._handled)
        self._last_handled = digest
        self._progress_at = loop.time()
        await self._send(reply)

    async def _send(self, message: object) -> None:
        stage: Stage = message.stage  # type: ignore[attr-defined]
        if self.drop_at is not None and stage >= self.drop_at:
            await self._drop(stage)
            return
        raw = encode(message)  # type: ignore[arg-type]
        self._current = (stage, raw, message_id(raw))
        self._confirmed = False
        self.outcome.stage = stage.label
        self.outcome.bytes_sent[stage.label] = len(raw)
        await self._publish()

    async def _publish(self) -> None:
        assert self._current is not None
        stage, raw, _ = self._current
        self._sent_at = asyncio.get_running_loop().time()
        self.outcome.wire_bytes += await publish_framed(
            self.link, self.topics.stage_upstream(self.client_id, stage), raw,
            self.max_payload)

    async def _republish(self, why: str) -> None:
        assert self._current is not None
        logger.info("client %d: re-publishing its %s message (%s)", self.client_id,
                    self._current[0].label, why)
        self.outcome.republished += 1
        await self._publish()

    async def _drop(self, stage: Stage) -> None:
        logger.info("client %d: dropping out at %s", self.client_id, stage.label)
        if self.on_drop is not None:
            await self.on_drop(stage)
        self._finish("dropped", stage.label)
        self.outcome.stage = stage.label
        if self.drop_mode == "leave":
            await publish_framed(self.link, self.topics.offline(self.client_id),
                                 encode_control(Offline(f"left at {stage.label}")),
                                 self.max_payload)
