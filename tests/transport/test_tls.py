"""TLS with client certificates, end to end: whole rounds over ``mqtts://`` through the embedded
broker (an ``ssl.SSLContext`` that requires client certificates) and through Mosquitto running
the configuration of docs/deployment.md (read from the document itself), and the refusals a TLS
listener owes: no client certificate, a certificate from another CA, plaintext MQTT.

Every certificate is generated here (``tests/transport/certs.py``); nothing touches the system
store. Every network wait is bounded, so a misbehaving handshake fails the test, not the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import re
import secrets
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiomqtt
import numpy as np
import pytest
from certs import Pki, make_pki

from secagg import Config, Stage, simulate
from transport import topics as topics_mod
from transport.broker import EmbeddedBroker
from transport.drivers import Timeouts
from transport.errors import TransportError
from transport.link import LinkLost
from transport.mosquitto import _free_port, find_mosquitto
from transport.mqtt import BrokerSettings, MqttNetwork, TlsSettings, parse_broker_url
from transport.rounds import RoundReport, run_round

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT_MD = ROOT / "docs" / "deployment.md"

FAST = Timeouts(stage=8.0, start=10.0, retry=1.0, answer=3.0, give_up=30.0,
                resend_interval=0.2)
N = 4
DIM = 64
IDS = list(range(1, N + 1))
NAMES = [topics_mod.SERVER_USER, *(topics_mod.site_name(c) for c in IDS)]

# A refused connection must surface within this bound (connect_timeout + one attempt).
CONNECT_TIMEOUT = 1.0
ATTEMPT_TIMEOUT = 1.0
REFUSAL_BOUND = CONNECT_TIMEOUT + ATTEMPT_TIMEOUT + 3.0

MOSQUITTO = find_mosquitto()
needs_mosquitto = [pytest.mark.mosquitto,
                   pytest.mark.skipif(MOSQUITTO is None, reason="mosquitto is not installed")]
KINDS = ["embedded", pytest.param("mosquitto", marks=needs_mosquitto)]


# --------------------------------------------------------------------------- helpers


def make_inputs(n: int, dim: int, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {cid: rng.integers(0, 1 << 32, dim, dtype=np.uint64) for cid in range(1, n + 1)}


def check(report: RoundReport, config: Config, inputs: dict[int, np.ndarray],
          drop: dict[int, Stage]) -> None:
    """The round equals ``secagg.simulate`` and the plaintext modular sum of ``included``."""
    oracle = simulate(config, inputs, drop, seed=0)
    assert report.included == oracle.included
    assert report.included == frozenset(IDS) - set(drop)
    total = np.asarray(report.total)
    assert np.array_equal(total, oracle.total)
    expected = sum((inputs[c] for c in report.included), np.zeros(config.dim, np.uint64))
    assert np.array_equal(total, expected % np.uint64(1 << config.bits))


def party_tls(pki: Pki) -> dict[str, TlsSettings]:
    """Every party's TlsSettings: the federation CA plus its own certificate and key."""
    return {name: TlsSettings(ca_file=str(pki.ca.cert), cert_file=str(issued.cert),
                              key_file=str(issued.key))
            for name, issued in pki.clients.items()}


def bounded(settings: BrokerSettings) -> BrokerSettings:
    return replace(settings, connect_timeout=CONNECT_TIMEOUT, reconnect_timeout=10.0,
                   publish_timeout=ATTEMPT_TIMEOUT)


@pytest.fixture(autouse=True)
def _collect_garbage() -> Iterator[None]:
    """Finalize this test's leftover futures now: their "never retrieved" log, formatted from
    a finalizer during a later ast.parse, crashes pytest on CPython 3.11.7 (see
    LEAKED_GATHER)."""
    yield
    gc.collect()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), NAMES)


@pytest.fixture(scope="module")
def rogue_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """Another CA issuing certificates with the very same names."""
    return make_pki(tmp_path_factory.mktemp("rogue"), NAMES, ca_name="rogue CA")


# --------------------------------------------------------------------------- brokers


@dataclass
class TlsBroker:
    """A running TLS broker: where to dial and how each party authenticates to it."""

    kind: str
    host: str
    port: int
    passwords: dict[str, str] = field(default_factory=dict)
    log: Path | None = None

    def url(self, scheme: str = "mqtts") -> str:
        return f"{scheme}://{self.host}:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""


