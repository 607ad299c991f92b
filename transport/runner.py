"""One round across real processes: the engine of ``secagg simulate``.

The calling process runs the aggregation server and owns the broker (``transport.launch``:
the embedded broker in its own process, so its routing never competes with the server's
numpy work for the GIL, or a generated Mosquitto); ``processes`` worker processes
(``transport.workers``) each run many sites. Sites that drop out with ``kill=True`` run in
small processes of their own, one per drop stage, which SIGKILL themselves when their first
site reaches that stage: the broker sees the TCP connections die and publishes their wills,
exactly as for a crashed hospital server.

With ``SimulationSpec.stall`` set (what ``secagg simulate`` does unless ``--deadlines wall``)
the round runs on logical deadlines (``transport.deadlines.logical_timeouts``): a stage closes
when every client still expected has answered or declared its drop, however slow the host,
so the only dropouts are the injected ones. A run that cannot keep up says so instead: it
fails with ``SimulationStalled`` when the server receives nothing for ``stall`` seconds, and
``SimulationRun.overrun`` names any client that dropped without being asked to.

Nothing here is secret-bearing except the sites' signing keys (``malicious`` mode), which the
coordinator generates as the federation's PKI would and hands to each site's process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from secagg import Config, ProtocolAbort, Stage
from secagg.server import AggregateResult
from secagg.simulate import LocalRound

from .deadlines import LOGICAL_KEEPALIVE, LOGICAL_LINK_SECONDS, logical_timeouts
from .drivers import StageProgress, Timeouts
from .errors import TransportError
from .framing import DEFAULT_MAX_PAYLOAD
from .launch import broker_for, running_broker  # noqa: F401  (broker_for: callers import it here)
from .mqtt import MqttNetwork
from .rounds import new_round_name, serve_server
from .tasks import stop_task
from .topics import SERVER_USER, Topics, acl_table, site_name
from .workers import InputSource, Workers, WorkerSpec, start_fork_server, worker_processes

logger = logging.getLogger(__name__)


@dataclass
class SimulationRun:
    """What ``run_simulation`` observed. ``result`` is None when the round aborted
    (``error`` says why)."""

    result: AggregateResult | None
    error: str | None
    seconds: dict[str, float]
    outcomes: dict[int, dict[str, Any]]
    killed: list[int]
    broker_url: str
    worker_errors: list[str] = field(default_factory=list)
    invalid_payloads: int = 0
    rejected: int = 0
    resends: int = 0
    gone: dict[int, str] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    """One line per site whose message the round did not accept, saying why (the server's
    rejection, or the site's own outcome)."""
    chunks: int = 0  # masked-input chunks the server accepted (the streaming path)
    overrun: str | None = None
    """Why the round's dropouts are not the injected ones: clients that failed in their
    worker process (an exception, a worker that died), and under logical deadlines clients
    that dropped unasked (the host could not keep up); None when they are."""


class SimulationStalled(TransportError):
    """A simulation with logical deadlines made no progress for its ``stall`` seconds: the
    host cannot keep up (nothing was dropped to make it finish)."""


@dataclass(frozen=True)
class SimulationSpec:
    config: Config
    client_ids: tuple[int, ...]
    inputs: InputSource
    drops: Mapping[int, Stage] = field(default_factory=dict)
    kill: bool = False
    processes: int = 2
    broker: str = "embedded"
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_payload: int | None = None
    """The largest frame the parties publish; None: ``SIMULATION_MAX_PAYLOAD`` through a
    broker this run starts (embedded, mosquitto), which it configures to take them, and
    ``DEFAULT_MAX_PAYLOAD`` through an existing broker (whose limit is its own)."""
    log_level: int = logging.WARNING
    connect_timeout: float = 120.0
    stall: float | None = None
    """Logical deadlines: set, no stage closes on the clock and the run fails with
    ``SimulationStalled`` once the server has received nothing for ``stall`` seconds; the
    sites' logins likewise, once none joined for the longer of ``stall`` and
    ``timeouts.start`` (``connect_timeout``), however long all of them take.
    None: the wall-clock ``timeouts`` of a deployment, under which a slow host drops sites,
    and every site must have joined within ``timeouts.start`` (``connect_timeout``)."""


SIMULATION_MAX_PAYLOAD = 1 << 20
"""Frames through a broker ``run_simulation`` starts itself (it configures the broker to
take them): a 4 MiB streamed chunk (``DEFAULT_CHUNK_BYTES``) crosses as 4 frames, not 16.
Every frame costs the three processes it crosses a fixed Python overhead (paho's packet
handling, the broker's routing, the reassembly, a PUBACK). Measured (issue 32) with 40 MB
in 4 MB messages from one site to the server through the embedded broker, CPU seconds of
the three processes: 0.32 with 256 KiB frames, 0.235 with 1 MiB, 0.26 with 4 MiB (paho
receives a frame into buffers the size of what is left of it). A deployment's broker keeps
``DEFAULT_MAX_PAYLOAD``."""


def max_payload_for(spec: SimulationSpec) -> int:
    """The frame size of ``spec``'s run (``SimulationSpec.max_payload``)."""
    if spec.max_payload is not None:
        return spec.max_payload
    return SIMULATION_MAX_PAYLOAD if spec.broker in ("embedded", "mosquitto") else (
        DEFAULT_MAX_PAYLOAD)


def _partition(spec: SimulationSpec) -> list[tuple[tuple[int, ...], bool]]:
    """(clients, kill) per worker process."""
    killed = {c for c in spec.drops} if spec.kill else set()
    regular = [c for c in spec.client_ids if c not in killed]
    groups: list[tuple[tuple[int, ...], bool]] = []
    count = max(1, min(spec.processes, len(regular))) if regular else 0
    for i in range(count):
        chunk = tuple(regular[i * len(regular) // count:(i + 1) * len(regular) // count])
        if chunk:
            groups.append((chunk, False))
    by_stage: dict[Stage, list[int]] = {}
    for cid in sorted(killed):
        by_stage.setdefault(spec.drops[cid], []).append(cid)
    groups += [(tuple(ids), True) for _, ids in sorted(by_stage.items())]
    return groups



async def run_simulation(spec: SimulationSpec,
                         on_stage: Callable[[StageProgress], None] | None = None,
                         on_status: Callable[[str], None] | None = None,
                         on_message: Callable[[int, Stage], None] | None = None
                         ) -> SimulationRun:
    """Run one round: server here, sites in worker processes, through ``spec.broker``.

    Every MQTT client id carries the round name (``BrokerSettings.client_id_suffix``), so
    two runs on one existing broker do not replace each other's connections. Cancelled
    (the CLI's SIGINT/SIGTERM handler), it stops the workers and the broker at once and
    removes its temporary files."""
    wall = time.perf_counter()
    status = on_status or (lambda text: None)
    config = spec.config
    roster = tuple(sorted(spec.client_ids))
    round_name = new_round_name()
    context = b"secagg simulate|" + round_name.encode() + b"|" + os.urandom(16)
    passwords = {SERVER_USER: secrets.token_urlsafe(18)}
    passwords.update({site_name(c): secrets.token_urlsafe(18) for c in roster})
    acl = acl_table(list(roster))
    parties = LocalRound.new(config, roster, context)
    server, verify = parties.server, parties.verify_keys
    signing = {c: key.private_bytes() for c, key in parties.signing_keys.items()}
    topics = Topics(round_name)
    seconds: dict[str, float] = {}
    logical = spec.stall is not None
    timeouts = logical_timeouts(spec.timeouts) if logical else spec.timeouts
    progress = _Progress(on_stage, on_message)
    max_payload = max_payload_for(spec)
    start_fork_server()  # the workers' imports run while the broker starts
    async with running_broker(spec.broker, passwords, acl,
                              max_payload=max_payload) as broker_settings:
        settings = dataclasses.replace(broker_settings, client_id_suffix=f"-{round_name}")
        if logical:  # a starved worker is neither disconnected nor out of time to publish
            settings = dataclasses.replace(
                settings, keepalive=LOGICAL_KEEPALIVE, connect_timeout=LOGICAL_LINK_SECONDS,
                publish_timeout=LOGICAL_LINK_SECONDS, reconnect_timeout=LOGICAL_LINK_SECONDS)
        status(f"broker {spec.broker} at {settings.url}")
        groups = _partition(spec)
        specs = [WorkerSpec(index=i, config=config, roster=roster, context=context,
                            round_name=round_name, broker=settings, inputs=spec.inputs,
                            clients=ids, drops={c: spec.drops[c] for c in ids
                                                if c in spec.drops},
                            kill=kill, signing_keys={c: signing[c] for c in ids
                                                     if c in signing},
                            verify_keys=verify, timeouts=timeouts,
                            max_payload=max_payload, log_level=spec.log_level)
                 for i, (ids, kill) in enumerate(groups)]
        network = MqttNetwork(settings)
        server_ready, start = asyncio.Event(), asyncio.Event()
        run = SimulationRun(None, None, seconds, {}, [], settings.url)
        async with worker_processes(specs) as workers:
            reports = _WorkerReports(workers, run)
            server_task = asyncio.create_task(serve_server(
                network, server, topics, timeouts=timeouts, max_payload=max_payload,
                on_stage=progress.stage, ready=server_ready, start=start,
                on_message=progress.message, on_driver=reports.attach))
            watch: asyncio.Task[None] | None = None
            try:
                # the sites wait timeouts.start for the round (sized for every login)
                await _wait_ready(workers, server_task, server_ready,
                                  max(spec.connect_timeout, spec.timeouts.start), status,
                                  spec.stall)
                seconds["setup"] = time.perf_counter() - wall
                status(f"{len(roster)} clients connected in {len(specs)} processes; "
                       "round starts")
                start.set()
                progress.mark()
                # a worker that fails or ends during the round reports it (or its pipe
                # closes): the server stops waiting for its clients at once
                watch = asyncio.create_task(reports.watch())
                # asyncio.wait: a cancel of this task stays this task's (``await server_task``
                # would hand it to the server task, whose teardown might absorb it)
                await progress.wait(server_task, spec.stall)
                await stop_task(watch)
                reports.round_over = True
                try:
                    driver = server_task.result()
                    seconds.update(driver.seconds)
                    _copy_stats(run, driver)
                except ProtocolAbort as exc:
                    run.error = str(exc)
                except Exception as exc:
                    run.error = f"transport failure: {exc}"
                await reports.collect(timeout=10.0 if run.error else 60.0)
            except BaseException:
                # Interrupted (cancelled) or failed: what the workers compute is moot; they
                # stop now, while the server's connection closes.
                workers.terminate()
                raise
            finally:
                if watch is not None:
                    await stop_task(watch)
                await stop_task(server_task)
    run.result = server.result
    run.reasons = _reasons(server.rejected, run.outcomes, run.gone)
    if run.error is not None and reports.lost:
        run.error += f"; {_lost_line(reports.lost)}"
    if run.result is not None and (logical or reports.lost):
        run.overrun = _overrun(spec.drops, run.result.dropped, run.reasons, reports.lost,
                               slow_host=logical)
    seconds["wall"] = time.perf_counter() - wall
    return run


class _Progress:
    """The server's progress (messages accepted, stages closed), passed on to the caller's
    callbacks, and the watch that fails a logical-deadline run once it stalls."""

    def __init__(self, on_stage: Callable[[StageProgress], None] | None,
                 on_message: Callable[[int, Stage], None] | None) -> None:
        self._on_stage = on_stage
        self._on_message = on_message
        self.last = time.monotonic()

    def mark(self) -> None:
        self.last = time.monotonic()

    def stage(self, report: StageProgress) -> None:
        self.mark()
        if self._on_stage is not None:
            self._on_stage(report)

    def message(self, client_id: int, stage: Stage) -> None:
        self.mark()
        if self._on_message is not None:
            self._on_message(client_id, stage)

    async def wait(self, task: asyncio.Task[Any], stall: float | None) -> None:
        """Until ``task`` ends; with ``stall``, raise ``SimulationStalled`` once nothing
        progressed for that long."""
        while not task.done():
            if stall is None:
                await asyncio.wait({task})
                return
            await asyncio.wait({task}, timeout=max(0.05, min(1.0, stall / 4)))
            idle = time.monotonic() - self.last
            if not task.done() and idle >= stall:
                raise SimulationStalled(
                    f"the simulation made no progress for {idle:.0f} s (no message reached "
                    f"the server): the host cannot keep up. With logical deadlines nothing is "
                    f"dropped to make a round finish; run fewer clients or a smaller --dim, "
                    f"use a less loaded machine, or run the same round on Flower's "
                    f"simulation engine across machines (docs/performance.md)")


def _overrun(asked: Mapping[int, Stage], dropped: Mapping[int, Stage],
             reasons: Mapping[int, str], lost: Mapping[int, str] | None = None, *,
             slow_host: bool = True) -> str | None:
    """None if exactly the ``asked`` clients dropped, each at its stage; else what differs:
    clients ``lost`` in their worker process (it failed: under any deadlines), and, with
    ``slow_host`` (logical deadlines), clients that dropped unasked otherwise (the host
    could not keep up)."""
    unasked = sorted(c for c, stage in dropped.items() if asked.get(c) != stage)
    lost = lost or {}
    slow = [c for c in unasked if c not in lost and slow_host]
    parts = []
    if any(c in lost for c in unasked):
        failed = {c: lost[c] for c in unasked if c in lost}
        parts.append(f"{_lost_line(failed)}; they are not protocol outcomes")
    if slow:
        parts.append(f"the host could not keep up: {len(slow)} clients dropped that the "
                     f"simulation did not ask to drop ({_shown(slow, reasons, dropped)}); "
                     f"they are not protocol outcomes. Run fewer clients per core, or on a "
                     f"less loaded machine")
    return "; ".join(parts) or None


def _shown(clients: Sequence[int], reasons: Mapping[int, str],
           dropped: Mapping[int, Stage] | None = None) -> str:
    """The first five of ``clients``, each with its drop stage and reason."""
    shown = "; ".join(f"client {c}" + (f" at {dropped[c].label}" if dropped else "")
                      + (f" ({reasons[c]})" if c in reasons else "") for c in clients[:5])
    return shown + (f" and {len(clients) - 5} more" if len(clients) > 5 else "")


def _lost_line(lost: Mapping[int, str]) -> str:
    clients = sorted(lost)
    return f"{len(clients)} clients failed in their worker process ({_shown(clients, lost)})"


def _reasons(rejected: Any, outcomes: Mapping[int, Mapping[str, Any]],
             gone: Mapping[int, str]) -> dict[int, str]:
    """Why each site's message was not accepted, one line each: the server's last
    rejection of it, else the site's own reason (excluded, timed out, aborted), else that
    it left (its sign-off or last will)."""
    out: dict[int, str] = {cid: f"it left the round ({why})" for cid, why in gone.items()}
    for cid, outcome in outcomes.items():
        reason = str(outcome.get("reason") or "")
        if reason and outcome.get("status") not in ("done", "dropped", "killed"):
            out[cid] = f"{outcome.get('status')}: {reason}"
    for cid, reason in rejected:
        out[cid] = str(reason)
    return {cid: " ".join(text.split()) for cid, text in out.items()}


def _copy_stats(run: SimulationRun, driver: Any) -> None:
    run.invalid_payloads = driver.invalid_payloads
    run.rejected = driver.rejected
    run.resends = driver.resends
    run.gone = dict(driver.gone)
    run.chunks = driver.chunks


async def _wait_ready(workers: Workers, server_task: asyncio.Task[Any],
                      server_ready: asyncio.Event, timeout: float,
                      status: Callable[[str], None], stall: float | None) -> None:
    """Until every worker's sites and the server have joined: within ``timeout`` seconds
    (wall-clock deadlines), or, with logical deadlines (``stall``), for as long as sites
    keep joining, failing once none joined for ``max(timeout, stall)`` seconds (10,000
    logins on a busy host take longer than any fixed bound, and nobody is dropped)."""
    loop = asyncio.get_running_loop()
    limit = timeout if stall is None else max(timeout, stall)
    deadline = loop.time() + limit
    pending = set(range(len(workers.specs)))
    connected = joined = 0
    total = sum(len(s.clients) for s in workers.specs)
    while pending or not server_ready.is_set():
        if server_task.done():
            server_task.result()  # raises the connection error
        remaining = deadline - loop.time()
        if remaining <= 0:
            if stall is not None:
                raise SimulationStalled(
                    f"no client joined for {limit:.0f} s ({joined} of {total} joined): the "
                    f"host cannot keep up; run fewer clients or use a less loaded machine")
            raise TransportError(f"only {connected} of {total} clients connected within "
                                 f"{timeout} s")
        try:
            async with asyncio.timeout(min(remaining, 0.5)):  # never loses a cancel
                index, message = await workers.events.get()
        except TimeoutError:
            continue
        kind = message[0]
        if kind == "joined":
            joined += message[1]
            if stall is not None:  # progress: the wait starts again
                deadline = loop.time() + limit
        elif kind == "ready":
            pending.discard(index)
            connected += message[1]
            status(f"clients connected: {connected}/{total}")
        elif kind in ("error", "eof"):
            detail = message[1] if kind == "error" else "it exited"
            raise TransportError(f"worker process {index} failed before the round: {detail}")
        else:
            logger.debug("worker %d: early message %s", index, kind)


class _WorkerReports:
    """What the worker processes report over their pipes, read while the round runs
    (``watch``) and after it (``collect``): outcomes, kills, failures. A worker that fails,
    or ends, while the server may still wait for its clients loses them: the server's
    driver (``attach``) stops waiting for each at once with the reason (``lost``), instead
    of the round stalling until the stall watch blames the host."""

    def __init__(self, workers: Workers, run: SimulationRun) -> None:
        self.workers = workers
        self.run = run
        self.open = set(range(len(workers.specs)))
        self.killed: set[int] = set()  # workers that SIGKILLed themselves on schedule
        self.lost: dict[int, str] = {}  # client -> why it failed while the round ran
        self.round_over = False  # set once the server's round has ended
        self._driver: Any = None

    def attach(self, driver: Any) -> None:
        """The server's driver exists: the clients lost before it are declared now."""
        self._driver = driver
        for cid, why in self.lost.items():
            driver.client_lost(cid, why)

    def _lose(self, cid: int, why: str) -> None:
        if self.round_over:
            return  # it failed after the round: the aggregate does not depend on it
        self.lost[cid] = why
        if self._driver is not None:
            self._driver.client_lost(cid, why)

    def take(self, index: int, message: tuple[Any, ...]) -> None:
        run = self.run
        clients = self.workers.specs[index].clients
        kind = message[0]
        if kind == "outcomes":
            run.outcomes.update(message[1])
            self.open.discard(index)
            for cid, outcome in message[1].items():
                # an exception or a connection lost for good: it will never send again
                # (a client that was refused or aborted said so to the server itself)
                if outcome.get("status") == "lost":
                    self._lose(cid, str(outcome.get("reason")))
        elif kind == "killed":
            run.outcomes.update(message[2])
            self.killed.add(index)
            run.killed.extend(clients)
            for cid in clients:
                run.outcomes[cid]["status"] = "killed"
                run.outcomes[cid]["stage"] = message[1]
        elif kind in ("error", "eof") and index in self.open:
            self.open.discard(index)
            if kind == "error":
                run.worker_errors.append(message[1])
                lines = str(message[1]).strip().splitlines() or ["?"]
                why = f"its worker process {index} failed: {lines[-1]}"
            else:
                code = self.workers.processes[index].exitcode  # None: not reaped yet
                why = (f"its worker process {index} ended without a report"
                       + (f" (exit code {code})" if code is not None else ""))
            if index in self.killed:
                return  # on schedule: the broker publishes its sites' wills
            for cid in clients:
                if cid not in run.outcomes:
                    run.outcomes[cid] = {"client_id": cid, "status": "lost", "reason": why,
                                         "bytes_sent": {}, "wire_bytes": 0,
                                         "republished": 0, "stage": ""}
                    self._lose(cid, why)

    async def watch(self) -> None:
        """Take the workers' reports as they come, until every worker has ended."""
        while self.open:
            index, message = await self.workers.events.get()
            self.take(index, message)

    async def collect(self, timeout: float) -> None:
        """The reports still to come after the round, for up to ``timeout`` s."""
        try:
            async with asyncio.timeout(timeout):
                await self.watch()
        except TimeoutError:
            logger.warning("workers %s did not report; giving up on them", sorted(self.open))
