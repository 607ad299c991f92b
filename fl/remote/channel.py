"""The coordinator's federation link: who is online, announcing rounds, running the server.

One connection (:mod:`fl.remote.link`) carries the federation messages and, per round, the
secure aggregation's server side (``transport.server_driver.ServerDriver`` on the round's view).
Everything here is a coroutine on the coordinator's event loop; the synchronous training
code calls it from its worker thread with ``asyncio.run_coroutine_threadsafe``
(:mod:`fl.remote.coordinator`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from fl.remote.blob import blob_digest
from fl.remote.link import PartyLink, connect_party
from fl.remote.messages import (
    SITE_KINDS,
    Announce,
    CoordinatorOffline,
    Decline,
    Done,
    FedTopics,
    Fetch,
    Hello,
    Ready,
    SiteOffline,
    Waiting,
    WireError,
    coordinator_will,
    decode_site_message,
    framed,
    round_context,
)
from secagg import Config
from secagg.server import AggregateResult, Server
from transport import (
    DEFAULT_MAX_PAYLOAD,
    SERVER_USER,
    Delivery,
    FrameError,
    LinkLost,
    Network,
    Reassembler,
    Reconnected,
    ServerDriver,
    Timeouts,
    Topics,
    TransportError,
    client_will,
    frame,
    new_round_name,
)

from ..errors import FLError

if TYPE_CHECKING:
    from fl.contribution import SecaggBound

logger = logging.getLogger(__name__)
U64 = npt.NDArray[np.uint64]
Log = Callable[[str], None]


def _label(kind: str, round_number: int) -> str:
    return f"round {round_number}" if kind == "train" else "feature scaling"


FETCH_INTERVAL = 2.0
"""Seconds between two answers to one site's fetches (its :class:`Fetch` is repeated while
nothing arrives; see :class:`fl.remote.blob.FetchPacer`)."""
MAX_ANSWERING = 2
"""Fetch answers in flight at once: what the coordinator queues for fetches is at most this
many blobs."""


class NotEnoughSites(FLError, RuntimeError):
    """Fewer than ``threshold`` cohort sites were ready: the round was not started."""


@dataclass
class RemoteRound:
    """One secure aggregation with site processes."""

    result: AggregateResult
    config: Config
    absent: dict[int, str]
    inputs: dict[int, U64] | None
    bytes_received: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0


class CoordinatorChannel:
    """``async with CoordinatorChannel(...) as channel``: connected, sites' hellos heard."""

    def __init__(self, network: Network, federation: str, site_ids: Sequence[int],
                 log: Log, *, max_input_bytes: int = 64 << 20,
                 max_payload: int = DEFAULT_MAX_PAYLOAD,
                 verify_keys: Mapping[int, bytes] | None = None) -> None:
        self.network = network
        # The sites' public keys (--peer-keys, fl/site/identity.py): rounds then run in secagg's
        # malicious mode (signed messages, consistency check; round_stages has the schedule).
        self.verify_keys = dict(verify_keys) if verify_keys else None
        self.security = "semi-honest" if self.verify_keys is None else "malicious"
        self.federation = federation
        self.topics = FedTopics(federation)
        self.site_ids = frozenset(site_ids)
        self.log = log
        self.max_input_bytes = max_input_bytes
        self.max_payload = max_payload
        self.run_id = os.urandom(16)
        self.hellos: dict[int, Hello] = {}
        self.invalid: dict[int, str] = {}
        """Site -> why its latest unreadable message was refused (said if it never joins)."""
        self.offline: set[int] = set()
        self.readies: dict[int, Ready] = {}
        self.declines: dict[int, str] = {}
        self.features: tuple[str, ...] | None = None
        self.changed = asyncio.Event()
        self._key: tuple[bytes, int, int, str] | None = None
        self._round: Topics | None = None
        self._blob = b""
        self._digest = b""
        self._answered: dict[int, float] = {}  # site -> when its last Fetch was answered
        self._answering: set[int] = set()  # sites whose answer is being published
        self.blob_answers = 0
        """Fetches answered (each with one blob, to the one site that asked)."""
        self._control: bytes | None = None
        self._party: PartyLink | None = None
        self._stack = contextlib.AsyncExitStack()
        self._reassembler = Reassembler((1 << 20) + max_input_bytes, max_partial=2)
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def lost(self) -> LinkLost | None:
        return None if self._party is None else self._party.lost

    async def __aenter__(self) -> CoordinatorChannel:
        try:
            party = await self._stack.enter_async_context(connect_party(
                self.network, SERVER_USER, coordinator_will(self.topics)))
            self._party = party
            await party.subscribe(self.topics.fed.server_filter)
            # Retained: replaces what an earlier run left (a Done would send the sites home).
            await self._publish_control(framed(Waiting(self.run_id)))
            self._spawn(self._listen(party))
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        await self._stack.aclose()

    async def _publish_control(self, payload: bytes) -> None:
        assert self._party is not None
        self._control = payload
        await self._party.publish(self.topics.control, payload, retain=True)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- receiving ----------------------------------------------------------------------
    async def _listen(self, party: PartyLink) -> None:
        while True:
            try:
                event = await party.receive()
            except LinkLost:
                self.changed.set()
                return
            if isinstance(event, Reconnected):
                # Nothing survives a broker restart without persistence: re-publish.
                if self._control is not None:
                    self._spawn(party.publish(self.topics.control, self._control, retain=True))
                if self._blob:
                    self._spawn(self._broadcast())
            elif isinstance(event, Delivery) and event.payload:
                try:
                    self._on_delivery(event)
                except (WireError, FrameError) as exc:
                    logger.warning("coordinator: invalid message on %s dropped: %s",
                                   event.topic, exc)

    def _on_delivery(self, event: Delivery) -> None:
        parsed = self.topics.fed.parse_upstream(event.topic)
        if parsed is None or parsed[0] not in SITE_KINDS:
            logger.debug("coordinator: message on %s (a closed round) dropped", event.topic)
            return
        kind, cid = parsed
        if cid not in self.site_ids:
            logger.warning("coordinator: site %d is not in --sites; message dropped", cid)
            return
        now = asyncio.get_running_loop().time()
        try:
            got = self._reassembler.feed((cid, kind), event.payload, now)
            if got is None:
                return
            message = decode_site_message(got.payload, kind, cid, self.max_input_bytes)
        except (WireError, FrameError) as exc:
            self.invalid[cid] = f"its {kind} message was refused: {exc}"
            raise
        if isinstance(message, Hello):
            if self.features is not None and message.features != self.features:
                self.log(f"site {cid}: its columns differ from the federation's; ignored")
                return
            if cid not in self.hellos or cid in self.offline:
                self.log(f"site {cid} is online")
            self.invalid.pop(cid, None)
            self.hellos[cid] = message
            self.offline.discard(cid)
        elif isinstance(message, SiteOffline):
            if cid not in self.offline:
                self.log(f"site {cid} went offline ({message.reason})")
            self.offline.add(cid)
            if self._round is not None and self._party is not None:
                # The site's one will stands for its secagg client too.
                will = client_will(self._round, cid)
                self._party.to_round(Delivery(will.topic, will.payload))
        elif isinstance(message, Fetch):
            if message.blob == self._digest and self._blob:
                self._answer_fetch(cid, now)
        elif isinstance(message, Decline) and message.key == self._key:
            self.log(f"site {cid} declined {_label(message.kind, message.round)}: "
                     f"{message.reason}")
            self.declines[cid] = message.reason
        elif (isinstance(message, Ready) and message.key == self._key
              and message.blob == self._digest):
            self.readies[cid] = message
            self.offline.discard(cid)
        self.changed.set()

    async def _broadcast(self) -> None:
        """The current blob to every site at once, chunked: once a round, and again after
        a reconnection (nothing survives a broker restart)."""
        assert self._party is not None
        for data in frame(self._blob, self.max_payload):
            await self._party.publish(self.topics.model, data)

    def _answer_fetch(self, cid: int, now: float) -> None:
        """Site ``cid`` missed (part of) the blob: send it to ``cid`` alone, never to the
        others (a site on a slow link once made every fetch a blob for every site). At most
        one answer per site in flight and one per ``FETCH_INTERVAL`` seconds, and at most
        ``MAX_ANSWERING`` answers in flight at once: what is queued for fetches is bounded
        by ``MAX_ANSWERING`` blobs, however many sites ask how often; an unanswered site
        asks again later (:class:`fl.remote.blob.FetchPacer`)."""
        if (cid in self._answering or len(self._answering) >= MAX_ANSWERING
                or now - self._answered.get(cid, -1e9) < FETCH_INTERVAL):
            logger.debug("coordinator: site %d's fetch not answered now (one is under way "
                         "or was just sent)", cid)
            return
        self._answering.add(cid)
        self._answered[cid] = now
        self.blob_answers += 1
        self._spawn(self._send_blob(cid, self._blob))

    async def _send_blob(self, cid: int, blob: bytes) -> None:
        assert self._party is not None
        try:
            for data in frame(blob, self.max_payload):
                if blob is not self._blob:  # the round moved on
                    return
                await self._party.publish(self.topics.model_to(cid), data)
        finally:
            self._answering.discard(cid)
            self._answered[cid] = asyncio.get_running_loop().time()

    async def _wait(self, deadline: float) -> None:
        self.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(),
                                   max(0.0, deadline - asyncio.get_running_loop().time()))

    # -- the coordinator's requests ------------------------------------------------------
    async def wait_online(self, sites: Sequence[int], timeout: float, *,
                          least: float = 1.0) -> None:
        """Before a retry: wait ``timeout`` seconds, or less once every one of ``sites`` is
        online (its Hello heard, no last will since) and ``least`` seconds have passed, so a
        retry neither races sites that are restarting nor waits for ones that are back."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + timeout
        while loop.time() < deadline and self.lost is None:
            if loop.time() - start >= least and all(
                    c in self.hellos and c not in self.offline for c in sites):
                return
            await self._wait(min(deadline, max(loop.time() + 0.05, start + least)))

    async def wait_for_sites(self, timeout: float, enough: int) -> dict[int, Hello]:
        """Hellos until every site said one, or ``timeout`` (then at least ``enough``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while set(self.hellos) != self.site_ids and loop.time() < deadline:
            if self.lost is not None:
                raise TransportError(str(self.lost))
            await self._wait(deadline)
        if len(self.hellos) < enough:
            missing = sorted(self.site_ids - set(self.hellos))
            why = "; ".join(f"site {c}: " + self.invalid.get(
                c, "nothing heard (is it running, with this --federation and broker?)")
                for c in missing[:10])
            raise NotEnoughSites(f"only {len(self.hellos)} of {len(self.site_ids)} sites "
                                 f"came online within {timeout:.0f} s; need {enough} ({why})")
        return dict(self.hellos)

    async def run_round(self, *, kind: str, round_number: int, attempt: int, blob: bytes,
                        cohort: Sequence[int], threshold: int, dim: int, bits: int,
                        verify: bool, ready_timeout: float, timeouts: Timeouts,
                        bound: SecaggBound = (None, None)) -> RemoteRound:
        """Announce, collect Ready, then run the secagg server over the ready sites.
        ``bound``: input validation's ``Config`` fields (:func:`fl.contribution.secagg_bound`)."""
        loop = asyncio.get_running_loop()
        assert self._party is not None
        digest = blob_digest(blob)
        topics = Topics(new_round_name())
        ann = Announce(self.run_id, round_number, attempt, kind, topics.round_name,
                       tuple(sorted(cohort)), digest, len(blob), "open", (), threshold, verify,
                       self.security)
        self._key, self._blob, self._digest = ann.key, blob, digest
        self.readies, self.declines = {}, {}
        async with self._party.round(topics) as view:
            self._round = topics
            try:
                await view.subscribe(topics.server_filter)
                await self._publish_control(framed(ann))
                await self._broadcast()
                deadline = loop.time() + ready_timeout
                while loop.time() < deadline and self.lost is None:
                    if all(c in self.readies or c in self.offline or c in self.declines
                           for c in cohort):
                        break
                    await self._wait(deadline)
                if self.lost is not None:
                    raise TransportError(f"the federation link is lost: {self.lost}")
                roster = tuple(sorted(c for c in cohort if c in self.readies))
                absent = {c: "declined" if c in self.declines else "absent"
                          for c in cohort if c not in roster}
                if len(roster) < threshold:
                    raise NotEnoughSites(f"{len(roster)} of {len(cohort)} sites were ready "
                                         f"(absent: {sorted(absent)}); the threshold is "
                                         f"{threshold}")
                config = Config(num_clients=len(roster), threshold=threshold, dim=dim,
                                bits=bits, security=self.security, norm_bound=bound[0],
                                weight_index=bound[1])
                go = replace(ann, phase="go", roster=roster)
                server = Server(config, roster=roster, verify_keys=self.verify_keys,
                                context=round_context(self.federation, go))
                await self._publish_control(framed(go))
                driver = ServerDriver(server, view, topics, timeouts=timeouts,
                                      max_payload=self.max_payload)
                started = loop.time()
                result = await driver.run()
            finally:
                self._round = None
        inputs: dict[int, U64] | None = None
        if verify:
            inputs = {}
            for cid in roster:
                raw = self.readies[cid].input
                if raw is not None and len(raw) == 8 * dim:
                    inputs[cid] = np.frombuffer(raw, dtype="<u8").astype(np.uint64)
        return RemoteRound(result, config, absent, inputs,
                           {c: sum(v.values()) for c, v in driver.bytes_received.items()},
                           loop.time() - started)

    async def finish(self, rounds: int, reason: str, *, linger: float = 10.0) -> None:
        """Tell the sites the run is over, only when it is (retained: a site reconnecting
        learns it too), wait up to ``linger`` seconds for the online sites to sign off,
        then clear the retained message: nothing of this run outlives it (a site started
        later for the next run would read an old Done and exit)."""
        self._blob = b""
        await self._publish_control(framed(Done(self.run_id, rounds, reason)))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + linger
        while (set(self.hellos) - self.offline and self.lost is None
               and loop.time() < deadline):
            await self._wait(deadline)
        await self._clear_control()

    async def pause(self, reason: str) -> None:
        """The run stopped without finishing (a failure, a full checkpoint disk): the sites
        are told the coordinator is away, never that the run is over, and wait for its
        ``--resume`` (or a new run) within their ``--idle-timeout``."""
        self._blob = b""
        await self._publish_control(framed(CoordinatorOffline(reason[:1000])))

    async def _clear_control(self) -> None:
        assert self._party is not None
        self._control = None
        await self._party.publish(self.topics.control, b"", retain=True)