def server_context(pki: Pki) -> ssl.SSLContext:
    """The embedded broker's context: our broker certificate, client certificates required."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca.cert))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(pki.broker.cert), str(pki.broker.key))
    context.verify_mode = ssl.CERT_REQUIRED
    return context


@contextlib.asynccontextmanager
async def embedded_tls(pki: Pki) -> AsyncIterator[TlsBroker]:
    # The embedded broker authenticates by password (it does not map the certificate's CN to
    # a username), so each party has both a password and a client certificate.
    users = {name: secrets.token_hex(8) for name in NAMES}
    async with EmbeddedBroker(users=users, acl=topics_mod.acl_table(IDS),
                              ssl_context=server_context(pki)) as b:
        assert b.url.startswith("mqtts://")
        yield TlsBroker("embedded", "127.0.0.1", b.port, users)


def documented_block(heading: str) -> str:
    """The first fenced ``conf`` block under the docs/deployment.md section ``heading``."""
    text = DEPLOYMENT_MD.read_text()
    start = text.index(heading)
    match = re.compile(r"```conf\n(.*?)```", re.S).search(text, start)
    assert match is not None, f"no ```conf block under {heading!r} in {DEPLOYMENT_MD}"
    return match.group(1)


def documented_config(pki: Pki, port: int, acl: Path) -> str:
    """docs/deployment.md section 3, verbatim but for the harness: our certificate paths, a
    free loopback port instead of 8883, and logging to stderr (plus ``user root`` when run as
    root, as ``transport.mosquitto`` does, so Mosquitto can read files in a private dir)."""
    conf = documented_block("## 3. `/etc/mosquitto/conf.d/secagg.conf`")
    substitutions = {
        "/etc/mosquitto/certs/ca.crt": str(pki.ca.cert),
        "/etc/mosquitto/certs/broker.crt": str(pki.broker.cert),
        "/etc/mosquitto/certs/broker.key": str(pki.broker.key),
        "/etc/mosquitto/secagg.acl": str(acl),
    }
    for documented, ours in substitutions.items():
        assert documented in conf, f"docs/deployment.md no longer mentions {documented}"
        conf = conf.replace(documented, ours)
    listener = re.compile(r"^listener 8883$", re.M)
    assert listener.search(conf), "docs/deployment.md: expected 'listener 8883'"
    conf = listener.sub(f"listener {port} 127.0.0.1", conf)
    harness = ["log_dest stderr", "log_type all", "connection_messages true"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        harness.append("user root")
    return conf + "\n# test harness\n" + "\n".join(harness) + "\n"


@contextlib.contextmanager
def documented_mosquitto(pki: Pki, directory: Path) -> Iterator[TlsBroker]:
    """Mosquitto running docs/deployment.md's config and ACL (sections 3 and 4)."""
    assert MOSQUITTO is not None
    directory.mkdir(parents=True, exist_ok=True)
    acl = directory / "secagg.acl"
    acl.write_text(documented_block("## 4. `/etc/mosquitto/secagg.acl`"))
    log = directory / "mosquitto.log"
    for _attempt in range(3):  # a port picked by _free_port can be taken before we bind it
        port = _free_port("127.0.0.1")
        conf = directory / "secagg.conf"
        conf.write_text(documented_config(pki, port, acl))
        with open(log, "wb") as sink:
            process = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=sink,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and process.poll() is None:
                if " running" in log.read_text(errors="replace"):
                    break
                time.sleep(0.02)
            if process.poll() is not None:
                text = log.read_text(errors="replace")
                if "in use" in text:
                    continue
                pytest.fail(f"Mosquitto refused docs/deployment.md's config "
                            f"(exit {process.returncode}):\n{text}\n--- config:\n"
                            f"{conf.read_text()}")
            assert " running" in log.read_text(errors="replace"), log.read_text()
            yield TlsBroker("mosquitto", "localhost", port, log=log)
            return
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(5.0)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(5.0)
    pytest.fail("could not find a free port for Mosquitto")


