"""The aiomqtt (2.x) binding of ``transport.link``: one MQTT connection per party.

Everything about reaching the broker is configuration (``BrokerSettings``): host, port, TLS
with an optional client certificate, and a username/password per party. A link publishes at
QoS 1, reconnects with backoff after a lost connection (re-subscribing, then reporting
``Reconnected`` so the driver re-sends), and gives up with ``LinkLost`` after
``reconnect_timeout`` seconds. aiomqtt does not surface a broker's refusal of a publish (an
ACL denial is acknowledged like a success), so the drivers confirm delivery with receipts at
the protocol level; ``publish`` returning True only means the broker took the packet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import aiomqtt

from .link import Delivery, Event, LinkLost, Reconnected, Will
from .tasks import cancel_requests, raise_if_cancelled, retrieve_outcome, stop_task

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class TlsSettings:
    """TLS for ``mqtts://``: the CA that signed the broker's certificate (None: the system
    store) and, for client-certificate authentication, this party's certificate and key."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify_hostname: bool = True

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.check_hostname = self.verify_hostname
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        elif self.key_file:
            raise ValueError("TLS key_file given without cert_file")
        return context


@dataclass(frozen=True)
class BrokerSettings:
    """Where the broker is and how each party authenticates to it."""

    host: str = "127.0.0.1"
    port: int = 1883
    tls: TlsSettings | None = None
    username: str | None = None
    """Used for every party that has no entry in ``passwords`` (an existing broker)."""
    password: str | None = None
    passwords: Mapping[str, str] = field(default_factory=dict, repr=False)
    """username -> password, one per party (what ``secagg simulate`` generates)."""
    per_party_tls: Mapping[str, TlsSettings] = field(default_factory=dict)
    """username -> TLS settings with that party's client certificate."""
    client_id_suffix: str = ""
    """Appended to every MQTT client identifier (``<username><suffix>``): runs that share
    one broker (and, with one shared login, one username) do not replace each other's
    connections."""
    keepalive: int = 20
    connect_timeout: float = 30.0
    reconnect_timeout: float = 30.0
    publish_timeout: float = 30.0

    @property
    def url(self) -> str:
        scheme = "mqtts" if self.tls is not None else "mqtt"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    def credentials(self, username: str) -> tuple[str | None, str | None]:
        if username in self.passwords:
            return username, self.passwords[username]
        return self.username, self.password

    def tls_for(self, username: str) -> TlsSettings | None:
        return self.per_party_tls.get(username, self.tls)


def probe(settings: BrokerSettings, timeout: float = 2.0) -> None:
    """Raise ``LinkLost`` within ``timeout`` seconds when nothing accepts TCP connections at
    the broker's address (a wrong host or port fails in one line, not after retries)."""
    try:
        socket.create_connection((settings.host, settings.port), timeout=timeout).close()
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise LinkLost(f"cannot reach the MQTT broker at {settings.url}: {reason}") from None


def parse_broker_url(url: str, **overrides: object) -> BrokerSettings:
    """``mqtt://[user:password@]host[:port]`` or ``mqtts://...?ca=CA&cert=CERT&key=KEY``.

    With credentials in the URL every party connects as that user (fine for a development
    broker; a federation gives each site its own credentials, docs/deployment.md).
    """
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("mqtt", "mqtts"):
        raise ValueError(f"broker URL {url!r}: use mqtt://host:port or mqtts://host:port")
    if not parsed.hostname:
        raise ValueError(f"broker URL {url!r} has no host name")
    try:
        port = parsed.port
    except ValueError:
        raise ValueError(f"broker URL {url!r} has an invalid port") from None
    query = urllib.parse.parse_qs(parsed.query)
    known = {"ca", "cert", "key", "insecure"}
    unknown = sorted(set(query) - known)
    if unknown:
        raise ValueError(f"broker URL {url!r}: unknown parameters {unknown}; use "
                         f"{sorted(known)}")
    tls = None
    if parsed.scheme == "mqtts":
        tls = TlsSettings(ca_file=query.get("ca", [None])[0],
                          cert_file=query.get("cert", [None])[0],
                          key_file=query.get("key", [None])[0],
                          verify_hostname=query.get("insecure", ["0"])[0] in ("0", "false"))
    elif set(query) & known:
        raise ValueError(f"broker URL {url!r}: TLS parameters need mqtts://")
    settings = BrokerSettings(
        host=parsed.hostname, port=port or (8883 if tls else 1883), tls=tls,
        username=urllib.parse.unquote(parsed.username) if parsed.username else None,
        password=urllib.parse.unquote(parsed.password) if parsed.password else None)
    # overrides are keyword arguments of BrokerSettings, typed by the caller as objects
    return replace(settings, **overrides)  # type: ignore[arg-type]


