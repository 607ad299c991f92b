"""The embedded broker: listening socket, session registry, wills, deadlines, shutdown.

:class:`EmbeddedBroker` owns the parts (``Authenticator``, ``AclPolicy``, ``Router``) and
implements the small interface connections use (``connection.BrokerCore``); it never reaches
into a connection's packet handling. :class:`BrokerThread` runs one on its own loop for
synchronous callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl
import threading
import time
from collections.abc import Collection, Iterable, Mapping

from .auth import Authenticator, LoginThrottle
from .config import BrokerLimits, BrokerStats
from .connection import Connection
from .errors import BrokerConfigError, BrokerError, BrokerStartError
from .packets import ProtocolViolation
from .routing import PublishRate, Router
from .session import Session, SessionKey
from .stream import Stream
from .topics import AclPolicy, AclSpec

logger = logging.getLogger("transport.broker")

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


class EmbeddedBroker:
    """Pure-Python asyncio MQTT 3.1.1 broker (see ``transport.broker`` for what it supports).

    Use it as an async context manager (``async with EmbeddedBroker(users=...) as b``), with
    :meth:`start`/:meth:`stop`, in a background thread (:meth:`run_in_thread`), or as a
    process (``python -m transport.broker``). ``users`` maps names to passwords or to scrypt
    hashes (``transport.broker.auth.hash_password``); only hashes are kept. Limits are
    ``limits`` (:class:`BrokerLimits`) with any field overridden by keyword; users in
    ``unthrottled`` (the aggregator, which publishes for every site) have no publish rate.
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
        allow_plaintext: bool = False,
        limits: BrokerLimits | None = None,
        unthrottled: Collection[str] = (),
        **overrides: float,
    ) -> None:
        if not users and not allow_anonymous:
            raise BrokerConfigError(
                "EmbeddedBroker needs users={'name': 'password', ...}: authentication is on "
                "by default; pass allow_anonymous=True only for throwaway local tests"
            )
        if host not in LOOPBACK_HOSTS and ssl_context is None and not allow_plaintext:
            raise BrokerConfigError(
                f"listening on {host} without TLS would send passwords in clear text: give "
                "an ssl_context (--certfile/--keyfile) or allow_plaintext=True "
                "(--allow-plaintext) if the network is private"
            )
        self.limits = (limits or BrokerLimits()).replace(**overrides)
        self.auth = Authenticator(users or {})
        self.throttle = LoginThrottle(self.limits.login_failure_delay,
                                      self.limits.login_failure_max_delay)
        self.host = host
        self._requested_port = port
        self.acl = AclPolicy(acl)
        self.ssl_context = ssl_context
        self.allow_anonymous = allow_anonymous
        self.stats = BrokerStats()
        self.router = Router(self.limits, self.stats, self._drop_slow, self._penalized)
        self.publish_rate = PublishRate(self.limits.max_publish_rate,
                                        self.limits.max_publish_burst, unthrottled)
        self._slow_users: dict[str, float] = {}
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._sessions: dict[SessionKey, Session] = {}
        # the same sessions by username: the per-user cap looks at one user's sessions
        # (O(1) per login for a roster of users, not O(sessions): 10,000 sites log in)
        self._user_sessions: dict[str, dict[SessionKey, Session]] = {}
        self._handlers: set[asyncio.Task[None]] = set()
        self._connections: set[Connection] = set()
        self._per_user: dict[str, int] = {}
        self._watchdog: asyncio.Task[None] | None = None
        self._pending: dict[Connection, None] = {}  # not logged in yet, oldest first
        # the same by peer address (oldest first): a login's room is made among its own
        # address's connections in O(1), not by scanning every pending login
        self._pending_by_host: dict[str, dict[Connection, None]] = {}
        self._stopping = False

    # -- public ------------------------------------------------------------------------

    @property
    def max_payload(self) -> int:
        return self.limits.max_payload

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
        if self.host not in LOOPBACK_HOSTS and self.ssl_context is None:
            logger.warning("embedded broker listens on %s without TLS (explicitly allowed); "
                           "passwords travel in clear text", self.host)
        try:
            server = await asyncio.get_running_loop().create_server(
                lambda: Stream(self._accept), self.host, self._requested_port,
                ssl=self.ssl_context,
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
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        logger.info("embedded MQTT broker listening on %s", self.url)

    async def stop(self) -> None:
        """Stop accepting, publish the will of every client still connected (MQTT 3.1.1
        section 3.1.2.5: the network connection closes without DISCONNECT), let the wills
        reach their subscribers for up to a second, then close every connection."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping = True
        server.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
        live = [c for c in self._connections if c.connected and not c.closed]
        for connection in live:
            if not connection.clean_disconnect:
                self._publish_will(connection)
                connection.will = None
        writers = [c.writer_task for c in live if c.writer_task is not None]
        for connection in live:
            connection.outbox.close()
        if writers:
            await asyncio.wait(writers, timeout=1.0)
        for connection in list(self._connections):
            connection.abort()
        handlers = list(self._handlers)
        if handlers:
            await asyncio.wait(handlers, timeout=5.0)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 5.0)
        self._sessions.clear()
        self._user_sessions.clear()
        logger.info("embedded MQTT broker on port %s stopped", self._port)

    async def serve_forever(self) -> None:
        """Run until cancelled."""
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

    # -- BrokerCore (what connections call) ----------------------------------------------

    def user_connections(self, username: str) -> int:
        return self._per_user.get(username, 0)

    def open_session(self, connection: Connection, clean: bool) -> tuple[Session, bool]:
        """Sessions are keyed by (username, client id): another user's connection with the
        same client id gets a session of its own and closes nothing."""
        key = (connection.username, connection.client_id)
        session = self._sessions.get(key)
        if session is not None and session.connection is not None:
            old = session.connection
            logger.info("%r reconnected; closing its previous connection", connection)
            old.abort()
            session.detach()
        present = session is not None and not clean and session.persistent
        if session is not None and not present:
            self._discard(session)
            session = None
        if session is None:
            self._evict_offline(connection.username)
            session = Session(connection.username, connection.client_id, persistent=not clean,
                              max_inflight=self.limits.max_inflight,
                              max_queued_bytes=self.limits.max_queued_bytes,
                              max_queue=self.limits.max_session_queue)
            self._sessions[key] = session
            self._user_sessions.setdefault(connection.username, {})[key] = session
        self._per_user[connection.username] = self.user_connections(connection.username) + 1
        self._unpend(connection)
        return session, present

    def spawn_writer(self, connection: Connection) -> None:
        task = asyncio.get_running_loop().create_task(self._run_writer(connection))
        connection.writer_task = task

    # -- internals ---------------------------------------------------------------------

    def _evict_offline(self, username: str) -> None:
        """At most ``max_sessions_per_user`` sessions per user: the oldest offline go."""
        mine = list(self._user_sessions.get(username, {}).values())
        if len(mine) < self.limits.max_sessions_per_user:
            return
        offline = sorted((s for s in mine if s.connection is None), key=lambda s: s.detached_at)
        for session in offline[:len(mine) - self.limits.max_sessions_per_user + 1]:
            logger.info("%r: offline session discarded (per-user session cap)", session)
            self._discard(session)

    def _discard(self, session: Session) -> None:
        for topic_filter in session.subscriptions:
            self.router.index.remove(topic_filter, session)
        session.subscriptions.clear()
        if self._sessions.get(session.key) is session:
            del self._sessions[session.key]
            mine = self._user_sessions[session.username]
            del mine[session.key]
            if not mine:
                del self._user_sessions[session.username]

    async def _run_writer(self, connection: Connection) -> None:
        try:
            await connection.outbox.run()
        except (ConnectionError, OSError, RuntimeError) as exc:
            logger.debug("%r: write failed: %s", connection, exc)
            connection.abort()

    def _drop_slow(self, session: Session) -> None:
        connection = session.connection
        if connection is None or connection.closed:
            return
        self.stats.slow_consumers_dropped += 1
        now = time.monotonic()
        self._slow_users[session.username] = now
        if len(self._slow_users) > 10_000:  # bounded: forget the expired
            self._slow_users = {u: t for u, t in self._slow_users.items()
                                if now - t < self.limits.slow_consumer_penalty}
        over = now - session.over_since if session.over_since is not None else 0.0
        logger.warning("%r: dropped as a slow consumer (%d bytes queued, over its limit of "
                       "%d for %.1f s)", connection, session.queued_bytes,
                       session.max_queued_bytes, over)
        connection.abort()

    def _penalized(self, username: str) -> bool:
        at = self._slow_users.get(username)
        return at is not None and time.monotonic() - at < self.limits.slow_consumer_penalty

    def _publish_will(self, connection: Connection) -> None:
        will = connection.will
        if will is None:
            return
        if not self.acl.allowed(connection.username, connection.client_id, "publish",
                                will.topic):
            self.stats.acl_denials += 1
            logger.warning("%r: will to %r denied by ACL; dropped", connection, will.topic)
            return
        if will.retain and not (
                self.acl.allowed(connection.username, connection.client_id, "retain",
                                 will.topic)
                and self.router.retained.set(will, connection.username)):
            self.stats.retain_denials += 1
            logger.warning("%r: retained will on %r refused", connection, will.topic)
            return
        self.stats.wills_published += 1
        logger.debug("%r: publishing will to %r", connection, will.topic)
        self.router.fan_out(will)

    async def _watch(self) -> None:
        """Close connections past a deadline: no CONNECT in time, a packet left half-sent,
        or silence past 1.5 x keepalive (``Connection.overdue``)."""
        limits = self.limits
        tick = min(0.5, limits.connect_timeout / 4, limits.packet_timeout / 4)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for connection in list(self._connections):
                reason = connection.overdue(now)
                if reason is not None:
                    logger.warning("%r: %s; closing", connection, reason)
                    connection.abort()
                elif connection.session is not None:
                    self.router.check_drain(connection.session, now)

    def _accept(self, stream: Stream) -> None:
        if self._stopping or len(self._connections) >= self.limits.max_connections:
            self.stats.connections_refused += 1
            logger.warning("connection from %s refused: %d connections (cap %d)", stream.peer,
                           len(self._connections), self.limits.max_connections)
            stream.abort()
            return
        if not self._make_room_for_login(stream.peer_host):
            self.stats.connections_refused += 1
            logger.warning("connection from %s refused: every connection waiting to log in "
                           "is already being authenticated", stream.peer)
            stream.abort()
            return
        connection = Connection(self, stream)
        self._connections.add(connection)
        self._pending[connection] = None
        self._pending_by_host.setdefault(stream.peer_host, {})[connection] = None
        task = asyncio.get_running_loop().create_task(self._handle(connection))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    def _make_room_for_login(self, address: str) -> bool:
        """At most ``max_pending_logins`` connections (``max_pending_logins_per_address``
        from one address) wait to log in; a newcomer evicts the oldest of them that has not
        even sent its CONNECT (an honest client sends it at once, a lurker never does)."""
        limits = self.limits
        same = self._pending_by_host.get(address, {})
        if len(same) >= limits.max_pending_logins_per_address:
            candidates: Iterable[Connection] = same
        elif len(self._pending) >= limits.max_pending_logins:
            candidates = self._pending
        else:
            return True
        victim = next((c for c in candidates if not c.authenticating), None)
        if victim is None:
            return False
        logger.info("%r evicted: it did not log in and a new connection needs its place",
                    victim)
        self._unpend(victim)
        victim.abort()
        return True

    def _unpend(self, connection: Connection) -> None:
        """``connection`` no longer waits to log in (logged in, evicted or closed)."""
        if connection not in self._pending:
            return
        del self._pending[connection]
        host = connection.stream.peer_host
        mine = self._pending_by_host[host]
        del mine[connection]
        if not mine:
            del self._pending_by_host[host]

    async def _handle(self, connection: Connection) -> None:
        """Per-connection task: whatever the peer sends, only this connection is affected."""
        self.stats.connections_total += 1
        self.stats.connections_current += 1
        try:
            await connection.serve()
        except asyncio.IncompleteReadError:
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
            await self._cleanup(connection)

    async def _cleanup(self, connection: Connection) -> None:
        was_closed = connection.closed
        connection.closed = True
        connection.outbox.close()
        self._connections.discard(connection)
        self._unpend(connection)
        self.stats.connections_current -= 1
        session = connection.session
        if session is not None:
            if session.over():  # it left (or was dropped) with more queued than it may have
                self._slow_users[connection.username] = time.monotonic()
            self._per_user[connection.username] -= 1
            if not self._per_user[connection.username]:
                del self._per_user[connection.username]
            if session.connection is connection:
                session.detach()
                if not session.persistent:
                    self._discard(session)
        writer_task = connection.writer_task
        if connection.connected and not connection.clean_disconnect:
            try:
                self._publish_will(connection)
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


class BrokerThread:
    """An :class:`EmbeddedBroker` running on its own event loop in a daemon thread.

    Why: synchronous callers and tests need a broker while their own code blocks; a thread is
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
