"""Training across machines: one coordinator process, one process per hospital site.

``secagg train --role all`` (the default) simulates every site in the coordinator's
process. Here each party is its own process with its own MQTT identity, and a site's
records never leave its process: it receives the global model, trains on its own table with
the same :class:`fl.site.Site` code paths (``none``/``site``/``distributed`` DP, patient
units), and hands only its encoded vector to secure aggregation.

One training round (the messages are in :mod:`fl.wire`)::

    coordinator                                   site k (in the cohort)
    Announce(open, cohort, blob sha256) ------->  (retained)
    Blob (model, scaler, task), chunked ------->  verify sha256, train, encode input,
                                                  connect to the secagg round (its will)
                                          <-----  Ready
    (every cohort site ready or offline, or --ready-timeout)
    Announce(go, roster = ready sites) -------->  Client(roster, context = f(blob sha256))
    ServerDriver  <==== secure aggregation ====>  ClientDriver
    decode, average, evaluate, checkpoint

Dropouts: a site that is offline (its federation link's will) is not waited for; one that
dies during the secagg round is dropped by the round's last will or stage deadline, and the
round completes when at least ``threshold`` sites remain (else it is retried, spending
nothing). The threshold is that of the full cohort, so the distributed-DP noise, calibrated
to it, never falls below target however many sites are missing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from fl.wire import (
    FETCH,
    HELLO,
    OFFLINE,
    READY,
    SITE_KINDS,
    Announce,
    Blob,
    CoordinatorOffline,
    Done,
    FedTopics,
    Fetch,
    Hello,
    PartyNetwork,
    Ready,
    SiteOffline,
    Waiting,
    WireError,
    blob_digest,
    coordinator_will,
    decode_blob,
    decode_coordinator_message,
    decode_site_message,
    framed,
    round_context,
    site_will,
    task_int,
    task_str,
)
from secagg import Config, ProtocolAbort, Stage
from secagg.client import Client
from secagg.server import AggregateResult, Server
from transport.control import Offline, encode_control
from transport.drivers import (
    ClientDriver,
    ServerDriver,
    Timeouts,
    TransportError,
    client_will,
    publish_framed,
)
from transport.framing import DEFAULT_MAX_PAYLOAD, FrameError, Reassembler, frame
from transport.link import Delivery, Link, LinkLost, Reconnected, Will
from transport.local import new_round_name
from transport.mqtt import BrokerSettings
from transport.topics import SERVER_USER, Topics, site_name

logger = logging.getLogger(__name__)
U64 = npt.NDArray[np.uint64]
Log = Callable[[str], None]
T = TypeVar("T")
MODEL_KINDS = ("logreg", "mlp")


class NotEnoughSites(RuntimeError):
    """Fewer than ``threshold`` cohort sites were ready: the round was not started."""


@dataclass(frozen=True)
class Schema:
    """A table's columns as the federation agrees on them (names only, never values)."""

    features: tuple[str, ...]
    labels: tuple[str, ...]


def dataset_schema(num_features: int, num_classes: int) -> Schema:
    """The schema of a bundled dataset: its columns are positional, its labels 0..c-1."""
    return Schema(tuple(f"x{i}" for i in range(num_features)),
                  tuple(str(c) for c in range(num_classes)))


def remote_timeouts(stage: float) -> Timeouts:
    """Deadlines for sites in other processes: ``stage`` per protocol stage; a client gives
    up on a round after a few stages' worth of silence."""
    return Timeouts(stage=stage, start=max(30.0, stage), retry=2.0, answer=min(10.0, stage),
                    give_up=max(60.0, 3 * stage))


# =========================================================================== site


class SiteData:
    """One hospital's table: a shard of a bundled dataset (demo) or its own CSV."""

    def __init__(self, site_id: int, *, table: Any = None, csv: str | None = None,
                 patient_column: str | None = None, label_column: str | None = None) -> None:
        from fl.data import csv_schema

        self.site_id = site_id
        self._csv = csv
        self._columns = (patient_column or "", label_column or "")
        self._tables: dict[tuple[str, ...], Any] = {}
        if csv is not None:
            features, labels = csv_schema(csv, patient_column=self._columns[0],
                                          label_column=self._columns[1])
            self.schema = Schema(features, labels)
        else:
            assert table is not None
            self._fixed = table
            self.schema = dataset_schema(table.num_features, table.num_classes)

    def table(self, labels: tuple[str, ...]) -> Any:
        """The table with labels numbered as the federation numbers them."""
        from fl.data import DataError, load_csv

        if self._csv is None:
            if labels != self.schema.labels:
                raise DataError(f"the federation's labels {list(labels)} are not this "
                                f"dataset's {list(self.schema.labels)}")
            return self._fixed
        if labels not in self._tables:
            self._tables = {labels: load_csv(self._csv, patient_column=self._columns[0],
                                             label_column=self._columns[1],
                                             labels=list(labels))}
        return self._tables[labels]