@contextlib.asynccontextmanager
async def tls_broker(kind: str, pki: Pki, directory: Path) -> AsyncIterator[TlsBroker]:
    if kind == "embedded":
        async with embedded_tls(pki) as b:
            yield b
    else:
        with documented_mosquitto(pki, directory) as b:
            yield b


# --------------------------------------------------------------------------- whole rounds


def test_round_over_embedded_broker_requiring_client_certificates(pki: Pki) -> None:
    config = Config(num_clients=N, dim=DIM)
    inputs = make_inputs(N, DIM, seed=1)
    drop = {3: Stage.MASKED_INPUT}

    async def scenario() -> RoundReport:
        async with embedded_tls(pki) as b:
            url = f"{b.url()}?ca={pki.ca.cert}"
            settings = parse_broker_url(url, passwords=b.passwords, per_party_tls=party_tls(pki),
                                        connect_timeout=10.0, reconnect_timeout=10.0,
                                        publish_timeout=10.0)
            assert settings.tls is not None and settings.url.startswith("mqtts://")
            return await run_round(MqttNetwork(settings), config, inputs, drop,
                                   timeouts=FAST, connect_timeout=20.0)

    report = asyncio.run(asyncio.wait_for(scenario(), 45.0))
    check(report, config, inputs, drop)
    assert report.invalid_payloads == 0 and report.rejected == 0


@pytest.mark.mosquitto
@pytest.mark.skipif(MOSQUITTO is None, reason="mosquitto is not installed")
def test_round_over_mosquitto_with_the_documented_config(pki: Pki, tmp_path: Path) -> None:
    """docs/deployment.md sections 3-5: require_certificate, use_identity_as_username, the
    pattern ACL, and parties that present only TlsSettings(ca, cert, key) -- no passwords."""
    config = Config(num_clients=N, dim=DIM)
    inputs = make_inputs(N, DIM, seed=2)
    drop = {2: Stage.SHARE_KEYS}

    async def scenario(b: TlsBroker) -> RoundReport:
        # host "localhost": the broker certificate's DNS SAN is checked, as in the doc
        settings = BrokerSettings(host=b.host, port=b.port,
                                  tls=TlsSettings(ca_file=str(pki.ca.cert)),
                                  per_party_tls=party_tls(pki), connect_timeout=10.0,
                                  reconnect_timeout=10.0, publish_timeout=10.0)
        return await run_round(MqttNetwork(settings), config, inputs, drop, timeouts=FAST,
                               connect_timeout=20.0)

    with documented_mosquitto(pki, tmp_path / "mosquitto") as b:
        report = asyncio.run(asyncio.wait_for(scenario(b), 45.0))
        log = b.log_text()
    check(report, config, inputs, drop)
    assert report.invalid_payloads == 0 and report.rejected == 0
    # the identities Mosquitto saw are the certificates' CNs
    for name in NAMES:
        assert f"u'{name}'" in log, log[-3000:]


@pytest.mark.mosquitto
@pytest.mark.skipif(MOSQUITTO is None, reason="mosquitto is not installed")
def test_documented_acl_confines_a_site_to_its_own_topics(pki: Pki, tmp_path: Path) -> None:
    """docs/deployment.md section 4's check: site-1, with its own certificate, subscribes to
    site-2's downstream topics and receives nothing, while it does receive its own."""
    round_name = "acl-check"
    t = topics_mod.Topics(round_name)

    def context(name: str) -> ssl.SSLContext:
        return party_tls(pki)[name].context()

    async def scenario(b: TlsBroker) -> list[str]:
        received: list[str] = []
        async with aiomqtt.Client(b.host, b.port, identifier="site-1",
                                  tls_context=context("site-1"), timeout=5.0) as site1:
            await site1.subscribe("secagg/+/client/site-2/#", qos=1)
            await site1.subscribe(t.client_filter(1), qos=1)
            async with aiomqtt.Client(b.host, b.port, identifier="server",
                                      tls_context=context("server"), timeout=5.0) as server:
                await server.publish(t.downstream(2, "receipt"), b"for site-2", qos=1)
                await server.publish(t.downstream(1, "receipt"), b"for site-1", qos=1)

            own = asyncio.Event()

            async def collect() -> None:
                async for message in site1.messages:
                    received.append(str(message.topic))
                    if str(message.topic) == t.downstream(1, "receipt"):
                        own.set()

            # Wait for its own message (a fixed 1.5 s window could close before it came on a
            # loaded machine), then listen 1 s more for anything of site-2's.
            collecting = asyncio.create_task(collect())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(own.wait(), 10.0)
            await asyncio.sleep(1.0)
            collecting.cancel()
            await asyncio.wait({collecting})
        return received

    with documented_mosquitto(pki, tmp_path / "mosquitto") as b:
        received = asyncio.run(asyncio.wait_for(scenario(b), 20.0))
    assert received == [t.downstream(1, "receipt")]


