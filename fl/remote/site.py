"""The site role: a hospital's process follows the coordinator's rounds with its own data.

It connects once (its federation-level last will), says :class:`Hello`, and for every round
it is in: fetches the announced blob (verified by its SHA-256), joins the round and computes
its input in its site session (:func:`fl.remote.inputs.site_round`, in a worker thread;
:mod:`fl.site.session`), answers :class:`Ready`, and on ``go`` has the session build the
round's client and runs a ``transport.client_driver.ClientDriver`` on it over the round's
view of the same connection; the session ends the round. Its records never leave the
process; only the masked vector does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dp import MODE_NONE, LedgerWriteError, PrivacyError
from fl.codec import EncodingOverflow
from fl.contribution import TaskError
from fl.remote.blob import Blob, FetchPacer, blob_digest
from fl.remote.inputs import SiteData, round_bound, site_round
from fl.remote.link import PartyLink, connect_party
from fl.remote.messages import (
    DECLINE,
    FETCH,
    HELLO,
    OFFLINE,
    READY,
    Announce,
    CoordinatorOffline,
    Decline,
    Done,
    FedTopics,
    Fetch,
    Hello,
    Ready,
    SiteOffline,
    WireError,
    decode_coordinator_message,
    encode_message,
    framed,
    get_int,
    round_context,
    site_will,
)
from fl.site.core import SiteCore
from fl.site.session import Admitted, SiteSession
from secagg import Config
from secagg.client import Client
from transport import (
    DEFAULT_MAX_PAYLOAD,
    ClientDriver,
    Delivery,
    FrameError,
    LinkLost,
    Network,
    Offline,
    Reassembler,
    Reconnected,
    Topics,
    encode_control,
    frame,
    publish_framed,
    round_timeouts,
    site_name,
)

logger = logging.getLogger(__name__)
Log = Callable[[str], None]

READY_PACE = 1.0
"""Seconds between two Readies of one round (:meth:`SiteProcess._go`): a re-send that a
reconnection or a control message heard again asks for waits for it, so a coordinator (or
the broker) that delivers control messages without end sets no publish rate of the site's
(tests/security/test_review_session_ready_resend.py)."""

RUNS_KEPT = 64
"""Coordinator runs a site remembers (:attr:`SiteProcess.runs`, the latest; ``_follow``
keeps as many announcements): a control topic that names a fresh run in every message costs
the site constant memory (tests/security/test_review_session_hello_flood.py)."""


@dataclass(kw_only=True)
class SiteOptions:
    guard: SiteCore
    """The site's core: its operator's privacy policy and ledger (:class:`fl.site.core.SiteCore`,
    every check of it runs in this role). Mandatory: there is no site without one (a missing
    ``guard`` is a ``TypeError``, anything but a ``SiteCore`` a ``ValueError``)."""
    federation: str = "fl"
    insecure_verify: bool = False
    require_dp: str | None = None
    idle_timeout: float = 1800.0
    """Exit (status 1) after this long without hearing from the coordinator (a repeat of its
    last control message, as a reconnection re-delivers it, is not hearing): it also ends
    the wait for a round's blob or ``go`` and a round in progress."""
    round_timeout: float = 600.0
    """Give up waiting for a round's ``go`` (or its blob) after this long."""
    stage_timeout: float = 60.0
    max_payload: int = DEFAULT_MAX_PAYLOAD
    identity: Any = None
    """The site's key and its operator's federation roster (:class:`fl.site.identity.SiteIdentity`):
    rounds run in secagg's malicious mode with the peers' keys from the site's own directory,
    and a cohort or roster naming a site without a key is refused. Without it the roster is
    the coordinator's word and the guard charges as if this site's noise were the only noise
    (docs/privacy.md section 1)."""

    def __post_init__(self) -> None:
        if not isinstance(self.guard, SiteCore):
            raise ValueError("a site runs with its site core (SiteOptions.guard: its "
                             "operator's policy and ledger, fl.site.core.open_site_core); "
                             "there is no site without one")


