"""One round across real processes: the engine of ``secagg simulate``.

The calling process runs the aggregation server (and owns the broker: the embedded broker in
its own process, so its routing never competes with the server's numpy work for the GIL, or
a generated Mosquitto); ``processes`` worker processes (``spawn``) each run many sites on one
asyncio loop, one MQTT connection and one last will per site. Sites that drop out with
``kill=True`` run in small processes of their own, one per drop stage, which SIGKILL
themselves when their first site reaches that stage: the broker sees the TCP connections die
and publishes their wills, exactly as for a crashed hospital server.

Nothing here is secret-bearing except the sites' signing keys (``malicious`` mode), which the
coordinator generates as the federation's PKI would and hands to each site's process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from secagg import Config, ProtocolAbort, SigningKey, Stage
from secagg.client import Client, check_input
from secagg.server import AggregateResult, Server

from .broker.auth import TOKEN_LOG2_N, hash_password
from .broker.topics import AclEntry, TopicAcl
from .drivers import ClientDriver, StageProgress, Timeouts, TransportError
from .framing import DEFAULT_MAX_PAYLOAD
from .link import LinkLost
from .local import new_round_name, serve_client, serve_server
from .mqtt import BrokerSettings, MqttNetwork, parse_broker_url, probe
from .topics import SERVER_USER, Topics, acl_table, site_name

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class InputSource:
    """Where each site's input vector comes from: ``<directory>/<id>.npy``, or random
    uint64 values below 2**bits from ``seed`` (numpy: inputs are not secrets)."""

    directory: str | None = None
    seed: int = 0

    def load(self, client_id: int, config: Config) -> np.ndarray:
        if self.directory is not None:
            path = Path(self.directory) / f"{client_id}.npy"
            try:
                vector = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise ValueError(f"cannot read input {path}: {exc}") from None
            return check_input(vector, config, str(path)).astype(np.uint64)
        rng = np.random.default_rng([self.seed, client_id])
        return rng.integers(0, 1 << config.bits, size=config.dim, dtype=np.uint64)


def input_ids(directory: str) -> list[int]:
    """The client ids of an ``--inputs`` directory: the stems of its ``*.npy`` files."""
    ids = []
    for path in sorted(Path(directory).glob("*.npy")):
        if not path.stem.isdigit() or int(path.stem) >= 1 << 32:
            raise ValueError(f"input file {path.name}: name it <client id>.npy with a "
                             "non-negative integer id")
        ids.append(int(path.stem))
    if not ids:
        raise ValueError(f"no <id>.npy files in {directory}")
    return sorted(ids)


# --------------------------------------------------------------------------- brokers


AclTable = Mapping[str, AclEntry]


def _acl_json(acl: AclTable) -> dict[str, dict[str, list[str]]]:
    out = {}
    for user, entry in acl.items():
        rules = TopicAcl.coerce(entry)
        out[user] = {"subscribe": list(rules.subscribe), "publish": list(rules.publish),
                     "retain": list(rules.retain)}
    return out


@contextmanager
def _embedded_broker_process(users: Mapping[str, str], acl: AclTable,
                             timeout: float = 30.0) -> Iterator[int]:
    """``python -m transport.broker`` (the installed package) in its own session, so a
    Ctrl-C on the terminal reaches only this process, which stops it; its users file holds
    scrypt hashes, never the passwords. Its login and connection places are sized for every
    user logging in at once from loopback (``--parties``, ``BrokerLimits.for_parties``)."""
    with tempfile.TemporaryDirectory(prefix="secagg-broker-") as tmp:
        users_file, acl_file, port_file = (Path(tmp, n) for n in ("users", "acl", "port"))
        hashes = {user: hash_password(pw, log2_n=TOKEN_LOG2_N) for user, pw in users.items()}
        for path, data in ((users_file, hashes), (acl_file, _acl_json(acl))):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(data, handle)
        log_path = Path(tmp, "broker.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "transport.broker", "--port", "0", "--users-file",
                 str(users_file), "--acl-file", str(acl_file), "--port-file", str(port_file),
                 "--parties", str(len(users)), "--log-level", "WARNING"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while not port_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise TransportError(f"the embedded broker did not start: {tail}")
                time.sleep(0.02)
            yield int(port_file.read_text())
        finally:
            stop_process(proc)


def stop_process(proc: subprocess.Popen[bytes], grace: float = 1.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; waits for the exit."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)


@contextmanager
def broker_for(kind: str, users: Mapping[str, str], acl: AclTable
               ) -> Iterator[BrokerSettings]:
    """``embedded`` (own process), ``mosquitto`` (generated config) or an ``mqtt(s)://``
    URL; yields how to reach it with per-party passwords (for the URL: its own
    credentials)."""
    if kind == "embedded":
        with _embedded_broker_process(users, acl) as port:
            yield BrokerSettings(port=port, passwords=dict(users))
    elif kind == "mosquitto":
        from .mosquitto import MosquittoBroker

        with MosquittoBroker(users=dict(users), acl=dict(acl)) as broker:
            yield BrokerSettings(host=broker.host, port=broker.port, passwords=dict(users))
    else:
        settings = parse_broker_url(kind)
        try:
            probe(settings)
        except LinkLost as exc:
            raise TransportError(str(exc)) from None
        yield settings


# --------------------------------------------------------------------------- workers


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker process needs (pickled to it by ``spawn``)."""

    index: int
    config: Config
    roster: tuple[int, ...]
    context: bytes
    round_name: str
    broker: BrokerSettings
    inputs: InputSource
    clients: tuple[int, ...]
    drops: Mapping[int, Stage]
    kill: bool
    signing_keys: Mapping[int, bytes] = field(default_factory=dict, repr=False)
    verify_keys: Mapping[int, bytes] | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_payload: int = DEFAULT_MAX_PAYLOAD
    log_level: int = logging.WARNING