# --------------------------------------------------------------------------- refusals


async def _expect_refusal(settings: BrokerSettings, username: str = "site-1") -> LinkLost:
    """Connect one link as ``username``; it must fail with LinkLost, within the bound."""
    started = time.monotonic()
    with pytest.raises(LinkLost) as info:
        async with asyncio.timeout(REFUSAL_BOUND + 5.0):
            async with MqttNetwork(settings).connect(username):
                pass
    assert time.monotonic() - started < REFUSAL_BOUND
    message = str(info.value)
    assert username in message and f":{settings.port}" in message
    return info.value


@pytest.mark.parametrize("kind", KINDS)
def test_client_without_certificate_is_refused(kind: str, pki: Pki, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with tls_broker(kind, pki, tmp_path / "b") as b:
            # right CA and (for the embedded broker) the right password; no certificate
            settings = bounded(BrokerSettings(
                host=b.host, port=b.port, tls=TlsSettings(ca_file=str(pki.ca.cert)),
                passwords=b.passwords))
            await _expect_refusal(settings)
            # control: the same settings with site-1's certificate do connect
            ok = bounded(BrokerSettings(host=b.host, port=b.port, passwords=b.passwords,
                                        tls=party_tls(pki)["site-1"]))
            async with asyncio.timeout(10.0), MqttNetwork(ok).connect("site-1"):
                pass

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_certificate_from_another_ca_is_refused(kind: str, pki: Pki, rogue_pki: Pki,
                                                tmp_path: Path) -> None:
    async def scenario() -> None:
        async with tls_broker(kind, pki, tmp_path / "b") as b:
            rogue = rogue_pki.clients["site-1"]
            # trusts the real broker, but presents a site-1 certificate of the rogue CA
            tls = TlsSettings(ca_file=str(pki.ca.cert), cert_file=str(rogue.cert),
                              key_file=str(rogue.key))
            await _expect_refusal(bounded(BrokerSettings(host=b.host, port=b.port, tls=tls,
                                                         passwords=b.passwords)))

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_party_refuses_a_broker_certificate_from_another_ca(kind: str, pki: Pki,
                                                            rogue_pki: Pki,
                                                            tmp_path: Path) -> None:
    async def scenario() -> None:
        async with tls_broker(kind, pki, tmp_path / "b") as b:
            # a valid site-1 certificate, but the party trusts only the rogue CA
            mine = pki.clients["site-1"]
            tls = TlsSettings(ca_file=str(rogue_pki.ca.cert), cert_file=str(mine.cert),
                              key_file=str(mine.key))
            lost = await _expect_refusal(bounded(BrokerSettings(
                host=b.host, port=b.port, tls=tls, passwords=b.passwords)))
            assert "CERTIFICATE_VERIFY_FAILED" in str(lost) or "certificate" in str(lost)

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_plaintext_mqtt_to_the_tls_port_fails_cleanly(kind: str, pki: Pki,
                                                      tmp_path: Path) -> None:
    async def scenario() -> None:
        async with tls_broker(kind, pki, tmp_path / "b") as b:
            settings = bounded(parse_broker_url(b.url("mqtt"), passwords=b.passwords))
            assert settings.tls is None
            lost = await _expect_refusal(settings)
            assert f"mqtt://{b.host}:{b.port}" in str(lost)

    asyncio.run(scenario())


def test_run_round_reports_a_refused_certificate_as_a_transport_error(pki: Pki) -> None:
    """Through ``run_round``: one site without a certificate -> TransportError, no hang."""
    config = Config(num_clients=N, dim=8)
    inputs = make_inputs(N, 8)

    async def scenario() -> None:
        async with embedded_tls(pki) as b:
            tls = party_tls(pki)
            tls["site-2"] = TlsSettings(ca_file=str(pki.ca.cert))  # no certificate
            settings = bounded(BrokerSettings(host=b.host, port=b.port, passwords=b.passwords,
                                              tls=TlsSettings(ca_file=str(pki.ca.cert)),
                                              per_party_tls=tls))
            await run_round(MqttNetwork(settings), config, inputs, timeouts=FAST,
                            connect_timeout=REFUSAL_BOUND + 2.0)

    started = time.monotonic()
    with pytest.raises(TransportError, match="site-2"):
        asyncio.run(asyncio.wait_for(scenario(), 30.0))
    assert time.monotonic() - started < REFUSAL_BOUND + 5.0


@pytest.mark.parametrize("case", ["no-certificate", "other-ca", "plaintext"])
@pytest.mark.parametrize("kind", KINDS)
def test_refusal_message_names_the_tls_cause(kind: str, case: str, pki: Pki, rogue_pki: Pki,
                                             tmp_path: Path) -> None:
    """The LinkLost of a TLS refusal says why (certificate / TLS), not just time out: aiomqtt
    ignores a connection closed before the CONNACK and would wait ``publish_timeout``; the
    link fails that attempt at once (transport/mqtt.py ``_fail_fast_before_connack``)."""

    async def scenario() -> LinkLost:
        async with tls_broker(kind, pki, tmp_path / "b") as b:
            if case == "plaintext":
                settings = parse_broker_url(b.url("mqtt"), passwords=b.passwords)
            else:
                rogue = rogue_pki.clients["site-1"]
                tls = (TlsSettings(ca_file=str(pki.ca.cert)) if case == "no-certificate"
                       else TlsSettings(ca_file=str(pki.ca.cert), cert_file=str(rogue.cert),
                                        key_file=str(rogue.key)))
                settings = BrokerSettings(host=b.host, port=b.port, tls=tls,
                                          passwords=b.passwords)
            return await _expect_refusal(bounded(settings))

    message = str(asyncio.run(scenario()))
    assert "timed out" not in message, message
    assert re.search(r"certificate|TLS|SSL|mqtts|reset|closed", message, re.I), message


LEAKED_GATHER = (
    "transport/rounds.py run_round: when a party cannot join, the asyncio.gather(*waiters) "
    "future (and its two Event.wait() waiters) handed to asyncio.wait is never cancelled nor "
    "awaited; the loop's shutdown cancels the waiters, the gather future ends with a "
    "CancelledError nobody retrieves, and asyncio logs '_GatheringFuture exception was never "
    "retrieved' from its finalizer. On CPython 3.11.7 that log's traceback formatting "
    "(ast.parse) can run inside pytest's own ast.parse and abort the session with "
    "INTERNALERROR SystemError 'AST constructor recursion depth mismatch' (reproducible with "
    "tests/transport/test_mqtt_round.py -k 'wrong_password or unreachable')."
)


def test_run_round_leaves_no_unretrieved_future_when_a_party_cannot_join(pki: Pki) -> None:
    config = Config(num_clients=N, dim=8)
    inputs = make_inputs(N, 8)
    contexts: list[dict[str, object]] = []

    async def scenario() -> None:
        async with embedded_tls(pki) as b:
            tls = party_tls(pki)
            tls["site-2"] = TlsSettings(ca_file=str(pki.ca.cert))  # no certificate
            settings = bounded(BrokerSettings(host=b.host, port=b.port, passwords=b.passwords,
                                              tls=TlsSettings(ca_file=str(pki.ca.cert)),
                                              per_party_tls=tls))
            await run_round(MqttNetwork(settings), config, inputs, timeouts=FAST,
                            connect_timeout=REFUSAL_BOUND + 2.0)

    with asyncio.Runner() as runner:
        runner.get_loop().set_exception_handler(lambda _loop, ctx: contexts.append(ctx))
        with pytest.raises(TransportError):
            runner.run(asyncio.wait_for(scenario(), 30.0))
    gc.collect()
    leaked = [str(c.get("message")) for c in contexts
              if "never retrieved" in str(c.get("message"))]
    assert not leaked, leaked