def demo_site_data(settings: Any, site_id: int, site_ids: Sequence[int]) -> SiteData:
    """Site ``site_id``'s shard of a bundled dataset, split exactly as ``--role all`` does
    (the same ``--seed``, ``--alpha`` and number of sites give the same shard)."""
    from fl.federation import load_split

    ids = sorted(site_ids)
    if site_id not in ids:
        raise ValueError(f"--site-id {site_id} is not among --sites {ids}")
    split = load_split(replace(settings, sites=len(ids)))
    return SiteData(site_id, table=split.site_tables[ids.index(site_id)])


def _schema_check(task: Mapping[str, Any], schema: Schema) -> tuple[str, ...]:
    from fl.wire import _names

    features = _names(task, "features")
    labels = _names(task, "labels")
    if features != schema.features:
        raise WireError(f"the federation's features {list(features)[:8]}... differ from this "
                        f"site's columns {list(schema.features)[:8]}...")
    missing = sorted(set(schema.labels) - set(labels))
    if missing or len(labels) < 2 or len(set(labels)) != len(labels):
        raise WireError(f"the federation's labels {list(labels)[:10]} do not cover this "
                        f"site's {missing[:10]}")
    return labels


def site_input(data: SiteData, blob: Blob, announce: Announce, *, require_dp: str | None
               ) -> U64:
    """This site's secure-aggregation vector for the announced round.

    :func:`fl.contribution.site_input`, as in simulation: what a site computes does not
    depend on where it runs. Every task field is validated first (a hostile coordinator can
    make a site refuse a round, never crash it).
    """
    from fl.contribution import RoundTask, TaskError, scaler_input
    from fl.contribution import site_input as contribution
    from fl.models import make_model
    from fl.site import Scaler, Site
    from fl.vector import ParameterLayout

    task = blob.task
    labels = _schema_check(task, data.schema)
    table = data.table(labels)
    cid = data.site_id
    cohort = len(announce.cohort)
    if blob.kind == "scaler":
        dim = 2 * table.num_features + 1
        if task_int(task, "dim", dim, dim) != dim or task_int(task, "bits", 64, 64) != 64:
            raise WireError("scaler task dimension or bits do not match this table")
        return scaler_input(Site(cid, table).feature_sums(), cohort)
    scaler = None if blob.scaler is None else Scaler(*blob.scaler)
    if scaler is not None and scaler.mean.size != table.num_features:
        raise WireError("the scaler does not match the number of features")
    site = Site(cid, table, scaler)
    model = make_model(task_str(task, "model", MODEL_KINDS), table.num_features, len(labels))
    layout = ParameterLayout.of(model)
    assert blob.model is not None
    if blob.model.size != layout.size:
        raise WireError(f"the model has {blob.model.size} parameters; "
                        f"{task['model']} on this table has {layout.size}")
    layout.load(model, blob.model)
    try:
        round_task = RoundTask.from_wire(task, layout.size)
    except TaskError as exc:
        raise WireError(str(exc)) from None
    if require_dp is not None and round_task.mode != require_dp:
        raise WireError(f"the coordinator asks for --dp {round_task.mode}; this site "
                        f"requires --dp {require_dp}")
    if round_task.round != announce.round or round_task.cohort != cohort:
        raise WireError("the task's round or cohort differs from the announcement")
    try:
        return contribution(site, model, round_task, cid).vector
    except TaskError as exc:
        raise WireError(str(exc)) from None


@dataclass
class SiteOptions:
    federation: str = "fl"
    insecure_verify: bool = False
    require_dp: str | None = None
    idle_timeout: float = 1800.0
    """Exit (status 1) after this long without hearing from the coordinator."""
    round_timeout: float = 600.0
    """Give up waiting for a round's ``go`` (or its blob) after this long."""
    stage_timeout: float = 60.0
    max_payload: int = DEFAULT_MAX_PAYLOAD