def _outcome_dict(outcome: object) -> dict[str, Any]:
    return dataclasses.asdict(outcome)  # type: ignore[call-overload,no-any-return]


def worker_main(spec: WorkerSpec, conn: multiprocessing.connection.Connection) -> None:
    """Entry point of a worker process. It starts with SIGINT blocked (``_Workers.start``)
    and ignores it: a Ctrl-C on the terminal is the parent's to handle, which stops the
    workers itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s worker{spec.index} %(levelname)s %(name)s: "
                               "%(message)s")
    try:
        outcomes = asyncio.run(_worker(spec, conn))
        conn.send(("outcomes", outcomes))
    except BaseException:  # report everything: the parent prints it
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


async def _worker(spec: WorkerSpec,
                  conn: multiprocessing.connection.Connection) -> dict[int, dict[str, Any]]:
    topics = Topics(spec.round_name)
    clients = []
    for cid in spec.clients:
        key = spec.signing_keys.get(cid)
        signing = (SigningKey(Ed25519PrivateKey.from_private_bytes(key))
                   if key is not None else None)
        clients.append(Client(spec.config, cid, spec.inputs.load(cid, spec.config),
                              roster=spec.roster, context=spec.context, signing_key=signing,
                              verify_keys=spec.verify_keys))
    network = MqttNetwork(spec.broker)
    drivers: dict[int, ClientDriver] = {}

    def on_ready(driver: ClientDriver) -> None:
        drivers[driver.client_id] = driver
        if len(drivers) == len(clients):
            conn.send(("ready", len(drivers)))

    async def die(stage: Stage) -> None:
        # Report what was sent so far, then die for real: no DISCONNECT reaches the broker.
        conn.send(("killed", stage.label, {cid: _outcome_dict(d.outcome)
                                          for cid, d in drivers.items()}))
        os.kill(os.getpid(), signal.SIGKILL)

    def joined_or_failed(cid: int, task: asyncio.Task[Any]) -> None:
        # A site that could not even connect fails the run now, with its reason, instead
        # of leaving its worker's other sites waiting for a round that cannot start.
        if cid not in drivers and not task.cancelled() and task.exception() is not None:
            conn.send(("error", f"client {cid} could not join: {task.exception()}"))

    tasks = [asyncio.create_task(serve_client(
        network, client, topics, timeouts=spec.timeouts, max_payload=spec.max_payload,
        drop_at=spec.drops.get(client.client_id), drop_mode="leave",
        on_drop=die if spec.kill else None, on_ready=on_ready)) for client in clients]
    for client, task in zip(clients, tasks, strict=True):
        task.add_done_callback(functools.partial(joined_or_failed, client.client_id))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    out: dict[int, dict[str, Any]] = {}
    for client, result in zip(clients, results, strict=True):
        if isinstance(result, BaseException):
            out[client.client_id] = {"client_id": client.client_id, "status": "lost",
                                     "reason": f"{type(result).__name__}: {result}",
                                     "bytes_sent": {}, "wire_bytes": 0, "republished": 0,
                                     "stage": ""}
        else:
            out[client.client_id] = _outcome_dict(result)
    return out


# --------------------------------------------------------------------------- the round


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
    max_payload: int = DEFAULT_MAX_PAYLOAD
    log_level: int = logging.WARNING
    connect_timeout: float = 120.0


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


class _Workers:
    """Worker processes and the parent's end of their pipes, read on the event loop."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.specs = specs
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self.events: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._child_ends: list[multiprocessing.connection.Connection] = []
        for spec in specs:
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(spec, child), daemon=True,
                               name=f"secagg-worker-{spec.index}")
            self.processes.append(proc)
            self.conns.append(parent)
            self._child_ends.append(child)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        # Children inherit the signal mask: blocked, a Ctrl-C cannot interrupt a worker
        # before worker_main ignores it (the parent gets it once unblocked).
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for proc in self.processes:
                proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        for child in self._child_ends:
            child.close()
        for index, conn in enumerate(self.conns):
            loop.add_reader(conn.fileno(), self._readable, index)

    def _readable(self, index: int) -> None:
        conn = self.conns[index]
        try:
            message = conn.recv()
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(conn.fileno())
            self.events.put_nowait((index, ("eof",)))
            return
        self.events.put_nowait((index, message))

    def stop(self, timeout: float, *, at_once: bool = False) -> None:
        """Wait up to ``timeout`` s for the workers to exit, then kill them; ``at_once``
        (the run was interrupted) sends SIGTERM first and waits at most half a second."""
        loop = asyncio.get_running_loop()
        for conn in self.conns:
            with contextlib.suppress(Exception):
                loop.remove_reader(conn.fileno())
        if at_once:
            for proc in self.processes:
                if proc.is_alive():
                    proc.terminate()
            timeout = min(timeout, 0.5)
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.processes:
            if proc.is_alive():
                logger.warning("worker %s did not exit; terminating it", proc.name)
                proc.kill()
                proc.join(5.0)
        for conn in self.conns:
            conn.close()


