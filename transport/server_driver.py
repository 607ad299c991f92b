"""The server side of a round over a bus: ``ServerDriver`` runs a ``secagg.Server`` (how
the drivers work: :mod:`transport.drivers`).

This module is the stage loop, the receiving path and the publishing; beside it: the
upload leases (``transport/upload_leases.py``), the bounded queue of each sender and its
waste budget (``transport/sender_queues.py``), and which clients are gone
(``transport/presence.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable

from secagg import ProtocolAbort, ProtocolError, Stage, encode, round_stages
from secagg.crypto import dtype_for_bits
from secagg.server import AggregateResult, Server

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
    config_fields,
    decode_control,
    encode_control,
)
from .deadlines import MAX_STAGE_SECONDS
from .drivers import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_UPLOAD_WINDOW,
    StageProgress,
    Timeouts,
    publish_framed,
)
from .errors import TransportError
from .framing import (
    DEFAULT_MAX_PAYLOAD,
    HEADER_BYTES,
    FrameError,
    chunk_charge,
    round_reassembler,
)
from .link import Delivery, Link, LinkLost, Reconnected
from .presence import Presence
from .sender_queues import SenderQueues
from .tasks import stop_task
from .topics import ABORT, OFFLINE, RECEIPT, Topics, stage_of
from .upload_leases import UploadLeases

logger = logging.getLogger(__name__)


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
                 on_message: Callable[[int, Stage], None] | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 window: int = DEFAULT_UPLOAD_WINDOW) -> None:
        if chunk_bytes < 1 or not 1 <= window <= 1024:
            raise ValueError("chunk_bytes must be positive and window in 1..1024")
        self.server = server
        self.link = link
        self.topics = topics
        self.timeouts = timeouts or Timeouts()
        self.max_payload = max_payload
        self.on_stage = on_stage
        self.on_message = on_message
        self.seconds: dict[str, float] = {}
        self.bytes_received: dict[int, dict[str, int]] = {}
        self._presence = Presence()
        self.client_aborts: dict[int, str] = {}
        self.invalid_payloads = 0
        self.rejected = 0
        self.resends = 0
        config = server.config
        width = dtype_for_bits(config.bits).itemsize
        self.chunk_elements = max(1, min(config.dim, chunk_bytes // width))
        self.window = window
        self.chunks = 0  # masked-input chunks accepted (the streaming path, its test)
        largest = (server.max_message_bytes() - config.dim * width
                   + self.chunk_elements * width)
        self._reassembler = round_reassembler(largest + 4096, len(server.roster), max_payload)
        self.reassembly_bound = self._reassembler.max_buffered_bytes
        # deliveries wait in one queue per sender, taken in turn (SenderQueues). A queue
        # holds at most what an honest sender can have in flight (its reassembly quota
        # plus twice its window of chunks), charged as the reassembly charges frames
        step = max(1, max_payload - HEADER_BYTES)
        chunk_wire = self.chunk_elements * width + 4096
        chunk_cost = chunk_wire + chunk_charge(HEADER_BYTES) * (chunk_wire // step + 1)
        # what a sender may make the server spend on messages that change nothing (refused,
        # malformed, duplicates, queue overflow) per stage; past it its deliveries are
        # dropped unread until the next stage. An honest sender gives up after one refusal
        # and re-sends at most its window every retry interval
        longest = max(self._deadlines_for(server))
        if not math.isfinite(longest):  # logical deadlines (a simulation): no stage ends on
            longest = MAX_STAGE_SECONDS  # a clock, so the budget is the longest real stage's
        self._senders = SenderQueues(
            self._reassembler.max_sender_bytes + 2 * window * chunk_cost,
            32 + 2 * window * math.ceil(longest / max(self.timeouts.retry, 1e-3)))
        self._leases = UploadLeases(self.timeouts.upload_idle_limit)
        self.reassembly_peak = 0  # the most bytes the reassembly ever held (its bound)
        self._outbox: dict[int, tuple[Stage, bytes]] = {}
        self._answered: dict[int, bytes] = {}  # client -> digest its outbox message answers
        self._accepted: dict[int, bytes] = {}  # this stage: client -> digest accepted
        # (client, digest) of every message and, while masked_input is open, every chunk of
        # a stream accepted: a re-sent one (its receipt was lost) is always confirmed
        # again, never refused as a second message. At most dim / chunk_elements chunks
        # per client (the grant fixes the chunk size), about 150 B each; when the stage
        # closes only each stream's last ``window`` stay (a late duplicate of its tail)
        self._seen: set[tuple[int, bytes]] = set()
        self._stream_seen: dict[int, list[bytes]] = {}  # this stage: client -> chunks
        self._last_resend: dict[int, float] = {}
        self._progress = asyncio.Event()
        self._failure: BaseException | None = None
        self._control: bytes | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._deadlines = dict(zip((s.label for s in round_stages(server.config)),
                                   self._deadlines_for(server), strict=True))
        self._stage_kinds = frozenset(self._deadlines)

    def _deadlines_for(self, server: Server) -> list[float]:
        return [self.timeouts.deadline(s) for s in round_stages(server.config)]

    @property
    def gone(self) -> dict[int, str]:
        """The clients known to be gone, and why (``Presence``)."""
        return self._presence.gone

    @property
    def queue_bound(self) -> int:
        """The bytes one sender's queue holds at most (``SenderQueues``)."""
        return self._senders.bound

    @property
    def waste_budget(self) -> int:
        """Messages that change nothing a sender may send per stage (``SenderQueues``)."""
        return self._senders.waste_budget

    @property
    def flood_dropped(self) -> int:
        """Deliveries dropped unread (a sender past its waste budget or queue bound)."""
        return self._senders.dropped

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

    def client_lost(self, cid: int, reason: str) -> None:
        """The caller knows ``cid`` will send nothing more (its process failed, e.g. every
        site of a simulation's worker process raised): the round stops waiting for it now,
        as for a sign-off, and drops it where it stands; ``reason`` is logged."""
        if cid not in self.server.roster or not self._presence.lost(cid):
            return
        logger.warning("server: client %d is lost: %s", cid, reason)
        self._progress.set()

    # -- stages ----------------------------------------------------------------------

    def _waiting_for(self) -> bool:
        """Whether a client the stage expects is not known to be gone (after handling
        the wills and upload slots now due). O(1) while more clients are pending than
        gone, O(pending) after: it runs after every message."""
        now = asyncio.get_running_loop().time()
        for cid, at in self._presence.wills_standing(now, self.timeouts.will_grace):
            logger.info("server: client %d is gone (last will)", cid)
            self._leases.will(cid, at)
        self._reclaim_uploads(now)
        return self._presence.waiting(self.server.pending_count, self.server.pending)

    def _next_wake(self, deadline: float) -> float:
        return min(deadline, self._leases.due,
                   self._presence.next_will(self.timeouts.will_grace))

    # -- flow control of streamed masked inputs ------------------------------------------

    def _grant_uploads(self) -> None:
        """Give free upload slots to clients still expected and not gone, each a lease
        (``UploadLeases.length``: the masked_input deadline, of the round's deadline model,
        shared by the waves of senders the slots take) for its whole stream, in chunks of
        ``chunk_elements``."""
        server = self.server
        now = asyncio.get_running_loop().time()
        for cid in server.grant_uploads(exclude=self.gone,
                                        chunk_elements=self.chunk_elements):
            lease = self._leases.length(server.pending_count, server.upload_slots,
                                        self._deadlines[Stage.MASKED_INPUT.label])
            self._leases.grant(cid, now + lease)
            self._spawn(self._send_grant(cid))

    async def _send_grant(self, cid: int) -> None:
        grant = Grant(self.server.session_id, self.chunk_elements, self.window)
        await publish_framed(self.link, self.topics.downstream(cid, RECEIPT),
                             encode_control(grant), self.max_payload)

    def _reclaim_uploads(self, now: float) -> None:
        """Take back the slots of senders that left (signed off or aborted: a last will
        alone does not count, the connection may come back), idled while a slot is wanted
        or ran out of their lease (``UploadLeases.reclaim``), and grant them to the next
        clients."""

        self._leases.reclaim(now, self.server.is_uploading, self._presence.left_for_good,
                             self._slot_wanted, self._revoke)
        self._grant_uploads()

    def _slot_wanted(self) -> bool:
        """Whether a client still expected waits for an upload slot. The idle limit takes
        a slot back only then: a slot nobody waits for costs the round nothing, and on a
        busy host an honest sender's gaps between chunks outgrow any fixed idle limit
        (all three sites of a federation lost their slots after 7.5 s without a chunk,
        no fault injected). Its lease, and the stage deadline, still bound it. O(gone)
        when a slot is idle, never per message."""
        server = self.server
        gone = sum(1 for cid in self.gone
                   if server.is_pending(cid) and not server.is_uploading(cid))
        return server.pending_count - len(server.uploading) - gone > 0

    def _left(self, cid: int, why: str) -> None:
        """``cid`` is gone for good this stage (signed off, aborted or flooding): the
        stage stops waiting for it and its upload slot, if any, is taken back."""
        self._presence.leave(cid, why)
        self._leases.recheck(cid)

    def _revoke(self, cid: int, reason: str) -> None:
        """Cancel ``cid``'s upload (its pending chunks discarded: they never count) and
        tell it why; the caller grants the slot to the next client."""
        self._leases.forget(cid)
        if self.server.cancel_upload(cid, reason):
            logger.warning("server: client %d dropped at masked_input: %s", cid, reason)
            self._spawn(self._receipt(cid, Receipt(UPLOAD_RECEIPT, False, reason)))

    async def _run_stage(self) -> None:
        loop = asyncio.get_running_loop()
        stage = self.server.stage
        opened = loop.time()
        deadline = opened + self._deadlines[stage.label]
        expected = self.server.pending_count
        deadline_hit = False
        while self._waiting_for():
            if self._failure is not None:
                raise TransportError(str(self._failure)) from self._failure
            remaining = deadline - loop.time()
            if remaining <= 0:
                deadline_hit = True
                logger.info("%s: deadline passed; %d clients did not answer", stage.label,
                            self._presence.missing(self.server.pending))
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
        self._senders.new_stage()
        self._answered = {cid: answered[cid] for cid in out if cid in answered}
        encoded = {cid: (self.server.stage, encode(msg)) for cid, msg in out.items()}
        self._outbox = encoded
        await asyncio.gather(*(self._send(cid) for cid in encoded))
        self._leases.new_stage()
        for cid, digests in self._stream_seen.items():
            self._seen.difference_update((cid, d) for d in digests[:-self.window])
        self._stream_seen.clear()
        self._grant_uploads()
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
        """Read the link (cheap: each delivery is only sorted into its sender's queue) while
        ``_serve_senders`` handles the queues in turn."""
        serve = asyncio.create_task(self._serve_senders(), name="secagg-server-senders")
        try:
            while True:
                event = await self.link.receive()
                if isinstance(event, Reconnected):
                    self._on_reconnected()
                elif isinstance(event, Delivery):
                    self._enqueue(event)
        except LinkLost as exc:
            self._failure = exc
            self._progress.set()
        finally:
            await stop_task(serve)

    def _enqueue(self, event: Delivery) -> None:
        parsed = self.topics.parse_upstream(event.topic)
        if parsed is None:
            self.invalid_payloads += 1
            logger.debug("server: message on unexpected topic %s dropped", event.topic)
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
        full = self._senders.put(cid, kind, event.payload)
        if full is not None:
            self._wasted(cid, full)

    async def _serve_senders(self) -> None:
        """Handle the senders' deliveries in turn (``SenderQueues.take``), yielding to the
        loop between two (the link keeps being read, the stage loop keeps its deadlines)."""
        while True:
            cid, kind, payload = await self._senders.take()
            self._on_delivery(cid, kind, payload)
            await asyncio.sleep(0)

    def _wasted(self, cid: int, why: str) -> None:
        """Count one message of ``cid`` that changed nothing; past ``waste_budget`` this
        stage, its deliveries are dropped unread (logged once)."""
        waste = self._senders.waste(cid)
        if waste == self.waste_budget:
            logger.warning("server: client %d sent %d messages that change nothing in this "
                           "stage (last: %s); its messages are dropped unread until the next "
                           "stage, and the stage does not wait for it", cid, waste, why)
            if self.server.is_pending(cid) and cid not in self.gone:
                self._left(cid, "flooding")  # its answer would be dropped unread anyway
                self._progress.set()

    def _on_reconnected(self) -> None:
        logger.info("server: reconnected; re-publishing the round state")
        self._presence.reconnected()
        if self._control is not None:
            self._spawn(publish_framed(self.link, self.topics.control, self._control,
                                       self.max_payload, retain=True))
        for cid in self.server.pending:
            if cid in self._outbox:
                self._spawn(self._send(cid))
            if self.server.is_uploading(cid):
                self._spawn(self._send_grant(cid))

    def _on_delivery(self, cid: int, kind: str, payload: bytes) -> None:
        stage = stage_of(kind)
        limit = None if stage is not None else MAX_CONTROL_BYTES
        now = asyncio.get_running_loop().time()
        try:
            message = self._reassembler.feed((cid, kind), payload, now, limit, quota=cid)
            self.reassembly_peak = max(self.reassembly_peak,
                                       self._reassembler.charged_bytes)
        except FrameError as exc:
            self.invalid_payloads += 1
            self._wasted(cid, str(exc))
            logger.warning("server: invalid payload from client %d on %s dropped: %s", cid,
                           kind, exc)
            return
        if message is None:
            return
        if stage is None:
            self._on_notice(cid, kind, message.payload)
        else:
            if self._presence.back(cid):  # a will stands for a connection, which came back
                logger.info("server: client %d is back after its last will", cid)
            self._on_client_message(cid, message.digest, message.payload)
        self._progress.set()  # the stage loop re-evaluates (answers, wills, grace timers)

    def _on_notice(self, cid: int, kind: str, payload: bytes) -> None:
        try:
            notice = decode_control(payload)
        except ControlError as exc:
            self.invalid_payloads += 1
            self._wasted(cid, str(exc))
            logger.warning("server: invalid %s notice from client %d dropped: %s", kind, cid,
                           exc)
            return
        if kind == OFFLINE and isinstance(notice, Offline):
            if cid in self.server.roster and self._presence.may_sign_off(cid, notice.final):
                logger.info("server: client %d is offline (%s)", cid, notice.reason)
                if notice.final:  # a sign-off is final, also after a will
                    self._presence.signed_off(cid)
                    self._leases.recheck(cid)
                else:
                    self._presence.will(cid, asyncio.get_running_loop().time())
        elif kind == ABORT and isinstance(notice, ClientAbort):
            if cid in self.server.roster:
                logger.warning("server: client %d aborted: %s", cid, notice.reason)
                self._presence.aborted(cid)
                self._leases.recheck(cid)
                self.client_aborts[cid] = notice.reason
        else:
            self.invalid_payloads += 1
            self._wasted(cid, f"an unexpected {kind} notice")
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
                if self.server.is_uploading(cid):
                    self._spawn(self._send_grant(cid))
            else:
                self._wasted(cid, "its previous message again, answered moments ago")
            return
        if (cid, digest) in self._seen:
            # A duplicate of an accepted message (also after the round finished): confirm.
            self._wasted(cid, "a duplicate")
            self._spawn(self._receipt(cid, Receipt(digest, True)))
            return
        stage = self.server.stage
        uploading = self.server.is_uploading(cid)
        try:
            new = self.server.receive(cid, payload, digest=digest)  # reassembly checked it
        except ProtocolError as exc:
            self.rejected += 1
            if uploading:  # a refused input proof also cancels its upload
                self._leases.recheck(cid)
            self._wasted(cid, "a refused message")
            logger.warning("server: %s", exc)
            # An honest client gives up on its refused message and signs off, which frees
            # its upload slot at once (_reclaim_uploads); a refusal alone does not: the
            # message may be another connection's garbage under its name, not its own
            self._spawn(self._receipt(cid, Receipt(digest, False, str(exc))))
            return
        if not new:  # a redelivery the state machine recognised: confirm it again
            self._wasted(cid, "a duplicate")
            self._spawn(self._receipt(cid, Receipt(digest, True)))
            return
        self._accepted[cid] = digest  # of a stream: its latest chunk
        self._seen.add((cid, digest))
        self._presence.accepted(cid)
        counts = self.bytes_received.setdefault(cid, {})
        counts[stage.label] = counts.get(stage.label, 0) + len(payload)
        if uploading:
            self.chunks += 1
            self._leases.chunk(cid, asyncio.get_running_loop().time())
            self._stream_seen.setdefault(cid, []).append(digest)
        complete = not self.server.is_pending(cid)  # accepted, and not a chunk or proof
        if complete and self.on_message is not None:
            self.on_message(cid, stage)
        self._spawn(self._receipt(cid, Receipt(digest, True)))
        if complete and uploading:
            self._leases.forget(cid)
            self._grant_uploads()  # its slot is free

    async def _receipt(self, cid: int, receipt: Receipt) -> None:
        await publish_framed(self.link, self.topics.downstream(cid, RECEIPT),
                             encode_control(receipt), self.max_payload)
