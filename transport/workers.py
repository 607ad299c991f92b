"""The sites' side of ``secagg simulate``: their inputs, and the worker processes that run
many of them each.

A worker process runs its sites on one asyncio loop, one MQTT connection and one
last will per site, and reports to the parent over a pipe: ``ready`` once every site listens,
``error`` (a site could not join, or the worker failed), ``killed`` (its sites reached their
drop stage and it SIGKILLs itself), ``outcomes`` at the end. Nothing here is secret-bearing
except the sites' signing keys (``malicious`` mode), handed over by the coordinator as the
federation's PKI would.

Workers are forked from multiprocessing's fork server, which imports this module once
(``forkserver`` with ``transport.workers`` preloaded, where the platform has it; ``spawn``
elsewhere): each worker then starts without importing numpy, secagg and the MQTT client
again (issue 32: 0.5-0.7 CPU s of imports per worker on the 2-core VM of
docs/performance.md). The fork server is a fresh interpreter, not the caller: no event
loop, thread or socket of the caller's is inherited. A worker exits once the process that
started it is gone, even SIGKILLed (``transport.lifeline.watch_process``), and the fork
server once its workers and that process are.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import errno
import functools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.util
import os
import shutil
import signal
import sys
import tempfile
import traceback
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from secagg import Config, SigningKey, Stage
from secagg.client import Client
from secagg.crypto import dtype_for_bits
from secagg.input_check import check_input

from .client_driver import ClientDriver, ClientOutcome
from .drivers import Timeouts
from .framing import DEFAULT_MAX_PAYLOAD
from .heap import keep_large_buffers
from .lifeline import watch_parent, watch_process
from .mqtt import BrokerSettings, MqttNetwork
from .rounds import serve_client
from .topics import Topics

logger = logging.getLogger(__name__)

STOP_GRACE = 0.5
"""Seconds an interrupted or failed run gives its workers between SIGTERM and SIGKILL."""


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class InputSource:
    """Where each site's input vector comes from: ``<directory>/<id>.npy``, or random
    values below 2**bits from ``seed`` in the natural width (``dtype_for_bits``: uint32 for
    bits <= 32; numpy: inputs are not secrets); with ``norm_bound``, random vectors within
    it (centred integers mod 2**bits)."""

    directory: str | None = None
    seed: int = 0

    def load(self, client_id: int, config: Config) -> np.ndarray:
        if self.directory is not None:
            path = Path(self.directory) / f"{client_id}.npy"
            try:
                vector = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise ValueError(f"cannot read input {path}: {exc}") from None
            return check_input(vector, config, str(path))
        rng = np.random.default_rng([self.seed, client_id])
        if config.norm_bound is not None:  # within the bound: a random direction and length
            direction = rng.normal(size=config.dim)
            direction *= rng.uniform() * config.norm_bound / max(
                float(np.linalg.norm(direction)), 1e-300)
            signed = np.trunc(direction).astype(np.int64)
            return (signed % (1 << config.bits)).astype(dtype_for_bits(config.bits))
        # the natural width: a 32-bit round holds 32-bit inputs, never 64-bit copies
        return rng.integers(0, 1 << config.bits, size=config.dim,
                            dtype=dtype_for_bits(config.bits), endpoint=False)


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



# --------------------------------------------------------------------------- workers


START_METHOD = ("forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                else "spawn")
"""How worker processes start (see the module's docstring)."""


PRELOAD = [__name__, "numpy.random", "cryptography.hazmat.backends.openssl.backend"]
"""What the fork server imports for every worker: this module, and what a worker would
otherwise import on first use (numpy's generators for random inputs, the OpenSSL backend
behind the first X25519 key)."""


SOCKET_PATH_MAX = 107 if sys.platform.startswith("linux") else 103
"""The longest path of a Unix socket (``sun_path`` less its terminating NUL)."""

_SOCKET_UNDER_TEMP = len("/pymp-12345678/listener-12345678")
"""What multiprocessing adds to the temporary folder for the fork server's socket: its own
``pymp-*`` folder and the ``listener-*`` socket in it."""


def _socket_fits(base: str) -> bool:
    return len(os.fsencode(base)) + _SOCKET_UNDER_TEMP <= SOCKET_PATH_MAX


def _fork_server_folder() -> str | None:
    """multiprocessing's temporary folder (where the fork server's socket goes), made in a
    folder short enough for the socket's path, or None if there is none.

    With a long ``TMPDIR`` (a CI runner's or a test runner's nested folder) the socket's
    path passed the limit, and ``secagg simulate`` exited with "AF_UNIX path too long"
    before any worker started. The folder is then made in the first of /tmp, /var/tmp,
    /dev/shm that is short and writable; it is removed at exit as before, or by the fork
    server if the caller was SIGKILLed (``FORK_SERVER_ENV``)."""
    for base in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"):
        if _socket_fits(base) and os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            break
    else:
        return None
    saved, tempfile.tempdir = tempfile.tempdir, base
    try:
        folder = multiprocessing.util.get_temp_dir()  # made once per process, then reused
    finally:
        tempfile.tempdir = saved
    return folder if _socket_fits(os.path.dirname(folder)) else None


def worker_context() -> (multiprocessing.context.ForkServerContext
                         | multiprocessing.context.SpawnContext):
    """The multiprocessing context worker processes start from: the fork server preloads
    this module, so a worker imports nothing at its start. Workers are spawned instead
    where there is no fork server, or no folder short enough for its socket."""
    if START_METHOD != "forkserver" or _fork_server_folder() is None:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # takes effect when this process starts its fork server (once, at its first use)
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


FORK_SERVER_ENV = "SECAGG_FORK_SERVER"
"""Set in the fork server's environment: ``<pid> <folder>``, the process that starts it and
the folder of its listening socket (that process's multiprocessing ``pymp-*`` folder)."""


def start_fork_server() -> None:
    """Start the fork server now, if workers start from one: its imports then overlap the
    caller's own start-up (the broker's), instead of following it. Idempotent."""
    if worker_context().get_start_method() != "forkserver":
        return
    resource_tracker.ensure_running()  # first: it unblocks SIGINT (see ``Workers.start``)
    # started with SIGINT blocked, like the workers: they inherit the fork server's mask
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    had = os.environ.get(FORK_SERVER_ENV)
    os.environ[FORK_SERVER_ENV] = f"{os.getpid()} {multiprocessing.util.get_temp_dir()}"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if had is None:
            del os.environ[FORK_SERVER_ENV]
        else:
            os.environ[FORK_SERVER_ENV] = had
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _remove_if_orphaned(setting: str) -> None:
    """At the fork server's exit: its starter removes the socket's folder when it ends,
    unless it was SIGKILLed; then (the server was re-parented) the server removes it."""
    starter, _, folder = setting.partition(" ")
    if starter.isdigit() and folder and os.getppid() != int(starter):
        shutil.rmtree(folder, ignore_errors=True)


if os.environ.get(FORK_SERVER_ENV) and multiprocessing.parent_process() is None:
    # imported by the fork server (its preload): it ends once its starter and workers have
    atexit.register(_remove_if_orphaned, os.environ[FORK_SERVER_ENV])


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker process needs (pickled to it)."""

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
    parent_pid: int = field(default_factory=os.getpid)
    """The process that starts the worker (built in it): the worker exits once it is gone."""


def _outcome_dict(outcome: ClientOutcome) -> dict[str, Any]:
    return dataclasses.asdict(outcome)


def worker_main(spec: WorkerSpec, conn: multiprocessing.connection.Connection) -> None:
    """Entry point of a worker process. It starts with SIGINT blocked (``Workers.start``)
    and ignores it: a Ctrl-C on the terminal is the parent's to handle, which stops the
    workers itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    keep_large_buffers()  # its chunks and frames reuse memory (transport.heap)
    # A parent SIGKILLed cannot stop its workers: each exits by itself once it is gone. A
    # worker forked by the fork server (its parent) watches the process that started it:
    # the fork server ends only once its workers have.
    exit_now = functools.partial(os._exit, 1)
    if os.getppid() == spec.parent_pid:
        watch_parent(spec.parent_pid, exit_now)
    else:
        watch_process(spec.parent_pid, exit_now)
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


def _closed_socket_writes(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The worker loop's exception handler: a dropped client closes its MQTT socket while
    aiomqtt's scheduled ``add_writer`` for it is still queued, which then fails with EBADF
    (nothing is lost: the client is gone). That one case is a debug line, not a traceback
    on a correct run's terminal; everything else goes to asyncio's default handler."""
    exc = context.get("exception")
    if (isinstance(exc, OSError) and exc.errno == errno.EBADF
            and "add_writer" in repr(context.get("handle"))):
        logger.debug("a closed client socket's pending write was dropped: %s", exc)
        return
    loop.default_exception_handler(context)


async def _worker(spec: WorkerSpec,
                  conn: multiprocessing.connection.Connection) -> dict[int, dict[str, Any]]:
    asyncio.get_running_loop().set_exception_handler(_closed_socket_writes)
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
        conn.send(("joined", 1))  # progress: the runner's login wait counts it
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



class Workers:
    """Worker processes and the parent's end of their pipes, read on the event loop."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        ctx = worker_context()
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
        # Children inherit the signal mask: blocked, a Ctrl-C on the terminal (it reaches the
        # whole process group) cannot interrupt a worker before worker_main ignores it; the
        # parent gets it once unblocked and stops the workers itself. The resource tracker
        # is started first: starting it unblocks SIGINT in the caller (multiprocessing's
        # resource_tracker.ensure_running), which would let the workers start unprotected.
        resource_tracker.ensure_running()
        for proc in self.processes:
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
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

    def terminate(self) -> None:
        """SIGTERM every worker still running, without waiting (they compute nothing worth
        keeping once the run is interrupted or failed)."""
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()

    async def stop(self, timeout: float, *, at_once: bool = False) -> None:
        """Wait up to ``timeout`` s for the workers to exit, then SIGKILL them and reap them;
        ``at_once`` (the run was interrupted or failed) sends SIGTERM first and waits at most
        ``STOP_GRACE`` s. Waits on the loop, never blocking it; a cancellation of the caller
        does not cut it short (nothing may be left running)."""
        loop = asyncio.get_running_loop()
        for conn in self.conns:
            with contextlib.suppress(Exception):
                loop.remove_reader(conn.fileno())
        if at_once:
            self.terminate()
            timeout = min(timeout, STOP_GRACE)
        deadline = loop.time() + timeout
        cancelled: asyncio.CancelledError | None = None
        while any(proc.is_alive() for proc in self.processes) and loop.time() < deadline:
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError as exc:  # finish the stop at once, then propagate
                cancelled = exc
                break
        for proc in self.processes:
            if proc.is_alive():
                if not at_once and cancelled is None:
                    logger.warning("worker %s did not exit; killing it", proc.name)
                proc.kill()
        for proc in self.processes:
            proc.join(5.0)  # reaped: SIGKILLed or exited, so this returns at once
        for conn in self.conns:
            conn.close()
        if cancelled is not None:
            raise cancelled


@asynccontextmanager
async def worker_processes(specs: list[WorkerSpec]) -> AsyncIterator[Workers]:
    workers = Workers(specs)
    workers.start()
    interrupted = True
    try:
        yield workers
        interrupted = False
    finally:
        await workers.stop(timeout=10.0, at_once=interrupted)