@asynccontextmanager
async def _workers(specs: list[WorkerSpec]) -> AsyncIterator[_Workers]:
    workers = _Workers(specs)
    workers.start()
    interrupted = True
    try:
        yield workers
        interrupted = False
    finally:
        workers.stop(timeout=10.0, at_once=interrupted)


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
    signing: dict[int, bytes] = {}
    verify: dict[int, bytes] | None = None
    if config.malicious:
        keys = {c: Ed25519PrivateKey.generate() for c in roster}
        signing = {c: k.private_bytes_raw() for c, k in keys.items()}
        verify = {c: k.public_key().public_bytes_raw() for c, k in keys.items()}
    server = Server(config, roster=roster, context=context, verify_keys=verify,
                    nonce=os.urandom(32))
    topics = Topics(round_name)
    seconds: dict[str, float] = {}
    with broker_for(spec.broker, passwords, acl) as broker_settings:
        settings = dataclasses.replace(broker_settings, client_id_suffix=f"-{round_name}")
        status(f"broker {spec.broker} at {settings.url}")
        groups = _partition(spec)
        specs = [WorkerSpec(index=i, config=config, roster=roster, context=context,
                            round_name=round_name, broker=settings, inputs=spec.inputs,
                            clients=ids, drops={c: spec.drops[c] for c in ids
                                                if c in spec.drops},
                            kill=kill, signing_keys={c: signing[c] for c in ids
                                                     if c in signing},
                            verify_keys=verify, timeouts=spec.timeouts,
                            max_payload=spec.max_payload, log_level=spec.log_level)
                 for i, (ids, kill) in enumerate(groups)]
        network = MqttNetwork(settings)
        server_ready, start = asyncio.Event(), asyncio.Event()
        run = SimulationRun(None, None, seconds, {}, [], settings.url)
        async with _workers(specs) as workers:
            server_task = asyncio.create_task(serve_server(
                network, server, topics, timeouts=spec.timeouts, max_payload=spec.max_payload,
                on_stage=on_stage, ready=server_ready, start=start, on_message=on_message))
            try:
                await _wait_ready(workers, server_task, server_ready, spec.connect_timeout,
                                  status, run)
                seconds["setup"] = time.perf_counter() - wall
                status(f"{len(roster)} clients connected in {len(specs)} processes; "
                       "round starts")
                start.set()
                try:
                    driver = await server_task
                    seconds.update(driver.seconds)
                    _copy_stats(run, driver)
                except ProtocolAbort as exc:
                    run.error = str(exc)
                except Exception as exc:
                    run.error = f"transport failure: {exc}"
                await _collect(workers, run, timeout=10.0 if run.error else 60.0)
            finally:
                if not server_task.done():
                    server_task.cancel()
                    with contextlib.suppress(BaseException):
                        await server_task
    run.result = server.result
    seconds["wall"] = time.perf_counter() - wall
    return run


