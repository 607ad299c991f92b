"""The client side of a round over a bus: ``ClientDriver`` runs a ``secagg.Client`` (how
the drivers work: :mod:`transport.drivers`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from secagg import DecodeError, ProtocolAbort, ProtocolError, Stage, decode, encode
from secagg.client import Client
from secagg.masked_stream import MaskedStream
from secagg.messages import ClientMessage, MaskedChunk, MaskedInput, split_masked_input

from .control import (
    MAX_CONTROL_BYTES,
    UPLOAD_RECEIPT,
    ClientAbort,
    ControlError,
    Grant,
    Offline,
    Receipt,
    RoundAbort,
    RoundEnd,
    RoundStart,
    decode_control,
    encode_control,
)
from .drivers import Timeouts, publish_framed
from .framing import (
    DEFAULT_MAX_PAYLOAD,
    FrameError,
    Reassembler,
    message_id,
)
from .link import Delivery, Link, LinkLost, Reconnected
from .topics import ABORT, RECEIPT, Topics, stage_of

logger = logging.getLogger(__name__)


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

_TURN = "_secagg_compute_turn"
"""The attribute of an event loop holding its clients' compute turn (an ``asyncio.Lock``).
On the loop itself, not in a ``WeakKeyDictionary`` keyed by the loop: the lock references
its loop, so such an entry kept every loop alive (one per ``asyncio.run``: per round in a
one-process federation, about 2 KB each); as an attribute it is a plain cycle the garbage
collector frees with the loop."""


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
    lock: asyncio.Lock | None = getattr(loop, _TURN, None)
    if lock is None:
        lock = asyncio.Lock()
        setattr(loop, _TURN, lock)
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
        # the streamed masked input (docs/deployment.md, flow control): what to send, the
        # server's grant, the chunks not yet produced and those sent but unconfirmed
        self._upload: MaskedStream | MaskedInput | None = None
        self._grant: Grant | None = None
        self._chunks: Iterator[MaskedChunk] | None = None
        self._inflight: dict[bytes, bytes] = {}  # digest -> wire bytes, in sending order
        self._sent_order: dict[bytes, int] = {}  # digest of each chunk sent -> its place
        self._produced = False  # the last chunk is out (or the stream cannot go on)

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
                unconfirmed = bool(self._inflight) or not self._confirmed
                wait = self.timeouts.retry if unconfirmed else self.timeouts.answer
                wake = self._progress_at + self.timeouts.give_up
                sent = self._current is not None or bool(self._inflight)
                if sent:  # nothing to re-publish (e.g. waiting for a grant): no retry timer
                    wake = min(wake, self._sent_at + wait)
                if lost is not None:
                    wake = min(wake, lost + self.timeouts.answer)
                if sent and now >= self._sent_at + wait:
                    await self._republish("no receipt" if not self._confirmed
                                          else "no answer")
                    continue
            event = await self.link.receive(max(0.0, wake - now))
            if event is None:
                continue
            if isinstance(event, Reconnected):
                self._server_lost_at = None
                if self._current is not None or self._inflight:
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
            await self._on_receipt(control, loop)
        elif kind == RECEIPT and isinstance(control, Grant):
            await self._on_grant(control, loop)
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

    async def _on_receipt(self, receipt: Receipt, loop: asyncio.AbstractEventLoop) -> None:
        chunk = self._inflight.pop(receipt.digest, None)
        if chunk is not None and receipt.ok:
            # the server accepts a stream's chunks in order only: this one's acceptance
            # confirms every chunk sent before it (their receipts were lost), which are
            # therefore never re-sent, let alone refused
            for earlier in list(self._inflight):
                if self._sent_order[earlier] > self._sent_order[receipt.digest]:
                    break
                del self._inflight[earlier]
        whole_upload = (receipt.digest == UPLOAD_RECEIPT and not receipt.ok
                        and self._upload is not None)
        if chunk is None and not whole_upload and (
                self._current is None or receipt.digest != self._current[2]):
            return  # a receipt for something this client did not send (garbage, replays)
        if receipt.ok:
            self._progress_at = loop.time()
            if self._current is not None and receipt.digest == self._current[2]:
                self._confirmed = True
                if self.client.done:
                    self._finish("done")
            await self._pump_upload(loop)
        else:
            label = (Stage.MASKED_INPUT if self._upload is not None or self._current is None
                     else self._current[0]).label
            logger.warning("client %d: the server rejected its %s message: %s",
                           self.client_id, label, receipt.reason)
            self._finish("excluded", receipt.reason)
            if receipt.digest != UPLOAD_RECEIPT:
                # it gives up: signing off frees its upload slot and the stage at once
                await publish_framed(self.link, self.topics.offline(self.client_id),
                                     encode_control(Offline(f"gave up: the server refused "
                                                            f"its {label} message")),
                                     self.max_payload)

    async def _on_grant(self, grant: Grant, loop: asyncio.AbstractEventLoop) -> None:
        if grant.session_id != self.client.session_id:
            logger.warning("client %d: upload grant of another session dropped", self.client_id)
            return
        if self._grant is not None:
            return  # a re-sent grant: the stream goes on where it is
        self._grant = grant
        self._progress_at = loop.time()
        await self._pump_upload(loop)

    async def _pump_upload(self, loop: asyncio.AbstractEventLoop) -> None:
        """Produce and publish chunks of the masked input while the grant's window has
        room: the client masks one chunk at a time (``MaskedStream``) and waits for the
        server's receipts, so a slow server slows it instead of losing chunks."""
        grant, upload = self._grant, self._upload
        if grant is None or upload is None or self.outcome.status != "running":
            return
        if self._produced:
            return
        label = Stage.MASKED_INPUT.label
        if self._chunks is None:
            self._chunks = (upload.chunks(grant.chunk_elements)
                            if isinstance(upload, MaskedStream)
                            else split_masked_input(upload, grant.chunk_elements))
            if isinstance(upload, MaskedStream) and upload.proof is not None:
                # norm_bound: the input proof goes first (docs/protocol.md 10.3)
                raw = encode(upload.proof)
                digest = message_id(raw)
                self._inflight[digest] = raw
                self._sent_order[digest] = len(self._sent_order)  # the stream's first
                self.outcome.bytes_sent[label] = (self.outcome.bytes_sent.get(label, 0)
                                                  + len(raw))
                await self._publish_raw(raw, digest)
        while len(self._inflight) < grant.window and not self._produced:
            try:
                async with _compute_turn():
                    chunk = next(self._chunks)
            except StopIteration:
                self._produced = True
                break
            except ProtocolError as exc:  # the client aborted or finished meanwhile
                logger.warning("client %d: %s", self.client_id, exc)
                self._produced = True
                break
            raw = encode(chunk)
            digest = message_id(raw)
            self._inflight[digest] = raw
            self._sent_order[digest] = len(self._sent_order)
            self.outcome.bytes_sent[label] = self.outcome.bytes_sent.get(label, 0) + len(raw)
            if chunk.last:
                self._current = (Stage.MASKED_INPUT, raw, digest)
                self._confirmed = False
                self._produced = True
            await self._publish_raw(raw, digest)

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
            # only its session id is kept: an unmasking request lists every survivor (n
            # ids, about 330 KB decoded at n = 9,000) and the compute turn below may wait
            # for thousands of the worker's sites, each of which would hold one
            session_id = decode(raw).session_id
        except DecodeError as exc:
            logger.warning("client %d: undecodable server message dropped: %s", cid, exc)
            return
        if session_id != self.client.session_id:
            logger.warning("client %d: server message of another session dropped (replay?)",
                           cid)
            return
        try:
            async with _compute_turn():
                reply = self.client.stream(raw)
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
        if isinstance(reply, (MaskedStream, MaskedInput)):
            await self._start_upload(reply, loop)
        else:
            await self._send(reply)

    async def _start_upload(self, upload: MaskedStream | MaskedInput,
                            loop: asyncio.AbstractEventLoop) -> None:
        """The masked input streams once the server grants this client a slot."""
        stage = Stage.MASKED_INPUT
        if self.drop_at is not None and stage >= self.drop_at:
            await self._drop(stage)
            return
        if self._upload is not None:
            return  # the same Ciphertexts again: the stream is under way
        self._upload = upload
        # _current stays the previous message until the last chunk is out: re-published
        # (no answer, or a reconnect) it makes the server send its answer and the grant
        # again, so a grant lost on the way is not waited for until give_up
        self.outcome.stage = stage.label
        await self._pump_upload(loop)

    async def _send(self, message: ClientMessage) -> None:
        stage = message.stage
        if self.drop_at is not None and stage >= self.drop_at:
            await self._drop(stage)
            return
        raw = encode(message)
        self._current = (stage, raw, message_id(raw))
        self._confirmed = False
        self.outcome.stage = stage.label
        self.outcome.bytes_sent[stage.label] = len(raw)
        await self._publish()

    async def _publish(self) -> None:
        assert self._current is not None
        stage, raw, digest = self._current
        await self._publish_raw(raw, digest, stage)

    async def _publish_raw(self, raw: bytes, digest: bytes,
                           stage: Stage = Stage.MASKED_INPUT) -> None:
        self._sent_at = asyncio.get_running_loop().time()
        self.outcome.wire_bytes += await publish_framed(
            self.link, self.topics.stage_upstream(self.client_id, stage), raw,
            self.max_payload, digest=digest)

    async def _republish(self, why: str) -> None:
        if self._inflight:  # the unconfirmed chunks of the masked input, in order
            logger.info("client %d: re-publishing %d unconfirmed chunks of its masked "
                        "input (%s)", self.client_id, len(self._inflight), why)
            self.outcome.republished += 1
            for digest, raw in list(self._inflight.items()):
                await self._publish_raw(raw, digest)
            return
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