async def _discard(client: aiomqtt.Client) -> None:
    """Close a client that failed or was cancelled while connecting; bounded, silent."""
    connected = getattr(client, "_connected", None)
    try:
        if (isinstance(connected, asyncio.Future) and connected.done()
                and not connected.cancelled() and connected.exception() is None):
            async with asyncio.timeout(1.0):
                await asyncio.shield(client.__aexit__(None, None, None))
    except Exception:  # a client that failed anyway: nothing to report
        pass
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the caller's own cancellation, not aiomqtt's
    finally:
        # aiomqtt leaves the socket registered with the loop when __aenter__ was cancelled;
        # closing it through paho unregisters it, so no callback fires into a dead client.
        paho = getattr(client, "_client", None)
        if paho is not None:
            with contextlib.suppress(Exception):
                paho._sock_close()


CLOSED_FIRST = ("the broker closed the connection before accepting it (at a TLS port: a "
                "missing or untrusted client certificate, or mqtt:// instead of mqtts://)")
CLOSED_AGAIN = ("the connection was closed before the broker accepted it, by the network "
                "between or a restarting broker (the broker accepted these settings before)")
"""Why a connection closes before its CONNACK, by what failed (issue 30: a network partition
was reported as a certificate problem): before this link's first connection, its settings
may be wrong; after it, they are not."""


def _fail_fast_before_connack(client: aiomqtt.Client, reason: str = CLOSED_FIRST) -> None:
    """Make a connection the broker closes before its CONNACK fail the attempt at once.

    aiomqtt ignores a disconnection that comes before the CONNACK (its ``_on_disconnect``
    returns early), so ``__aenter__`` waits out its whole timeout (``publish_timeout``, 30 s
    by default) for a CONNACK that cannot come: a broker restarting resets the first
    connections that reach it, and every party then spent its whole reconnect timeout on
    that one attempt (measured: 3 of 9 runs of a broker restart under 4 train processes
    hung or gave up)."""
    paho = client._client
    forward = paho.on_disconnect
    loop = client._loop

    def fail() -> None:
        connected = client._connected
        if not connected.done():
            connected.add_done_callback(retrieve_outcome)
            connected.set_exception(aiomqtt.MqttError(reason))

    def on_disconnect(*args: Any, **kwargs: Any) -> None:
        loop.call_soon_threadsafe(fail)  # paho may call this from aiomqtt's connect thread
        if forward is not None:
            forward(*args, **kwargs)

    paho.on_disconnect = on_disconnect


def _decode_publish_once(original: Callable[..., Any]) -> Callable[..., Any]:
    """paho-mqtt 2.2's ``decode_publish`` with the payload copied once, not three times.

    paho splits a received PUBLISH with three ``struct.unpack("!H<n>s")`` calls, each of
    which copies the rest of the packet: every frame's payload three times over, on every
    receiver (the aggregation server receives every masked input: 40 MB per round at
    n = 10, d = 10^6, issue 32). This reads the topic length, topic and packet id in place
    and copies only the payload; the result is the same ``PublishPacket``. MQTT 5 packets
    (properties) and malformed ones go to paho's own decoder, which raises what it
    raises."""
    from paho.mqtt import _packet
    from paho.mqtt.enums import MQTTProtocolVersion

    def decode_publish(header: int, packet: bytes | bytearray,
                       protocol: MQTTProtocolVersion) -> Any:
        if protocol == MQTTProtocolVersion.MQTTv5 or len(packet) < 2:
            return original(header, packet, protocol)
        qos = (header & 0x06) >> 1
        with memoryview(packet) as view:
            end = 2 + int.from_bytes(view[:2], "big")
            if end == 2 or end + (2 if qos else 0) > len(view):
                return original(header, packet, protocol)  # empty topic, truncated
            topic = bytes(view[2:end])
            mid = 0
            if qos:
                mid, end = int.from_bytes(view[end:end + 2], "big"), end + 2
            payload = bytes(view[end:])
        return _packet.PublishPacket(dup=bool(header & 0x08), qos=qos,
                                     retain=bool(header & 0x01), topic=topic, mid=mid,
                                     properties=None, payload=payload)

    decode_publish.secagg_once = True  # type: ignore[attr-defined]
    return decode_publish