class SiteProcess:
    """A hospital's process: follows the coordinator's announcements until it says done."""

    def __init__(self, data: SiteData, broker: BrokerSettings, options: SiteOptions,
                 log: Log) -> None:
        self.data = data
        self.site_id = data.site_id
        self.name = site_name(data.site_id)
        self.options = options
        self.topics = FedTopics(options.federation)
        self.fed_network = PartyNetwork(broker, suffix="-fl")
        self.round_network = PartyNetwork(broker)
        self.log = log
        self.announce: Announce | None = None
        self.done: Done | None = None
        self.runs: set[bytes] = set()
        self.blobs: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self.changed = asyncio.Event()
        self.heard_at = 0.0
        self.rounds = 0
        self.lost: str | None = None
        self._link: Link | None = None
        self._run: bytes = b""
        self._control = Reassembler(1 << 20, max_partial=2)
        self._model = Reassembler(256 << 20, max_partial=2)

    async def run(self) -> int:
        """0 when the coordinator said done, 1 when it stayed silent for ``idle_timeout``."""
        loop = asyncio.get_running_loop()
        self.heard_at = loop.time()
        async with self.fed_network.connect(self.name, will=site_will(
                self.topics, self.site_id)) as link:
            self._link = link
            await link.subscribe(self.topics.control)
            await link.subscribe(self.topics.model)
            pump = asyncio.create_task(self._pump(link), name="fl-site-pump")
            try:
                await self._hello()
                self.log(f"connected as {self.name}; waiting for the coordinator "
                         f"(federation {self.options.federation!r})")
                return await self._follow(loop)
            finally:
                pump.cancel()
                with contextlib.suppress(BaseException):
                    await pump
                with contextlib.suppress(Exception):
                    await link.publish(self.topics.upstream(self.site_id, OFFLINE),
                                       framed(SiteOffline("site exited")))

    async def _follow(self, loop: asyncio.AbstractEventLoop) -> int:
        handled: set[tuple[bytes, int, int, str]] = set()
        while True:
            if self.lost is not None:
                self.log(f"lost the broker: {self.lost}")
                return 1
            if self.done is not None and self.done.run in self.runs:
                self.log(f"the coordinator finished after {self.done.rounds} rounds"
                         + (f" ({self.done.reason})" if self.done.reason else "")
                         + f"; this site took part in {self.rounds} aggregations")
                return 0
            ann = self.announce
            if ann is not None and ann.key not in handled:
                handled.add(ann.key)
                if self.site_id not in ann.cohort:
                    self.log(f"round {ann.round}: not in this round's cohort")
                elif ann.phase == "open":
                    await self._take_part(ann)
                    self.heard_at = loop.time()
                continue
            silent = loop.time() - self.heard_at
            if silent >= self.options.idle_timeout:
                self.log(f"no word from the coordinator for {silent:.0f} s; giving up")
                return 1
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(),
                                       self.options.idle_timeout - silent)

    async def _hello(self) -> None:
        assert self._link is not None
        schema = self.data.schema
        await self._link.publish(self.topics.upstream(self.site_id, HELLO), framed(
            Hello(self.site_id, schema.features, schema.labels, self._run)))

    # -- receiving ----------------------------------------------------------------------

    async def _pump(self, link: Link) -> None:
        try:
            while True:
                event = await link.receive()
                if isinstance(event, Reconnected):
                    await self._hello()
                elif isinstance(event, Delivery) and event.payload:
                    try:
                        await self._on_delivery(event)
                    except (WireError, FrameError) as exc:
                        logger.warning("site %d: invalid message on %s dropped: %s",
                                       self.site_id, event.topic, exc)
                    except Exception:  # never let one message stop the site
                        logger.exception("site %d: message on %s dropped", self.site_id,
                                         event.topic)
        except LinkLost as exc:
            self.lost = str(exc)
            self.changed.set()

    async def _on_delivery(self, event: Delivery) -> None:
        now = asyncio.get_running_loop().time()
        if event.topic == self.topics.model:
            got = self._model.feed("model", event.payload, now)
            if got is not None:
                self.blobs[got.digest] = got.payload
                while len(self.blobs) > 2:
                    self.blobs.popitem(last=False)
                self.changed.set()
            return
        if event.topic != self.topics.control:
            logger.warning("site %d: message on unexpected topic %s dropped", self.site_id,
                           event.topic)
            return
        got = self._control.feed("control", event.payload, now)
        if got is None:
            return
        message = decode_coordinator_message(got.payload)
        self.heard_at = now
        if isinstance(message, CoordinatorOffline):
            self.log(f"the coordinator went offline ({message.reason}); waiting for it")
            return
        run = message.run
        if run not in self.runs:
            self.runs.add(run)
            self._run = run
            if not isinstance(message, Done):
                await self._hello()  # a new coordinator run: say we are here
        if isinstance(message, Done):
            self.done = message
        elif isinstance(message, Announce):
            self.announce = message
        self.changed.set()

    # -- one round ----------------------------------------------------------------------

    def _superseded(self, ann: Announce) -> bool:
        current = self.announce
        return (self.done is not None and self.done.run in self.runs) or (
            current is not None and current.key != ann.key)

    async def _blob(self, ann: Announce) -> bytes | None:
        """The announced blob (verified by its SHA-256), asking for a re-broadcast if the
        broadcast was missed; None if the round moved on or it never came."""
        assert self._link is not None
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.options.round_timeout
        asked = loop.time()
        while ann.blob not in self.blobs:
            if self._superseded(ann) or loop.time() > give_up:
                return None
            if loop.time() - asked >= 1.0:
                await self._link.publish(self.topics.upstream(self.site_id, FETCH),
                                         framed(Fetch(ann.blob)))
                asked = loop.time()
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), 1.0)
        data = self.blobs[ann.blob]
        if len(data) != ann.size or blob_digest(data) != ann.blob:
            raise WireError("the blob does not match its announcement")
        return data

    async def _go(self, ann: Announce) -> Announce | None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.options.round_timeout
        while True:
            current = self.announce
            if current is not None and current.key == ann.key and current.phase == "go":
                return current
            if self._superseded(ann) or loop.time() > give_up:
                return None
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), 1.0)

    async def _take_part(self, ann: Announce) -> None:
        label = f"round {ann.round}" if ann.kind == "train" else "feature scaling"
        try:
            data = await self._blob(ann)
            if data is None:
                self.log(f"{label}: the model never arrived; skipping")
                return
            blob = decode_blob(data)
            if blob.kind != ann.kind:
                raise WireError(f"a {blob.kind} blob announced as {ann.kind}")
            started = time.perf_counter()
            vector = await asyncio.to_thread(site_input, self.data, blob, ann,
                                             require_dp=self.options.require_dp)
        except (WireError, ValueError) as exc:
            self.log(f"{label}: refusing the round: {exc}")
            return
        except Exception as exc:  # e.g. torch on a hostile model: refuse, do not crash
            logger.exception("site %d: computing the input failed", self.site_id)
            self.log(f"{label}: refusing the round: {type(exc).__name__}: {exc}")
            return
        trained = time.perf_counter() - started
        topics = Topics(ann.name)
        async with self.round_network.connect(self.name, will=client_will(
                topics, self.site_id)) as link:
            await link.subscribe(topics.client_filter(self.site_id))
            await link.subscribe(topics.control)
            clear = vector.astype("<u8").tobytes() if (
                self.options.insecure_verify and ann.verify) else None
            assert self._link is not None
            await publish_framed(self._link, self.topics.upstream(self.site_id, READY),
                                 _encode_ready(ann, clear), self.options.max_payload)
            go = await self._go(ann)
            if go is None or self.site_id not in go.roster:
                self.log(f"{label}: not in the round's roster; sitting it out")
                return
            if go.blob != ann.blob:
                self.log(f"{label}: the go names another model; refusing")
                return
            bits = task_int(blob.task, "bits", 8, 64)
            try:
                config = Config(num_clients=len(go.roster), threshold=go.threshold,
                                dim=int(vector.size), bits=bits)
                client = Client(config, self.site_id, vector, roster=go.roster,
                                context=round_context(self.options.federation, go))
            except ValueError as exc:
                self.log(f"{label}: refusing the round: {exc}")
                return
            driver = ClientDriver(client, link, topics,
                                  timeouts=remote_timeouts(self.options.stage_timeout),
                                  max_payload=self.options.max_payload)
            outcome = await driver.run()
        if outcome.status == "done":
            self.rounds += 1
        self.log(f"{label}: {outcome.status}"
                 + (f" ({outcome.reason})" if outcome.reason else "")
                 + f"; trained in {trained:.2f} s, sent "
                 f"{sum(outcome.bytes_sent.values())} bytes to {len(go.roster)}-site "
                 "secure aggregation")