class SiteProcess:
    """A hospital's process: follows the coordinator's announcements until it says done."""

    def __init__(self, data: SiteData, network: Network, options: SiteOptions,
                 log: Log) -> None:
        self.data = data
        self.site_id = data.site_id
        self.name = site_name(data.site_id)
        self.options = options
        self.guard: SiteCore = options.guard
        if options.insecure_verify and set(self.guard.policy.modes) - {MODE_NONE}:
            raise ValueError(
                "--insecure-verify sends this site's input in the clear, and a DP "
                "site's input carries only its own share of the noise its ledger "
                f"charges (policy modes {list(self.guard.policy.modes)}): drop "
                "--insecure-verify, or run the test with --dp none on both sides")
        # the charge follows how the roster is authenticated
        self.guard.authenticated_roster = options.identity is not None
        self.session = SiteSession(core=self.guard, runtime="site", log=log)
        """The site session (:mod:`fl.site.session`, the code the Flower and NVFlare sites
        run): join and admit (:func:`fl.remote.inputs.site_round`), the round's client
        (:meth:`_take_part` at ``go``) and its end (:meth:`_ended`)."""
        self.topics = FedTopics(options.federation)
        self.network = network
        self.log = log
        self.announce: Announce | None = None
        self.done: Done | None = None
        self.runs: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        """The last :data:`RUNS_KEPT` coordinator runs heard (the finished one kept)."""
        self._hello_at = -math.inf  # loop.time() of the last Hello said for a new run
        self._hello_later: asyncio.Task[None] | None = None  # a paced Hello, not yet said
        self.blobs: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self.fetch = FetchPacer()
        self.changed = asyncio.Event()
        self.heard_at = 0.0
        """``loop.time()`` of the last news on the federation's topics (a control message
        that is not a repeat of the last one, a frame of a blob); :meth:`_heard` adds the
        round's own traffic."""
        self.rounds = 0
        self._party: PartyLink | None = None
        self._taking: Announce | None = None  # the round _take_part is in
        self._last_control = b""  # digest of the last control message
        self._reheard = 0
        """Counts this site's reconnections and every control message it is delivered,
        repeats included: a site waiting for ``go`` says Ready again when it moves (a broker
        restarted without persistence forgets the coordinator's subscription, and a Ready
        published before the coordinator subscribes again reaches no one)."""
        self._run: bytes = b""
        self._control = Reassembler(1 << 20, max_partial=2)
        self._model = Reassembler(256 << 20, max_partial=2)

    async def run(self) -> int:
        """0 when the coordinator said done, 1 when it stayed silent for ``idle_timeout``
        or the broker was lost."""
        loop = asyncio.get_running_loop()
        self.heard_at = loop.time()
        async with connect_party(self.network, self.name,
                                 site_will(self.topics, self.site_id)) as party:
            self._party = party
            await party.subscribe(self.topics.control)
            await party.subscribe(self.topics.model)
            await party.subscribe(self.topics.model_filter(self.site_id))  # fetch answers
            listener = asyncio.create_task(self._listen(party), name="fl-site-listen")
            try:
                await self._hello()
                self.log(f"connected as {self.name}; waiting for the coordinator "
                         f"(federation {self.options.federation!r})")
                return await self._follow(loop)
            finally:
                if self._hello_later is not None:
                    self._hello_later.cancel()
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listener
                with contextlib.suppress(Exception):
                    await party.publish(self.topics.upstream(self.site_id, OFFLINE),
                                        framed(SiteOffline("site exited")))

    async def _follow(self, loop: asyncio.AbstractEventLoop) -> int:
        assert self._party is not None
        # The announcements already acted on; only the latest few can come again (a
        # reconnection re-delivers the retained one), so a long run keeps 64, not all.
        handled: collections.OrderedDict[tuple[bytes, int, int, str], None] = (
            collections.OrderedDict())
        while True:
            if self._party.lost is not None:
                self.log(f"lost the broker: {self._party.lost}")
                return 1
            if self.done is not None and self.done.run in self.runs:
                self.log(f"the coordinator finished after {self.done.rounds} rounds"
                         + (f" ({self.done.reason})" if self.done.reason else "")
                         + f"; this site took part in {self.rounds} secure aggregations "
                         "(the training rounds it joined, plus one for the feature "
                         "statistics when the run scales features by a secure sum)")
                return 0
            ann = self.announce
            if ann is not None and ann.key not in handled:
                handled[ann.key] = None
                while len(handled) > 64:
                    handled.popitem(last=False)
                if self.site_id not in ann.cohort:
                    self.log(f"round {ann.round}: not in this round's cohort")
                elif ann.phase == "open":
                    self._taking = ann
                    try:
                        await self._take_part(ann)
                    finally:
                        self._taking = None
                continue
            # A round that gave up on a silent coordinator does not restart the idle clock:
            # it runs from the last word heard, in the round or out of it.
            silent = loop.time() - self._heard()
            if silent >= self.options.idle_timeout:
                self.log(f"no word from the coordinator for {silent:.0f} s; giving up")
                return 1
            await self._changed(self.options.idle_timeout - silent)

    def _heard(self) -> float:
        """When this site last heard from the coordinator: on the federation's topics, or
        from the round's server (``PartyLink.round_heard_at``)."""
        party = self._party.round_heard_at if self._party is not None else 0.0
        return max(self.heard_at, self.fetch.heard_at, party)

    def _stop_waiting(self, started: float) -> bool:
        """Whether a wait for a round's blob or ``go`` begun at ``started`` ends: the round
        moved on (:meth:`_superseded` is the caller's), the broker is lost, the wait
        reached ``round_timeout``, or the coordinator has been silent for ``idle_timeout``
        (counted from the wait's start at the earliest: the site's own computation before
        it is not the coordinator's silence)."""
        now = asyncio.get_running_loop().time()
        return ((self._party is not None and self._party.lost is not None)
                or now - started > self.options.round_timeout
                or now - max(started, self._heard()) >= self.options.idle_timeout)

    async def _changed(self, timeout: float) -> None:
        self.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout)

    async def _hello(self) -> None:
        assert self._party is not None
        # chunked like any message: 20,000 column names are over a broker's packet limit
        await publish_framed(self._party, self.topics.upstream(self.site_id, HELLO),
                             encode_message(Hello(self.site_id, self.data.schema.features,
                                                  self._run)), self.options.max_payload)

    # -- receiving ----------------------------------------------------------------------
    async def _listen(self, party: PartyLink) -> None:
        loop = asyncio.get_running_loop()
        while True:
            idle = self.options.idle_timeout
            try:
                event = await party.receive(max(0.5, idle - (loop.time() - self._heard())))
            except LinkLost:
                self.changed.set()
                return
            if event is None:
                silent = loop.time() - self._heard()
                if silent >= idle:  # even inside a round: idle_timeout bounds every wait
                    party.end_round(f"no word from the coordinator for {silent:.0f} s")
                    self.changed.set()
                continue
            if isinstance(event, Reconnected):
                self._reheard += 1
                self.changed.set()
                await self._hello()
            elif isinstance(event, Delivery) and event.payload:
                try:
                    await self._on_delivery(event)
                except (WireError, FrameError) as exc:
                    logger.warning("site %d: invalid message on %s dropped: %s",
                                   self.site_id, event.topic, exc)

    async def _on_delivery(self, event: Delivery) -> None:
        now = asyncio.get_running_loop().time()
        if event.topic in (self.topics.model, self.topics.model_to(self.site_id)):
            self.fetch.heard(now)
            got = self._model.feed("model", event.payload, now)
            if got is not None:
                self.blobs[got.digest] = got.payload
                while len(self.blobs) > 2:
                    self.blobs.popitem(last=False)
                self.changed.set()
            return
        if event.topic != self.topics.control:
            logger.debug("site %d: message on %s (a closed round) dropped", self.site_id,
                         event.topic)
            return
        got = self._control.feed("control", event.payload, now)
        if got is None:
            return
        message = decode_coordinator_message(got.payload)
        self._reheard += 1
        if got.digest != self._last_control:
            # a retained message again (each reconnection re-delivers it; a coordinator
            # re-publishes it after one) is no news: a site whose connection keeps
            # failing still reaches its idle limit
            self._last_control = got.digest
            self.heard_at = now
        if isinstance(message, CoordinatorOffline):
            self.log(f"the coordinator went offline ({message.reason}); waiting for it")
            if self._party is not None and self.announce is not None:
                # The coordinator's one will stands for its round's server too.
                topics = Topics(self.announce.name)
                self._party.to_round(Delivery(topics.control, frame(encode_control(Offline(
                    "the aggregation server disconnected", final=False)))[0]))
            return
        run = message.run
        if run not in self.runs:
            self.runs[run] = None
            if len(self.runs) > RUNS_KEPT:  # the oldest goes; a finished run stays
                oldest = next(iter(self.runs))
                if self.done is not None and oldest == self.done.run:
                    self.runs.move_to_end(oldest)
                    oldest = next(iter(self.runs))
                del self.runs[oldest]
            self._run = run
            if not isinstance(message, Done):
                await self._hello_new_run(now)  # a new coordinator run: say we are here
        if isinstance(message, Done):
            self.done = message
        else:
            self.announce = message if isinstance(message, Announce) else self.announce
        taking = self._taking
        if taking is not None and self._party is not None and self._superseded(taking):
            # The coordinator left that round: a driver still in it (its round end lost
            # with a restarted broker) stops now, not after its give-up time.
            self._party.end_round("the coordinator moved on; the round is over")
        self.changed.set()

    async def _hello_new_run(self, now: float) -> None:
        """Say Hello for a new coordinator run: at once when the last one for a new run is
        :data:`READY_PACE` old, else once when the pace allows, naming the latest run then
        (``_run``): a control topic that names a fresh run in every message gets at most one
        Hello per :data:`READY_PACE` (each carries the whole column list)."""
        if self._hello_later is not None:
            return  # a Hello is due; it names the latest run when it goes
        due = self._hello_at + READY_PACE - now
        if due <= 0:
            self._hello_at = now
            await self._hello()
            return

        async def later() -> None:
            await asyncio.sleep(due)
            self._hello_at = asyncio.get_running_loop().time()
            self._hello_later = None
            if self._party is not None and self._party.lost is None:
                with contextlib.suppress(LinkLost):  # as a Hello the broker lost
                    await self._hello()

        self._hello_later = asyncio.create_task(later(), name="fl-site-hello")

    # -- one round ----------------------------------------------------------------------
    def _superseded(self, ann: Announce) -> bool:
        current = self.announce
        return (self.done is not None and self.done.run in self.runs) or (
            current is not None and current.key != ann.key)

    async def _blob(self, ann: Announce) -> bytes | None:
        """The announced blob (verified by its SHA-256), asking for it again (to this site
        alone, paced by :class:`fl.remote.blob.FetchPacer`) while none of it arrives; None
        if the round moved on or it never came."""
        assert self._party is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.fetch.start(started)
        while ann.blob not in self.blobs:
            if self._superseded(ann) or self._stop_waiting(started):
                return None
            if self.fetch.due(loop.time()):
                await self._party.publish(self.topics.upstream(self.site_id, FETCH),
                                          framed(Fetch(ann.blob)))
            await self._changed(min(1.0, self.fetch.wait(loop.time())))
        data = self.blobs[ann.blob]
        if len(data) != ann.size or blob_digest(data) != ann.blob:
            raise WireError("the blob does not match its announcement")
        return data

    async def _go(self, ann: Announce, ready: bytes) -> Announce | None:
        """Say ``ready`` and wait for the round's ``go``; say it again after a reconnection
        or a control message heard again (see ``_reheard``): the coordinator keeps one Ready
        per site, so a repeat costs it nothing. A re-send waits for :data:`READY_PACE`
        since the last Ready: whatever the bus delivers, a wait of ``w`` seconds publishes
        at most ``1 + w / READY_PACE`` Readies."""
        assert self._party is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        said, said_at = -1, -math.inf
        while True:
            current = self.announce
            if current is not None and current.key == ann.key and current.phase == "go":
                return current
            if self._superseded(ann) or self._stop_waiting(started):
                return None
            due = said_at + READY_PACE - loop.time()
            if said != self._reheard and due <= 0:
                said, said_at = self._reheard, loop.time()
                await publish_framed(self._party, self.topics.upstream(self.site_id, READY),
                                     ready, self.options.max_payload)
            await self._changed(1.0 if said == self._reheard else min(1.0, max(due, 0.0)))

    async def _decline(self, ann: Announce, label: str, reason: str) -> None:
        self.log(f"{label}: refusing the round: {reason}")
        assert self._party is not None
        await self._party.publish(self.topics.upstream(self.site_id, DECLINE), framed(
            Decline(ann.run, ann.round, ann.attempt, ann.kind, reason[:1000])))

    def _ended(self, admitted: Admitted, clear: bytes | None, client: Client | None,
               reason: str) -> None:
        """The admitted round ended for this site: the site session's end
        (:meth:`fl.site.session.SiteSession.end`, the code every runtime runs) withdraws its
        charge when its masked input never existed (``client`` None: it never advertised),
        never when the input went out in the clear for --insecure-verify."""
        if clear is None:
            self.session.end(admitted, client, reason)

    def _check_roster(self, ann: Announce, ids: tuple[int, ...], what: str) -> None:
        """With the operator's peer keys: only malicious-mode rounds whose ``ids`` all have a
        key in this site's own directory, and at least the policy's ``min_threshold`` of
        them (raises :class:`WireError` naming the rule; fl/site/identity.py)."""
        identity = self.options.identity
        if identity is None:
            return
        from fl.site.identity import RosterRefused, check_roster

        try:
            if ann.security != "malicious":
                raise RosterRefused("peer_keys", f"the round runs secure aggregation in "
                                    f"{ann.security} mode; with --peer-keys this site takes "
                                    "part only in authenticated (malicious-mode) rounds")
            check_roster(ids, identity.peers, what=what,
                         min_sites=self.guard.ledger.policy.min_threshold)
        except RosterRefused as exc:
            raise WireError(str(exc)) from None

    async def _take_part(self, ann: Announce) -> None:
        label = f"round {ann.round}" if ann.kind == "train" else "feature scaling"
        try:
            self._check_roster(ann, ann.cohort, "cohort")  # before anything is charged
            data = await self._blob(ann)
            if data is None:
                self.log(f"{label}: the model never arrived; skipping")
                return
            blob = Blob.decode(data)
            if blob.kind != ann.kind:
                raise WireError(f"a {blob.kind} blob announced as {ann.kind}")
            started = time.perf_counter()
            admitted, vector = await asyncio.to_thread(
                site_round, self.data, blob, ann, require_dp=self.options.require_dp,
                session=self.session)
        except (WireError, TaskError, EncodingOverflow) as exc:  # rules, no data in them
            await self._decline(ann, label, str(exc))
            return
        except LedgerWriteError as exc:  # a full ledger disk: one line a round, no traceback
            self.log(f"{label}: {exc}")
            await self._decline(ann, label, "the site cannot write its privacy ledger; it "
                                "releases nothing until it can")
            return
        except Exception as exc:  # e.g. torch on a hostile model: refuse, do not crash
            # the text may carry numbers of this site's data: it stays in the site's log
            logger.exception("site %d: computing the input failed", self.site_id)
            self.log(f"{label}: computing the input failed: {type(exc).__name__}: {exc}")
            await self._decline(ann, label, f"the site could not compute its input "
                                f"({type(exc).__name__}; the details are in its own log)")
            return
        trained = time.perf_counter() - started
        assert self._party is not None
        topics = Topics(ann.name)
        async with self._party.round(topics) as view:
            await view.subscribe(topics.client_filter(self.site_id))
            await view.subscribe(topics.control)
            clear = vector.astype("<u8").tobytes() if (
                self.options.insecure_verify and ann.verify) else None
            ready = encode_message(Ready(ann.run, ann.round, ann.attempt, ann.kind, ann.blob,
                                         clear))
            go = await self._go(ann, ready)
            if go is None or self.site_id not in go.roster or go.blob != ann.blob:
                self._ended(admitted, clear, None, "not in the round's roster")
                self.log(f"{label}: not in the round's roster; sitting it out")
                return
            identity = self.options.identity
            try:
                self._check_roster(go, go.roster, "roster")
                self.guard.check_go(ann.key, go.threshold)
                self.guard.check_protocol(
                    num_clients=len(go.roster), threshold=go.threshold, neighbors=None,
                    security=go.security)
                bound, weight = round_bound(blob, int(vector.size))
                config = Config(num_clients=len(go.roster), threshold=go.threshold,
                                dim=int(vector.size), bits=get_int(blob.task, "bits", 8, 64),
                                security=go.security, norm_bound=bound, weight_index=weight)
                client = self.session.client(
                    self.site_id, vector, config=config, roster=go.roster,
                    context=round_context(self.options.federation, go),
                    identity=None if identity is None else {
                        "signing_key": identity.signing_key,
                        "verify_keys": identity.verify_keys(go.roster)})
            except (ValueError, PrivacyError) as exc:
                self._ended(admitted, clear, None, f"refused at go: {exc}")
                await self._decline(ann, label, str(exc))
                return
            driver = ClientDriver(client, view, topics,
                                  timeouts=round_timeouts(
                                      self.options.stage_timeout, clients=config.num_clients,
                                      dim=config.dim, malicious=config.malicious,
                                      validated=config.norm_bound is not None),
                                  max_payload=self.options.max_payload)
            outcome = await driver.run()  # e.g. a peer's signature failed before masking
            self._ended(admitted, clear, client, f"the round ended ({outcome.status}) before this "
                        "site's masked input existed")
        if outcome.status == "done":
            self.rounds += 1
            if ann.kind == "train":
                self.data.commit_control()
        self.log(f"{label}: {outcome.status}"
                 + (f" ({outcome.reason})" if outcome.reason else "")
                 + f"; trained in {trained:.2f} s, sent "
                 f"{sum(outcome.bytes_sent.values())} bytes to {len(go.roster)}-site "
                 "secure aggregation")
