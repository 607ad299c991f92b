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
from typing import Any

import numpy as np
import numpy.typing as npt

from fl.remote.blob import blob_digest
from fl.remote.link import PartyLink, connect_party
from fl.remote.messages import (
    SITE_KINDS,
    Announce,
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
from transport.drivers import Timeouts, client_will
from transport.errors import TransportError
from transport.framing import DEFAULT_MAX_PAYLOAD, FrameError, Reassembler, frame
from transport.link import Delivery, LinkLost, Network, Reconnected
from transport.rounds import new_round_name
from transport.server_driver import ServerDriver
from transport.topics import SERVER_USER, Topics

from ..errors import FLError

logger = logging.getLogger(__name__)
U64 = npt.NDArray[np.uint64]
Log = Callable[[str], None]


def _label(kind: str, round_number: int) -> str:
    return f"round {round_number}" if kind == "train" else "feature scaling"


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
        self.offline: set[int] = set()
        self.readies: dict[int, Ready] = {}
        self.declines: dict[int, str] = {}
        self.features: tuple[str, ...] | None = None
        self.changed = asyncio.Event()
        self._key: tuple[bytes, int, int, str] | None = None
        self._round: Topics | None = None
        self._blob = b""
        self._digest = b""
        self._broadcast_at = -1e9
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
                    self._spawn(self._broadcast(force=True))
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
        got = self._reassembler.feed((cid, kind), event.payload, now)
        if got is None:
            return
        message = decode_site_message(got.payload, kind, cid, self.max_input_bytes)
        if isinstance(message, Hello):
            if self.features is not None and message.features != self.features:
                self.log(f"site {cid}: its columns differ from the federation's; ignored")
                return
            if cid not in self.hellos or cid in self.offline:
                self.log(f"site {cid} is online")
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
                self._spawn(self._broadcast())
        elif isinstance(message, Decline) and message.key == self._key:
            self.log(f"site {cid} declined {_label(message.kind, message.round)}: "
                     f"{message.reason}")
            self.declines[cid] = message.reason
        elif (isinstance(message, Ready) and message.key == self._key
              and message.blob == self._digest):
            self.readies[cid] = message
            self.offline.discard(cid)
        self.changed.set()

    async def _broadcast(self, force: bool = False) -> None:
        """The current blob to every site at once, chunked (at most twice a second)."""
        loop = asyncio.get_running_loop()
        if not force and loop.time() - self._broadcast_at < 0.5:
            return
        self._broadcast_at = loop.time()
        assert self._party is not None
        for data in frame(self._blob, self.max_payload):
            await self._party.publish(self.topics.model, data)

    async def _wait(self, deadline: float) -> None:
        self.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(),
                                   max(0.0, deadline - asyncio.get_running_loop().time()))

    # -- the coordinator's requests ------------------------------------------------------
    async def wait_for_sites(self, timeout: float, enough: int) -> dict[int, Hello]:
        """Hellos until every site said one, or ``timeout`` (then at least ``enough``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while set(self.hellos) != self.site_ids and loop.time() < deadline:
            if self.lost is not None:
                raise TransportError(str(self.lost))
            await self._wait(deadline)
        if len(self.hellos) < enough:
            raise NotEnoughSites(f"only {len(self.hellos)} of {len(self.site_ids)} sites "
                                 f"came online within {timeout:.0f} s; need {enough}")
        return dict(self.hellos)

    async def run_round(self, *, kind: str, round_number: int, attempt: int, blob: bytes,
                        cohort: Sequence[int], threshold: int, dim: int, bits: int,
                        verify: bool, ready_timeout: float, timeouts: Timeouts
                        ) -> RemoteRound:
        """Announce, collect Ready, then run the secagg server over the ready sites."""
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
                await self._broadcast(force=True)
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
                                bits=bits, security=self.security)
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

    async def finish(self, rounds: int, reason: str) -> None:
        """Tell the sites the run is over (retained: a site that reconnects learns it too)."""
        self._blob = b""
        await self._publish_control(framed(Done(self.run_id, rounds, reason)))