def _encode_ready(ann: Announce, clear: bytes | None) -> bytes:
    from fl.wire import encode_message

    return encode_message(Ready(ann.run, ann.round, ann.attempt, ann.kind, ann.blob, clear))


def run_site(data: SiteData, broker: BrokerSettings, options: SiteOptions, log: Log) -> int:
    """Run a site process until the coordinator says done (0) or stays silent (1)."""
    return asyncio.run(SiteProcess(data, broker, options, log).run())


# =========================================================================== coordinator


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
    """The coordinator's federation link, on an event loop in a background thread.

    Training (torch) is synchronous; the federation link must stay connected between
    rounds to follow sites coming and going, so it lives on its own loop and the coordinator
    submits each round with :meth:`call`.
    """

    def __init__(self, broker: BrokerSettings, federation: str, site_ids: Sequence[int],
                 log: Log, *, max_input_bytes: int = 64 << 20,
                 max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self.broker = broker
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
        self.schema: Schema | None = None
        self.lost: str | None = None
        self.name = broker.url
        self._key: tuple[bytes, int, int, str] | None = None
        self._blob: bytes = b""
        self._digest: bytes = b""
        self._broadcast_at = -1e9
        self._control: bytes | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fl-channel",
                                        daemon=True)
        self._link: Link | None = None
        self._stack = contextlib.AsyncExitStack()
        self._pump: asyncio.Task[None] | None = None
        self._changed: asyncio.Event | None = None
        self._reassembler = Reassembler((1 << 20) + max_input_bytes, max_partial=2)
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> CoordinatorChannel:
        self._thread.start()
        try:
            self.call(self._open(), timeout=self.broker.connect_timeout + 30)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.call(self._close(), timeout=15)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the channel's loop; at most ``timeout`` seconds."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise TransportError(f"the federation channel did not answer in {timeout:.0f} s"
                                 ) from None

    async def _open(self) -> None:
        self._changed = asyncio.Event()
        network = PartyNetwork(self.broker, suffix="-fl")
        link = await self._stack.enter_async_context(network.connect(
            SERVER_USER, will=coordinator_will(self.topics)))
        self._link = link
        await link.subscribe(self.topics.server_filter)
        # Retained: replaces what an earlier run left (a Done would send the sites home).
        await self._publish_control(framed(Waiting(self.run_id)))
        self._pump = asyncio.create_task(self._run_pump(link), name="fl-coordinator-pump")

    async def _close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(BaseException):
                await self._pump
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        await self._stack.aclose()

    async def _publish_control(self, payload: bytes) -> None:
        assert self._link is not None
        self._control = payload
        await self._link.publish(self.topics.control, payload, retain=True)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- receiving ----------------------------------------------------------------------

    async def _run_pump(self, link: Link) -> None:
        try:
            await self._pump_events(link)
        except LinkLost as exc:
            self.lost = str(exc)
            if self._changed is not None:
                self._changed.set()

    async def _pump_events(self, link: Link) -> None:
        while True:
            event = await link.receive()
            if isinstance(event, Reconnected):
                # Nothing survives a broker restart without persistence: re-publish.
                if self._control is not None:
                    self._spawn(link.publish(self.topics.control, self._control, retain=True))
                if self._blob:
                    self._spawn(self._broadcast(force=True))
            elif isinstance(event, Delivery) and event.payload:
                try:
                    self._on_delivery(event)
                except (WireError, FrameError) as exc:
                    logger.warning("coordinator: invalid message on %s dropped: %s",
                                   event.topic, exc)
                except Exception:  # never let one message stop the federation link
                    logger.exception("coordinator: message on %s dropped", event.topic)

    def _on_delivery(self, event: Delivery) -> None:
        parsed = self.topics.parse_upstream(event.topic)
        if parsed is None or parsed[0] not in SITE_KINDS:
            logger.warning("coordinator: message on unexpected topic %s dropped", event.topic)
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
        assert self._changed is not None
        if isinstance(message, Hello):
            if self.schema is not None and not self._fits(message):
                return
            if cid not in self.hellos or cid in self.offline:
                self.log(f"site {cid} is online")
            self.hellos[cid] = message
            self.offline.discard(cid)
        elif isinstance(message, SiteOffline):
            if cid not in self.offline:
                self.log(f"site {cid} went offline ({message.reason})")
            self.offline.add(cid)
        elif isinstance(message, Fetch):
            if message.blob == self._digest and self._blob:
                self._spawn(self._broadcast())
        elif (isinstance(message, Ready) and message.key == self._key
              and message.blob == self._digest):
            self.readies[cid] = message
            self.offline.discard(cid)
        self._changed.set()

    def _fits(self, hello: Hello) -> bool:
        assert self.schema is not None
        if hello.features != self.schema.features:
            self.log(f"site {hello.site}: its columns differ from the federation's; ignored")
            return False
        extra = sorted(set(hello.labels) - set(self.schema.labels))
        if extra:
            self.log(f"site {hello.site}: labels {extra[:5]} are not among the federation's "
                     f"{list(self.schema.labels)[:10]}; ignored")
            return False
        return True

    async def _broadcast(self, force: bool = False) -> None:
        """The current blob to every site at once, chunked (at most twice a second)."""
        loop = asyncio.get_running_loop()
        if not force and loop.time() - self._broadcast_at < 0.5:
            return
        self._broadcast_at = loop.time()
        assert self._link is not None
        for data in frame(self._blob, self.max_payload):
            await self._link.publish(self.topics.model, data)

    # -- the coordinator's requests ------------------------------------------------------

    async def wait_for_sites(self, timeout: float, enough: int) -> dict[int, Hello]:
        """Hellos until every site said one, or ``timeout`` (then at least ``enough``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        assert self._changed is not None
        while set(self.hellos) != self.site_ids and loop.time() < deadline:
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), deadline - loop.time())
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
        assert self._changed is not None
        digest = blob_digest(blob)
        name = new_round_name()
        topics = Topics(name)
        ann = Announce(self.run_id, round_number, attempt, kind, name, tuple(sorted(cohort)),
                       digest, len(blob), "open", (), threshold, verify)
        self._key, self._blob, self._digest, self.readies = ann.key, blob, digest, {}
        will = Will(topics.control, frame(encode_control(Offline(
            "the aggregation server disconnected", final=False)))[0])
        async with PartyNetwork(self.broker).connect(SERVER_USER, will=will) as link:
            await link.subscribe(topics.server_filter)
            await self._publish_control(framed(ann))
            await self._broadcast(force=True)
            deadline = loop.time() + ready_timeout
            while loop.time() < deadline and self.lost is None:
                waiting = [c for c in cohort if c not in self.readies and c not in self.offline]
                if not waiting:
                    break
                self._changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), deadline - loop.time())
            if self.lost is not None:
                raise TransportError(f"the federation link is lost: {self.lost}")
            roster = tuple(sorted(c for c in cohort if c in self.readies))
            absent = {c: "absent" for c in cohort if c not in roster}
            if len(roster) < threshold:
                raise NotEnoughSites(f"{len(roster)} of {len(cohort)} sites were ready "
                                     f"(absent: {sorted(absent)}); the threshold is "
                                     f"{threshold}")
            config = Config(num_clients=len(roster), threshold=threshold, dim=dim, bits=bits)
            go = replace(ann, phase="go", roster=roster)
            server = Server(config, roster=roster, context=round_context(self.federation, go))
            await self._publish_control(framed(go))
            driver = ServerDriver(server, link, topics, timeouts=timeouts,
                                  max_payload=self.max_payload)
            started = loop.time()
            result = await driver.run()
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


@dataclass
class RemoteOptions:
    """What the coordinator role adds to :class:`fl.settings.TrainSettings`."""

    site_ids: tuple[int, ...]
    broker: BrokerSettings
    federation: str = "fl"
    eval_csv: str | None = None
    join_timeout: float = 600.0
    ready_timeout: float = 300.0
    stage_timeout: float = 60.0
    max_units: int | None = None
    insecure_verify: bool = False


class _Unused:
    """The base coordinator's aggregator slot: remote rounds go through the channel."""

    def __init__(self, name: str) -> None:
        self.name = name

    def aggregate(self, *args: object) -> Any:
        raise RuntimeError("a remote coordinator aggregates through its channel")


