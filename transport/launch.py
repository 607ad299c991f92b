"""The brokers a ``secagg simulate`` run (or a one-process federation) talks through: the
embedded broker in its own process, a generated Mosquitto, or an existing broker's URL.

The embedded broker is started the way an installed package is (``python -m
transport.broker``), in its own session so a Ctrl-C on the terminal reaches only its parent,
with a users file of scrypt hashes (never the passwords) and login places for every party,
in a private (0700) temporary folder. It watches its parent: if the parent dies, even by
SIGKILL, the broker removes that folder and stops (``transport.lifeline``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from .broker.auth import TOKEN_LOG2_N, hash_password
from .broker.topics import AclEntry, TopicAcl
from .errors import TransportError
from .framing import DEFAULT_MAX_PAYLOAD
from .heap import heap_environment
from .link import LinkLost
from .mqtt import BrokerSettings, parse_broker_url, probe

AclTable = Mapping[str, AclEntry]


def _acl_json(acl: AclTable) -> dict[str, dict[str, list[str]]]:
    return {user: TopicAcl.coerce(entry).to_json() for user, entry in acl.items()}


def _start_embedded(tmp: str, users: Mapping[str, str], acl: AclTable, port: int = 0,
                    max_payload: int = DEFAULT_MAX_PAYLOAD
                    ) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """Write the users (scrypt hashes) and ACL files into ``tmp`` and start the broker on
    ``port`` (0: a free one), taking payloads of up to ``max_payload`` bytes; returns the
    process, its port file (written once it listens) and its log."""
    users_file, acl_file, port_file = (Path(tmp, n) for n in ("users", "acl", "port"))
    hashes = {user: hash_password(pw, log2_n=TOKEN_LOG2_N) for user, pw in users.items()}
    for path, data in ((users_file, hashes), (acl_file, _acl_json(acl))):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
    log_path = Path(tmp, "broker.log")
    # Until setsid() the child is in the terminal's process group: with SIGINT blocked (the
    # mask is inherited through exec, and the broker never unblocks it) a Ctrl-C landing in
    # that window cannot kill it; the parent takes the Ctrl-C and stops the broker.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "transport.broker", "--port", str(port), "--users-file",
                 str(users_file), "--acl-file", str(acl_file), "--port-file", str(port_file),
                 "--parties", str(len(users)), "--max-payload", str(max_payload),
                 "--log-level", "WARNING",
                 # SIGKILLed, this process cannot stop the broker: it stops by itself and
                 # removes the folder with the users and ACL files (transport.lifeline).
                 "--parent-pid", str(os.getpid()), "--remove-if-orphaned", tmp],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, **heap_environment()})
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return proc, port_file, log_path


def _listening_port(proc: subprocess.Popen[bytes], port_file: Path, log_path: Path,
                    deadline: float) -> int | None:
    """The broker's port once it listens; None while it starts; TransportError (with its
    log) if it exited or missed ``deadline`` (``time.monotonic``)."""
    if port_file.exists():
        return int(port_file.read_text())
    if proc.poll() is not None or time.monotonic() > deadline:
        tail = log_path.read_text(errors="replace")[-2000:]
        raise TransportError(f"the embedded broker did not start: {tail}")
    return None


@contextmanager
def _embedded_broker_process(users: Mapping[str, str], acl: AclTable,
                             timeout: float = 30.0) -> Iterator[int]:
    """``python -m transport.broker`` (the installed package) in its own session, so a
    Ctrl-C on the terminal reaches only this process, which stops it; its users file holds
    scrypt hashes, never the passwords. Its login and connection places are sized for every
    user logging in at once from loopback (``--parties``, ``BrokerLimits.for_parties``)."""
    with tempfile.TemporaryDirectory(prefix="secagg-broker-") as tmp:
        proc, port_file, log_path = _start_embedded(tmp, users, acl)
        try:
            deadline = time.monotonic() + timeout
            while (port := _listening_port(proc, port_file, log_path, deadline)) is None:
                time.sleep(0.02)
            yield port
        finally:
            stop_process(proc)


@asynccontextmanager
async def _embedded_broker_process_async(users: Mapping[str, str], acl: AclTable,
                                         timeout: float = 30.0,
                                         max_payload: int = DEFAULT_MAX_PAYLOAD
                                         ) -> AsyncIterator[int]:
    """``_embedded_broker_process`` whose start-up wait is cancellable (``secagg simulate``
    stops at once when interrupted while the broker starts)."""
    with tempfile.TemporaryDirectory(prefix="secagg-broker-") as tmp:
        proc, port_file, log_path = _start_embedded(tmp, users, acl, max_payload=max_payload)
        try:
            deadline = time.monotonic() + timeout
            while (port := _listening_port(proc, port_file, log_path, deadline)) is None:
                await asyncio.sleep(0.02)
            yield port
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



@asynccontextmanager
async def running_broker(kind: str, users: Mapping[str, str], acl: AclTable, *,
                         max_payload: int = DEFAULT_MAX_PAYLOAD
                         ) -> AsyncIterator[BrokerSettings]:
    """``broker_for`` for a caller on an event loop: the embedded broker's start-up can be
    cancelled while it waits. A broker it starts (embedded, mosquitto) takes payloads of
    up to ``max_payload`` bytes; an existing broker's limit is its own."""
    if kind == "embedded":
        async with _embedded_broker_process_async(users, acl,
                                                  max_payload=max_payload) as port:
            yield BrokerSettings(port=port, passwords=dict(users))
    elif kind == "mosquitto":
        from .mosquitto import MosquittoBroker

        with MosquittoBroker(users=dict(users), acl=dict(acl),
                             max_payload=max_payload) as broker:
            yield BrokerSettings(host=broker.host, port=broker.port, passwords=dict(users))
    else:
        with broker_for(kind, users, acl) as settings:
            yield settings