def _install_decode_publish_once() -> None:
    """Install ``_decode_publish_once`` in paho (once per process; paho's client looks
    the decoder up on its module at every packet). A paho without that module (another
    version) keeps its own."""
    try:
        from paho.mqtt import _packet
    except ImportError:
        return
    original = getattr(_packet, "decode_publish", None)
    if original is None or getattr(original, "secagg_once", False):
        return
    _packet.decode_publish = _decode_publish_once(original)


_install_decode_publish_once()


MISC_SHARE = 0.25
"""How often (a share of the keepalive, at least every second) a link's client runs paho's
housekeeping (``loop_misc``: the keepalive ping and its timeout)."""


class _Client(aiomqtt.Client):
    """aiomqtt's client whose housekeeping task wakes every ``MISC_SHARE`` x keepalive
    seconds instead of every second: a worker process of ``secagg simulate`` holding 5,000
    sites otherwise woke 5,000 times a second for nothing (about a third of a starved worker's
    samples at 10,000 clients). A ping then leaves at most a quarter keepalive late, well
    within the 1.5 x keepalive a broker waits.

    Its paho client queues outgoing packets as views: paho writes ``packet[pos:]``, which
    for its ``bytearray`` copies the whole packet again at every write (a frame of a masked
    input: 1 MiB per send, issue 32); a slice of a view copies nothing."""

    def __init__(self, *args: Any, keepalive: int = 60, **kwargs: Any) -> None:
        super().__init__(*args, keepalive=keepalive, **kwargs)
        self.misc_interval = max(1.0, MISC_SHARE * keepalive)
        paho = self._client
        queue = paho._packet_queue

        def packet_queue(command: int, packet: bytes | bytearray, mid: int, qos: int,
                         info: Any = None) -> Any:
            return queue(command, memoryview(packet), mid, qos, info)  # type: ignore[arg-type]

        paho._packet_queue = packet_queue  # type: ignore[method-assign]

    async def _misc_loop(self) -> None:  # aiomqtt 2.x's task (loop_misc every 1 s there)
        while self._client.loop_misc() == 0:  # MQTT_ERR_SUCCESS
            await asyncio.sleep(self.misc_interval)