def _round_label(kind: str, r: int) -> str:
    return f"round {r}" if kind == "train" else "feature scaling"


def remote_aggregate(channel: CoordinatorChannel, options: RemoteOptions, *, kind: str,
                     round_number: int, blob_for: Callable[[int], bytes],
                     cohort: Sequence[int], threshold: int, dim: int, bits: int,
                     attempts: int, log: Log) -> tuple[RemoteRound, int]:
    """One aggregation with site processes, retried (fresh inputs) while it cannot finish.

    An attempt that aborts released nothing, so nothing is spent (docs/architecture.md section 6).
    """
    from fl.coordinator import RoundFailed

    timeouts = remote_timeouts(options.stage_timeout)
    limit = options.ready_timeout + 8 * options.stage_timeout + 120
    for attempt in range(attempts):
        try:
            done = channel.call(channel.run_round(
                kind=kind, round_number=round_number, attempt=attempt,
                blob=blob_for(attempt), cohort=cohort, threshold=threshold, dim=dim,
                bits=bits, verify=options.insecure_verify,
                ready_timeout=options.ready_timeout, timeouts=timeouts), timeout=limit)
        except (ProtocolAbort, NotEnoughSites, TransportError) as exc:
            log(f"{_round_label(kind, round_number)}: attempt {attempt + 1} did not complete "
                f"({exc}); retrying")
            continue
        return done, attempt + 1
    raise RoundFailed(f"{_round_label(kind, round_number)} failed {attempts} times: too few "
                      "sites are online or they keep dropping out (check the sites' logs, "
                      "raise --ready-timeout or --max-attempts)")