def _copy_stats(run: SimulationRun, driver: Any) -> None:
    run.invalid_payloads = driver.invalid_payloads
    run.rejected = driver.rejected
    run.resends = driver.resends
    run.gone = dict(driver.gone)


async def _wait_ready(workers: _Workers, server_task: asyncio.Task[Any],
                      server_ready: asyncio.Event, timeout: float,
                      status: Callable[[str], None], run: SimulationRun) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pending = set(range(len(workers.specs)))
    connected = 0
    total = sum(len(s.clients) for s in workers.specs)
    while pending or not server_ready.is_set():
        if server_task.done():
            server_task.result()  # raises the connection error
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise TransportError(f"only {connected} of {total} clients connected within "
                                 f"{timeout} s")
        try:
            index, message = await asyncio.wait_for(workers.events.get(), min(remaining, 0.5))
        except asyncio.TimeoutError:
            continue
        kind = message[0]
        if kind == "ready":
            pending.discard(index)
            connected += message[1]
            status(f"clients connected: {connected}/{total}")
        elif kind in ("error", "eof"):
            detail = message[1] if kind == "error" else "it exited"
            raise TransportError(f"worker process {index} failed before the round: {detail}")
        else:
            logger.debug("worker %d: early message %s", index, kind)


async def _collect(workers: _Workers, run: SimulationRun, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    open_ = set(range(len(workers.specs)))
    while open_:
        remaining = deadline - loop.time()
        if remaining <= 0:
            logger.warning("workers %s did not report; giving up on them", sorted(open_))
            return
        try:
            index, message = await asyncio.wait_for(workers.events.get(), remaining)
        except asyncio.TimeoutError:
            continue
        kind = message[0]
        if kind == "outcomes":
            run.outcomes.update(message[1])
        elif kind == "killed":
            run.outcomes.update(message[2])
            killed = workers.specs[index].clients
            run.killed.extend(killed)
            for cid in killed:
                run.outcomes[cid]["status"] = "killed"
                run.outcomes[cid]["stage"] = message[1]
        elif kind == "error":
            run.worker_errors.append(message[1])
            open_.discard(index)
        elif kind == "eof":
            open_.discard(index)