class MqttLink:
    """One party's connection; see ``transport.link.Link``."""

    def __init__(self, settings: BrokerSettings, username: str, will: Will | None,
                 client_factory: Callable[..., aiomqtt.Client] = _Client) -> None:
        self._settings = settings
        self._name = username
        self._will = will
        self._factory = client_factory
        self._client: aiomqtt.Client | None = None
        self._filters: list[str] = []
        self._queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        self._up = asyncio.Event()
        self._down = asyncio.Event()
        self._gone = asyncio.Event()  # reconnection gave up: nothing waits for ``_up`` now
        self._pump: asyncio.Task[None] | None = None
        self._closing = False
        self._attempts = 0
        self._connected_once = False  # the broker accepted these settings once
        self._ssl: ssl.SSLContext | None = None
        tls = settings.tls_for(username)
        if tls is not None:
            self._ssl = tls.context()

    @property
    def name(self) -> str:
        return self._name

    def _new_client(self) -> aiomqtt.Client:
        username, password = self._settings.credentials(self._name)
        will = (aiomqtt.Will(self._will.topic, self._will.payload, qos=1)
                if self._will is not None else None)
        client = self._factory(
            self._settings.host, self._settings.port, username=username, password=password,
            identifier=self._name + self._settings.client_id_suffix, will=will,
            clean_session=True,
            keepalive=self._settings.keepalive, tls_context=self._ssl,
            timeout=self._settings.publish_timeout, max_inflight_messages=100,
            # Small receipts right after large frames would otherwise wait for delayed ACKs.
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        # The server publishes to every site at once; many pending QoS 1 publishes are normal.
        client.pending_calls_threshold = 1 << 30
        _fail_fast_before_connack(client, CLOSED_AGAIN if self._connected_once else CLOSED_FIRST)
        return client

    async def _connect(self, deadline: float) -> aiomqtt.Client:
        """A connected client holding this link's subscriptions, or ``LinkLost`` by
        ``deadline`` (``loop.time()``): every attempt, and every await in it (a TCP connect
        in aiomqtt's executor thread, a CONNACK, a SUBACK), ends by then."""
        last: list[Exception] = []
        before = cancel_requests()
        try:
            async with asyncio.timeout_at(deadline):
                client = await self._try_connect(deadline, last)
                try:
                    raise_if_cancelled(before)  # a cancel aiomqtt's wait_for dropped
                except BaseException:
                    await _discard(client)
                    raise
                return client
        except TimeoutError:
            reason = last[-1] if last else "no answer in time"
            raise LinkLost(f"{self._name}: cannot reach the MQTT broker at "
                           f"{self._settings.url} within its timeout: {reason}") from None

    async def _try_connect(self, deadline: float, last: list[Exception]) -> aiomqtt.Client:
        loop = asyncio.get_running_loop()
        delay = 0.05
        while True:
            client = self._new_client()
            try:
                await client.__aenter__()
                # aiomqtt's "Unexpected disconnection" future is retrieved only by a
                # __aexit__ that a stop may cut short; a cut connection is no news.
                client._disconnected.add_done_callback(retrieve_outcome)
                await self._renew(client)
                self._connected_once = True
                return client
            except aiomqtt.MqttError as exc:
                last.append(exc)
                logger.debug("%s: connection attempt failed: %r", self._name, exc)
                await _discard(client)
                if isinstance(exc, aiomqtt.MqttCodeError) and exc.rc in (4, 5, 134, 135):
                    raise LinkLost(f"{self._name}: the broker at {self._settings.url} refused "
                                   f"the credentials ({exc})") from None
            except BaseException:
                # Cancelled half-way (the caller gave up, or the deadline passed): leave no
                # client behind whose callbacks fire into a closed loop.
                await _discard(client)
                raise
            if loop.time() + delay > deadline:
                raise LinkLost(f"{self._name}: cannot reach the MQTT broker at "
                               f"{self._settings.url}: {last[-1]}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _renew(self, client: aiomqtt.Client) -> None:
        """Subscribe a new connection to the filters this link holds; a filter dropped by
        ``unsubscribe`` meanwhile is dropped at the broker too."""
        held = list(self._filters)
        for topic_filter in held:
            self._check_granted(topic_filter,
                                await client.subscribe(topic_filter, qos=1))
        for topic_filter in held:
            if topic_filter not in self._filters:
                await client.unsubscribe(topic_filter)

    def _check_granted(self, topic_filter: str, granted: Iterable[object]) -> None:
        """``LinkLost`` naming the likely cause when the SUBACK refuses ``topic_filter``.

        MQTT 3.1.1 has one refusal code (0x80) for every cause, so the message names the
        two a federation meets: the ACL, and a cap on subscriptions per session (the
        embedded broker's ``max_subscriptions``, 64) with how many this link already holds.
        """
        codes = [getattr(c, "value", c) for c in granted]
        if not any(isinstance(c, int) and c >= 0x80 for c in codes):
            return
        if topic_filter in self._filters:  # not held: no reconnection asks for it again
            self._filters.remove(topic_filter)
        others = len(self._filters)
        raise LinkLost(f"{self._name}: the broker at {self._settings.url} refused the "
                       f"subscription to {topic_filter} (SUBACK 0x80) while this connection "
                       f"holds {others} other subscriptions: either its ACL does not grant "
                       f"{topic_filter} to {self._name}, or {others} is its cap on "
                       f"subscriptions per session (the embedded broker's "
                       f"BrokerLimits.max_subscriptions)")

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        self._client = await self._connect(loop.time() + self._settings.connect_timeout)
        self._up.set()
        self._pump = asyncio.create_task(self._run_pump(), name=f"mqtt-pump-{self._name}")

    async def close(self) -> None:
        self._closing = True
        if self._pump is not None:
            await stop_task(self._pump)
        client, self._client = self._client, None
        if client is not None:
            # A graceful DISCONNECT (no will); bounded, so closing never hangs a caller.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await client.__aexit__(None, None, None)

    async def _run_pump(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            client = self._client
            assert client is not None
            try:
                async for message in client.messages:
                    payload = message.payload
                    if not isinstance(payload, (bytes, bytearray)):
                        continue
                    self._queue.put_nowait(Delivery(str(message.topic), bytes(payload)))
            except aiomqtt.MqttError as exc:
                if self._closing:
                    return
                logger.warning("%s: connection to %s lost (%s); reconnecting", self._name,
                               self._settings.url, exc)
            self._up.clear()
            self._down.set()
            await _discard(client)  # bounded: a dead socket must not stall the reconnection
            try:
                self._client = await self._connect(loop.time()
                                                   + self._settings.reconnect_timeout)
            except LinkLost as exc:
                self._gone.set()
                self._queue.put_nowait(exc)
                return
            self._attempts += 1
            logger.info("%s: reconnected to %s", self._name, self._settings.url)
            self._down.clear()
            self._up.set()
            self._queue.put_nowait(Reconnected(self._attempts))

    async def _while_up(self, call: Coroutine[Any, Any, T]) -> tuple[bool, T | None]:
        """Run ``call`` on the live connection; (False, None) if the connection drops first.

        aiomqtt keeps waiting for the PUBACK, SUBACK or UNSUBACK of a call whose connection
        died (up to its timeout); this stops waiting as soon as the link goes down."""
        before = cancel_requests()
        task = asyncio.ensure_future(call)
        down = asyncio.ensure_future(self._down.wait())
        try:
            await asyncio.wait((task, down), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            down.cancel()
        if not task.done():
            await stop_task(task)
            return False, None
        raise_if_cancelled(before)  # a cancel aiomqtt's wait_for dropped as it completed
        return True, task.result()

    async def subscribe(self, topic_filter: str) -> None:
        if topic_filter not in self._filters:
            self._filters.append(topic_filter)
        client = self._client
        if client is None or not self._up.is_set():
            return  # subscribed on the reconnection
        try:
            done, granted = await self._while_up(client.subscribe(topic_filter, qos=1))
        except aiomqtt.MqttError as exc:
            logger.info("%s: subscribe to %s failed: %s", self._name, topic_filter, exc)
            return  # the connection is failing; the reconnection subscribes
        if done and granted is not None:
            self._check_granted(topic_filter, granted)

    async def unsubscribe(self, topic_filter: str) -> None:
        if topic_filter not in self._filters:
            return
        self._filters.remove(topic_filter)
        client = self._client
        if client is None or not self._up.is_set():
            return  # a reconnection does not renew it
        try:
            await self._while_up(client.unsubscribe(topic_filter))
        except aiomqtt.MqttError as exc:
            logger.info("%s: unsubscribe from %s failed: %s", self._name, topic_filter, exc)

    async def _wait_up(self) -> bool:
        """True once connected; False after ``reconnect_timeout`` or once the link gave up."""
        if self._up.is_set():
            return True
        if self._gone.is_set():
            return False
        up = asyncio.ensure_future(self._up.wait())
        gone = asyncio.ensure_future(self._gone.wait())
        try:
            await asyncio.wait((up, gone), timeout=self._settings.reconnect_timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            up.cancel()
            gone.cancel()
        return self._up.is_set()

    async def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> bool:
        if not await self._wait_up():
            return False
        client = self._client
        if client is None:
            return False
        try:
            done, _ = await self._while_up(client.publish(topic, payload, qos=1,
                                                          retain=retain))
        except aiomqtt.MqttError as exc:
            logger.info("%s: publish to %s failed: %s", self._name, topic, exc)
            return False
        return done

    async def receive(self, timeout: float | None = None) -> Event | None:
        try:
            async with asyncio.timeout(timeout):
                item = await self._queue.get()
        except TimeoutError:
            return None
        if isinstance(item, BaseException):
            raise item
        return item


class MqttNetwork:
    """Opens ``MqttLink``s to one broker; see ``transport.link.Network``."""

    def __init__(self, settings: BrokerSettings) -> None:
        self.settings = settings

    @asynccontextmanager
    async def connect(self, username: str, *,
                      will: Will | None = None) -> AsyncIterator[MqttLink]:
        link = MqttLink(self.settings, username, will)
        await link.open()
        try:
            yield link
        finally:
            await link.close()