def _coordinator_class() -> type:
    from fl.aggregation import AggregateOutcome
    from fl.contribution import RoundTask as RoundTaskT
    from fl.contribution import decoder, round_task
    from fl.coordinator import Aggregated, Coordinator

    class RemoteCoordinator(Coordinator):
        """:class:`fl.coordinator.Coordinator` whose sites are other processes: it builds
        the round's blob (task, model, scaler) and lets the sites compute their inputs."""

        channel: CoordinatorChannel
        options: RemoteOptions
        schema: Schema
        scaler_arrays: tuple[Any, Any] | None

        def wire_task(self, r: int, cohort: list[int]) -> tuple[RoundTaskT, dict[str, Any]]:
            task = round_task(self.settings, self.plan, r, len(cohort),
                              max_units=self.options.max_units)
            return task, {"features": list(self.schema.features),
                          "labels": list(self.schema.labels), "model": self.settings.model,
                          **task.to_wire()}

        def _aggregate(self, r: int, cohort: list[int]) -> Aggregated:
            d = self.layout.size
            model = self.layout.to_vector(self.model)
            task, body = self.wire_task(r, cohort)
            blob = Blob("train", body, model, self.scaler_arrays).encode()
            decode = decoder(task, d)
            dim = task.encoded_dim(d)
            done, attempts = remote_aggregate(
                self.channel, self.options, kind="train", round_number=r,
                blob_for=lambda attempt: blob, cohort=cohort, threshold=self.threshold,
                dim=dim, bits=task.bits, attempts=self.settings.max_attempts, log=self.log)
            result = done.result
            dropped = {cid: Stage(st).label for cid, st in result.dropped.items()}
            dropped.update(done.absent)
            outcome = AggregateOutcome(
                total=np.asarray(result.total, dtype=np.uint64), included=result.included,
                dropped=dropped, seconds=done.seconds, bytes_sent=done.bytes_received)
            return Aggregated(outcome, done.config, done.inputs, decode, {}, attempts)

    return RemoteCoordinator


