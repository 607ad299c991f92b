"""Embedded pure-Python asyncio MQTT broker: the zero-install default broker of ``secagg``.

Why it exists: ``secagg simulate`` and the tests must run with no broker installed, yet the
transport must speak real MQTT so the same driver works against Mosquitto in production.
The broker is not trusted by the protocol (shares are AEAD encrypted, inputs masked), but it
still authenticates clients and can confine each site to its own topics, so a leaked
site credential cannot be used to read or spoof another site's traffic.

What it implements (and what it deliberately does not):

* MQTT 3.1.1 (protocol level 4) and MQTT 3.1 (level 3, ``MQIsdp``). MQTT 5 (level 5) is
  refused with a v5-format CONNACK, reason code 0x84 "Unsupported Protocol Version", so a
  v5 client can fall back to 3.1.1; any other level gets the 3.1.1 code 0x01.
* Username/password authentication, on by default (``hmac.compare_digest``); failures get
  CONNACK 0x05 "not authorized" and the connection is closed.
* Optional per-user topic ACL (:class:`TopicAcl` mapping or a callable). A refused PUBLISH
  is acknowledged (so a QoS 1 client does not retransmit forever) but not routed, and is
  logged; a refused SUBSCRIBE gets SUBACK 0x80.
* QoS 0 and 1 in both directions. Inbound QoS 2 completes the PUBREC/PUBREL/PUBCOMP
  handshake (a retransmitted PUBLISH with a pending id is not routed twice); outbound
  delivery is capped at QoS 1: SUBSCRIBE requests for QoS 2 are granted QoS 1.
* Clean sessions only: ``clean session = 0`` is accepted but treated as clean (CONNACK
  session-present is always 0, nothing is queued for offline clients).
* Wildcard subscriptions, retained messages, PINGREQ, keepalive (1.5 x), last will on any
  close that is not a DISCONNECT (lost TCP connection, keepalive expiry, protocol error,
  slow-consumer drop, client-id takeover), duplicate client id closes the old connection.
* Bounded per-connection outbound queues: a publisher waits (TCP back-pressure) while a
  subscriber's queue is full, and the subscriber is dropped once it stays full for
  ``slow_consumer_timeout`` seconds, so one stuck consumer never blocks the broker forever.

The wire format is in ``transport.mqtt_packets``, topic matching and the ACL in
``transport.mqtt_topics``, socket I/O in ``transport.broker_stream`` and the per-client
packet loop in ``transport.broker_connection``; this module holds the broker itself
(client registry, routing, retained messages, wills, stats), its thread runner and the
``python -m transport.broker`` entry point, and re-exports the public names.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import signal
import ssl
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from transport.broker_connection import Connection
from transport.broker_errors import BrokerConfigError, BrokerError, BrokerStartError
from transport.broker_stream import Stream
from transport.mqtt_packets import MQTT_MAX_REMAINING_LENGTH, Message, ProtocolViolation
from transport.mqtt_topics import (
    AclCallable,
    AclEntry,
    AclPolicy,
    AclSpec,
    TopicAcl,
    filter_covers,
    topic_matches,
    validate_topic_filter,
    validate_topic_name,
)
from transport.mqtt_topics import Action as Action  # re-exported with the ACL types

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "MQTT_MAX_REMAINING_LENGTH",
    "AclCallable",
    "AclEntry",
    "AclSpec",
    "BrokerConfigError",
    "BrokerError",
    "BrokerStartError",
    "BrokerStats",
    "BrokerThread",
    "EmbeddedBroker",
    "TopicAcl",
    "filter_covers",
    "main",
    "topic_matches",
    "validate_topic_filter",
    "validate_topic_name",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_PAYLOAD = MQTT_MAX_REMAINING_LENGTH


# --------------------------------------------------------------------------- stats


@dataclass
class BrokerStats:
    """Counters for reports: payload bytes only (headers excluded), messages per direction."""

    connections_total: int = 0
    connections_current: int = 0
    messages_in: int = 0
    bytes_in: int = 0
    messages_out: int = 0
    bytes_out: int = 0
    retained_messages: int = 0
    auth_failures: int = 0
    acl_denials: int = 0
    protocol_errors: int = 0
    slow_consumers_dropped: int = 0
    wills_published: int = 0

    def as_dict(self) -> dict[str, int]:
        """JSON-friendly copy for benchmark and simulation reports."""
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- broker


class EmbeddedBroker:
    """Pure-Python asyncio MQTT 3.1.1 broker; see the module docstring for what it supports.

    Use it as an async context manager (``async with EmbeddedBroker(users=...) as b``), with
    :meth:`start`/:meth:`stop`, in a background thread (:meth:`run_in_thread`) for
    synchronous callers, or as a process (``python -m transport.broker``).
    """

    def __init__(
        self,
        users: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        acl: AclSpec | None = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
        allow_anonymous: bool = False,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        max_control_packet: int = 1 << 20,
        max_queued_bytes: int = 64 << 20,
        slow_consumer_timeout: float = 60.0,
        connect_timeout: float = 10.0,
    ) -> None:
        if not users and not allow_anonymous:
            raise BrokerConfigError(
                "EmbeddedBroker needs users={'name': 'password', ...}: authentication is on "
                "by default; pass allow_anonymous=True only for throwaway local tests"
            )
        if not 0 < max_payload <= MQTT_MAX_REMAINING_LENGTH:
            raise BrokerConfigError(
                f"max_payload must be in 1..{MQTT_MAX_REMAINING_LENGTH} (the MQTT maximum), "
                f"got {max_payload}"
            )
        if max_queued_bytes <= 0 or slow_consumer_timeout <= 0 or connect_timeout <= 0:
            raise BrokerConfigError(
                "max_queued_bytes, slow_consumer_timeout and connect_timeout must be positive"
            )
        self._users = {name: pw.encode() for name, pw in (users or {}).items()}
        self.host = host
        self._requested_port = port
        self._acl = AclPolicy(acl)
        self.ssl_context = ssl_context
        self.allow_anonymous = allow_anonymous
        self.max_payload = max_payload
        self.max_control_packet = max_control_packet
        self.max_queued_bytes = max_queued_bytes
        self.slow_consumer_timeout = slow_consumer_timeout
        self.connect_timeout = connect_timeout
        self.stats = BrokerStats()
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._clients: dict[str, Connection] = {}
        self._retained: dict[str, Message] = {}
        self._handlers: set[asyncio.Task[None]] = set()
        self._connections: set[Connection] = set()
        self._stopping = False

    # -- public ------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound TCP port (the real one when constructed with ``port=0``)."""
        if self._port is None:
            raise BrokerError("broker is not started; use 'async with' or await start()")
        return self._port

    @property
    def url(self) -> str:
        """``mqtt://host:port`` (``mqtts://`` with TLS), for the transport's ``--broker``."""
        scheme = "mqtts" if self.ssl_context is not None else "mqtt"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    async def start(self) -> None:
        """Bind and start accepting connections."""
        if self._server is not None:
            raise BrokerError("broker already started")
        if self.host not in ("127.0.0.1", "::1", "localhost") and self.ssl_context is None:
            logger.warning("embedded broker listens on %s without TLS; passwords travel in "
                           "clear text", self.host)
        try:
            server = await asyncio.get_running_loop().create_server(
                lambda: Stream(self), self.host, self._requested_port, ssl=self.ssl_context,
            )
        except OSError as exc:
            raise BrokerStartError(
                f"cannot listen on {self.host}:{self._requested_port}: {exc}; pick another "
                "port or port=0 for a free one"
            ) from exc
        self._stopping = False
        self._server = server
        # With a host name resolving to several addresses each socket may get its own port.
        self._port = int(server.sockets[0].getsockname()[1])
        logger.info("embedded MQTT broker listening on %s", self.url)

    async def stop(self) -> None:
        """Stop accepting, close every connection (no wills: the broker is going away)."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping = True
        server.close()
        for connection in list(self._connections):
            connection.abort()
        handlers = list(self._handlers)
        if handlers:
            await asyncio.wait(handlers, timeout=5.0)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 5.0)
        self._clients.clear()
        logger.info("embedded MQTT broker on port %s stopped", self._port)

    async def serve_forever(self) -> None:
        """Run until cancelled (used by the process entry point)."""
        if self._server is None:
            await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    async def __aenter__(self) -> EmbeddedBroker:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def run_in_thread(self, start_timeout: float = 10.0) -> BrokerThread:
        """Start the broker on its own event loop in a daemon thread, for synchronous code."""
        return BrokerThread(self, start_timeout)

    # -- internals ---------------------------------------------------------------------

    def _authenticate(self, username: str | None, password: bytes | None) -> bool:
        if self.allow_anonymous and username is None:
            return True
        expected = self._users.get(username or "")
        # Compare even for unknown users so timing does not reveal which names exist.
        ok = hmac.compare_digest(expected or b"\x00" * 16, password or b"")
        return ok and expected is not None and username is not None

    def _register(self, connection: Connection) -> None:
        old = self._clients.get(connection.client_id)
        if old is not None and old is not connection:
            logger.info("client id %r reconnected; closing its previous connection",
                        connection.client_id)
            old.abort()
        self._clients[connection.client_id] = connection
        connection.registered = True

    def _spawn_writer(self, connection: Connection) -> None:
        task = asyncio.get_running_loop().create_task(self._run_writer(connection))
        connection.writer_task = task

    async def _run_writer(self, connection: Connection) -> None:
        try:
            await connection.outbox.run()
        except (ConnectionError, OSError, RuntimeError) as exc:
            logger.debug("%r: write failed: %s", connection, exc)
            connection.abort()

    def _drop_slow(self, connection: Connection) -> None:
        if connection.closed:
            return
        self.stats.slow_consumers_dropped += 1
        logger.warning("%r: dropped as a slow consumer (%d bytes queued for more than %.0f s)",
                       connection, connection.outbox.queued_bytes, self.slow_consumer_timeout)
        connection.abort()

    async def _route(self, message: Message) -> None:
        if message.retain:
            if len(message.payload):
                self._retained[message.topic] = dataclasses.replace(message, retain=False)
            else:
                self._retained.pop(message.topic, None)
            self.stats.retained_messages = len(self._retained)
        topic_levels = message.topic.split("/")
        for connection in list(self._clients.values()):
            qos = connection.match_qos(topic_levels)
            if qos >= 0:
                await connection.deliver(message, min(qos, message.qos), retain=False)

    async def _publish_will(self, connection: Connection) -> None:
        will = connection.will
        if will is None or self._stopping:
            return
        if not self._acl.allowed(connection.username, connection.client_id, "publish",
                                 will.topic):
            self.stats.acl_denials += 1
            logger.warning("%r: will to %r denied by ACL; dropped", connection, will.topic)
            return
        self.stats.wills_published += 1
        logger.debug("%r: publishing will to %r", connection, will.topic)
        await self._route(will)

    def _spawn_handler(self, stream: Stream) -> None:
        task = asyncio.get_running_loop().create_task(self._handle(stream))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _handle(self, stream: Stream) -> None:
        """Per-connection task: whatever the peer sends, only this connection is affected."""
        connection = Connection(self, stream)
        self._connections.add(connection)
        self.stats.connections_total += 1
        self.stats.connections_current += 1
        connection.start_watchdog()
        try:
            if self._stopping:
                return
            await connection.serve()
        except asyncio.IncompleteReadError as exc:
            if exc.partial or exc.expected != 1:
                logger.debug("%r: connection lost inside a packet", connection)
            else:
                logger.debug("%r: connection closed by peer", connection)
        except ProtocolViolation as exc:
            self.stats.protocol_errors += 1
            logger.warning("%r: protocol violation, closing: %s", connection, exc)
        except (ConnectionError, OSError, ssl.SSLError) as exc:
            logger.debug("%r: connection error: %s", connection, exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("%r: unexpected error; connection closed", connection)
        finally:
            if connection.watchdog_task is not None:
                connection.watchdog_task.cancel()
            await self._cleanup(connection)

    async def _cleanup(self, connection: Connection) -> None:
        was_closed = connection.closed
        connection.closed = True
        connection.outbox.close()
        self._connections.discard(connection)
        self.stats.connections_current -= 1
        if connection.registered and self._clients.get(connection.client_id) is connection:
            del self._clients[connection.client_id]
        writer_task = connection.writer_task
        if connection.connected and not connection.clean_disconnect:
            try:
                await self._publish_will(connection)
            except Exception:
                logger.exception("%r: publishing the will failed", connection)
        if writer_task is not None and not was_closed and connection.clean_disconnect:
            # Let queued acks reach a client that said goodbye, but never wait long.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(writer_task), 1.0)
        if writer_task is not None:
            writer_task.cancel()
        if was_closed:
            connection.stream.abort()
        else:
            connection.stream.close()
        logger.debug("%r: closed", connection)


# --------------------------------------------------------------------------- thread runner


class BrokerThread:
    """An :class:`EmbeddedBroker` running on its own event loop in a daemon thread.

    Why: the CLI and synchronous tests need a broker while their own code blocks; a thread is
    cheaper than a process and the handle stops it deterministically.
    """

    def __init__(self, broker: EmbeddedBroker, start_timeout: float = 10.0) -> None:
        self.broker = broker
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="secagg-mqtt-broker",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout):
            raise BrokerStartError(f"embedded broker did not start within {start_timeout} s")
        if self._error is not None:
            message = f"embedded broker failed to start: {self._error}"
            raise BrokerStartError(message) from self._error

    def _main(self) -> None:
        async def runner() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop_event = asyncio.Event()
            try:
                await self.broker.start()
            except BaseException as exc:
                self._error = exc
                self._ready.set()
                return
            self._ready.set()
            try:
                await self._stop_event.wait()
            finally:
                await self.broker.stop()

        asyncio.run(runner())

    @property
    def port(self) -> int:
        return self.broker.port

    @property
    def url(self) -> str:
        return self.broker.url

    @property
    def stats(self) -> BrokerStats:
        """A snapshot of the broker's counters (copied: the broker thread keeps counting)."""
        return dataclasses.replace(self.broker.stats)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the broker and join its thread; safe to call twice."""
        loop, event = self._loop, self._stop_event
        if loop is not None and event is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(event.set)
        self._thread.join(timeout)

    def __enter__(self) -> BrokerThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- process entry


def _load_json_object(path: str, what: str) -> dict[str, object]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BrokerConfigError(f"cannot read {what} file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise BrokerConfigError(f"{what} file {path} must hold a JSON object")
    return data


def load_users_file(path: str) -> dict[str, str]:
    """Read ``{"username": "password", ...}`` (JSON)."""
    data = _load_json_object(path, "users")
    if not all(isinstance(v, str) for v in data.values()):
        raise BrokerConfigError(f"users file {path}: every password must be a JSON string")
    return {str(k): str(v) for k, v in data.items()}


def load_acl_file(path: str) -> dict[str, TopicAcl]:
    """Read ``{"username": {"subscribe": [...], "publish": [...]}, ...}`` (JSON)."""
    data = _load_json_object(path, "ACL")
    table: dict[str, TopicAcl] = {}
    for user, entry in data.items():
        if not isinstance(entry, dict):
            raise BrokerConfigError(f"ACL file {path}: entry for {user!r} must be an object")
        table[user] = TopicAcl(subscribe=tuple(entry.get("subscribe", ())),
                               publish=tuple(entry.get("publish", ())))
    return table


def _write_port_file(path: str, port: int) -> None:
    # Write-then-rename so a polling reader never sees a half-written number.
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(f"{port}\n", encoding="utf-8")
    os.replace(tmp, path)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m transport.broker",
        description="Embedded MQTT 3.1.1 broker for secagg (authentication always on).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--users-file", required=True,
                        help='JSON object {"username": "password", ...}')
    parser.add_argument("--acl-file", help='JSON {"user": {"subscribe": [...], "publish": [...]}}')
    parser.add_argument("--port-file", help="write the bound port here once listening")
    parser.add_argument("--max-payload", type=int, default=DEFAULT_MAX_PAYLOAD)
    parser.add_argument("--certfile", help="PEM certificate: enables TLS (mqtts)")
    parser.add_argument("--keyfile", help="PEM private key for --certfile")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


async def _serve_process(args: argparse.Namespace) -> None:
    context: ssl.SSLContext | None = None
    if args.certfile:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(args.certfile, args.keyfile)
    broker = EmbeddedBroker(
        users=load_users_file(args.users_file), host=args.host, port=args.port,
        acl=load_acl_file(args.acl_file) if args.acl_file else None, ssl_context=context,
        max_payload=args.max_payload,
    )
    await broker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)
    try:
        if args.port_file:
            _write_port_file(args.port_file, broker.port)
        await stop.wait()
    finally:
        await broker.stop()
        logger.info("final stats: %s", json.dumps(broker.stats.as_dict()))


def main(argv: Sequence[str] | None = None) -> int:
    """Process entry point: ``python -m transport.broker --users-file F --port-file P``."""
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_serve_process(args))
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