def _schema(channel: CoordinatorChannel, hellos: Mapping[int, Hello],
            known: Schema | None, log: Log) -> Schema:
    """The federation's schema: the bundled dataset's, or the sites' (and --eval-csv's)
    columns, which must agree, with the union of their labels."""
    if known is not None and not known.labels:
        features, labels = known.features, set()
    elif known is not None:
        features, labels = known.features, set(known.labels)
    else:
        features, labels = hellos[min(hellos)].features, set()
    for cid, hello in sorted(hellos.items()):
        if hello.features != features:
            raise ValueError(f"site {cid}'s columns {list(hello.features)[:6]}... differ from "
                             f"{list(features)[:6]}...: every site needs the same columns in "
                             "the same order")
        labels |= set(hello.labels)
    if known is not None and known.labels and set(known.labels) != labels:
        raise ValueError(f"the sites' labels {sorted(labels)} are not the dataset's "
                         f"{list(known.labels)}")
    ordered = tuple(known.labels) if known is not None and known.labels else tuple(
        sorted(labels))
    if len(ordered) < 2:
        raise ValueError(f"the sites' tables hold a single label {ordered}: nothing to learn")
    schema = Schema(tuple(features), ordered)
    channel.schema = schema
    log(f"schema: {len(schema.features)} features, labels {list(schema.labels)[:10]}")
    return schema


def train_coordinator(settings: Any, options: RemoteOptions, *, log: Log | None = None
                      ) -> dict[str, Any]:
    """Run (or resume) training with site processes; returns the ``--role all`` report."""
    import torch

    from fl.data import load_csv
    from fl.federation import (
        load_checkpoint,
        load_split,
        make_plan,
        report,
        tensors,
        uses_scaler,
    )
    from fl.models import make_model
    from fl.site import Scaler
    from fl.vector import ParameterLayout

    say = log or (lambda text: None)
    torch.manual_seed(settings.seed)
    saved = load_checkpoint(settings, say)
    ids = tuple(sorted(options.site_ids))
    known: Schema | None = None
    test_table = None
    needs_scaler = settings.scaling == "secure"
    max_units = options.max_units
    if settings.csv is None:
        # A bundled (public) dataset: the coordinator holds its test split for evaluation.
        split = load_split(replace(settings, sites=len(ids)))
        known = dataset_schema(split.train.num_features, split.train.num_classes)
        test_table = split.test
        needs_scaler = uses_scaler(settings, split.train)
        if max_units is None:
            max_units = max((t.num_patients if settings.unit == "patient" else len(t))
                            for t in split.site_tables)
    elif settings.scaling == "auto":
        needs_scaler = True  # a user's table is not on a public scale
    if settings.dp == "distributed" and max_units is None:
        raise ValueError("--dp distributed with --csv needs --max-units: a public bound on "
                         "the patients (records with --unit record) of the largest site")
    options = replace(options, max_units=max_units)
    everyone = int(Config(num_clients=len(ids), dim=1).threshold or 2)
    with CoordinatorChannel(options.broker, options.federation, ids, say) as channel:
        say(f"coordinator of federation {options.federation!r} on {options.broker.url}; "
            f"waiting for sites {list(ids)}")
        hellos = channel.call(channel.wait_for_sites(options.join_timeout, everyone),
                              timeout=options.join_timeout + 30)
        missing = sorted(set(ids) - set(hellos))
        say(f"{len(hellos)} of {len(ids)} sites online"
            + (f" (not yet: {missing})" if missing else ""))
        if options.eval_csv is not None:
            from fl.data import csv_schema

            features, labels = csv_schema(options.eval_csv,
                                          patient_column=settings.patient_column,
                                          label_column=settings.label_column)
            known = Schema(features, ())
            eval_labels = set(labels)
        else:
            eval_labels = set()
        schema = _schema(channel, hellos, known, say)
        if eval_labels - set(schema.labels):
            schema = Schema(schema.features, tuple(sorted(set(schema.labels) | eval_labels)))
            channel.schema = schema
        if options.eval_csv is not None:
            test_table = load_csv(options.eval_csv, patient_column=settings.patient_column,
                                  label_column=settings.label_column,
                                  labels=list(schema.labels))
        scaler: Scaler | None = None
        if saved is not None and saved.scaler is not None:
            scaler = Scaler(np.asarray(saved.scaler["mean"]), np.asarray(saved.scaler["std"]))
        elif needs_scaler:
            scaler = _remote_scaler(channel, options, settings, schema, ids, everyone, say)
        model = make_model(settings.model, len(schema.features), len(schema.labels),
                           settings.seed)
        dim = ParameterLayout.of(model).size
        threshold = int(Config(num_clients=settings.cohort_size, dim=1).threshold or 2)
        plan = make_plan(settings, None, dim, threshold, max_units=max_units)
        say(f"{len(ids)} site processes, test "
            + (f"{len(test_table)} records" if test_table is not None else "none (no "
               "--eval-csv: accuracy is not measured)")
            + f", model {settings.model} ({dim} parameters), broker {options.broker.url}, "
            f"threshold {threshold}")
        say(f"privacy: {plan.describe()}")
        scaler_json = (None if scaler is None else
                       {"mean": scaler.mean.tolist(), "std": scaler.std.tolist()})
        cls = _coordinator_class()
        coordinator = cls(settings, model, {}, None if test_table is None
                          else tensors(test_table, scaler), plan, _Unused(options.broker.url),
                          scaler=scaler_json, log=say)
        coordinator.site_ids = list(ids)
        coordinator.channel = channel
        coordinator.options = options
        coordinator.schema = schema
        coordinator.scaler_arrays = None if scaler is None else (scaler.mean, scaler.std)
        if saved is not None:
            coordinator.restore(saved)
            say(f"resumed from {settings.checkpoint} after round {saved.round}")
        try:
            coordinator.run()
        finally:
            reason = coordinator.stopped or (
                f"{coordinator.round} rounds" if coordinator.round >= settings.rounds
                else "the coordinator stopped")
            with contextlib.suppress(Exception):
                channel.call(channel.finish(coordinator.round, reason), timeout=30)
    if coordinator.stopped is None and coordinator.round >= settings.rounds:
        say(f"done: {coordinator.round} rounds")
    out = report(settings, plan, threshold, dim, coordinator, model)
    out["role"] = "coordinator"
    out["site_ids"] = list(ids)
    return out


def _remote_scaler(channel: CoordinatorChannel, options: RemoteOptions, settings: Any,
                   schema: Schema, ids: Sequence[int], threshold: int, log: Log) -> Any:
    """Federation-wide feature mean and std from one secure sum of the sites' feature sums
    (``fl.federation.secure_scaler``, with the sites in their own processes)."""
    from fl.contribution import scaler_from_sum

    f = len(schema.features)
    dim = 2 * f + 1
    task = {"features": list(schema.features), "labels": list(schema.labels), "dim": dim,
            "bits": 64}
    blob = Blob("scaler", task).encode()
    done, _ = remote_aggregate(channel, options, kind="scaler", round_number=0,
                               blob_for=lambda attempt: blob, cohort=list(ids),
                               threshold=threshold, dim=dim, bits=64,
                               attempts=settings.max_attempts, log=log)
    scaler = scaler_from_sum(np.asarray(done.result.total, dtype=np.uint64), f, len(ids))
    log(f"feature scaling from a secure sum over sites {sorted(done.result.included)}")
    if settings.dp != "none":
        log("note: feature scaling statistics come from an exact secure sum that the "
            "privacy budget does not cover; use --scaling none or pre-scaled data for "
            "a guarantee that covers every release")
    return scaler

