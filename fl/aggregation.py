"""The one adapter between federated training and the secure-aggregation transport.

Training code calls :meth:`Aggregator.aggregate` with a ``secagg.Config``, one ``uint64``
vector per site and the simulated dropouts, and gets the modular sum and the included
sites back. Everything that knows the transport's API (``transport.rounds.run_round``,
the networks, broker start-up) lives in this file so a change there is a change here only.

Brokers: ``memory`` (in-process bus with MQTT semantics), ``embedded`` (the pure-Python
MQTT broker in its own process: the default, no install needed), ``mosquitto`` (a local
Mosquitto with a generated config), or ``mqtt(s)://host:port`` (an existing broker). Every
site and the coordinator get their own MQTT user and the topic ACL of ``transport.topics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from secagg import Config, Stage, simulate
from transport import (
    SERVER_USER,
    MemoryNetwork,
    MqttNetwork,
    acl_table,
    broker_for,
    mosquitto_available,
    parse_broker_url,
    round_timeouts,
    run_round,
    site_name,
)

U64 = npt.NDArray[np.uint64]
BROKER_KINDS = ("embedded", "memory", "mosquitto")
Tap = Callable[[str, str, bytes], list[bytes]]


@dataclass(frozen=True)
class AggregateOutcome:
    """One round's result: the sum mod 2**bits of the included sites' inputs."""

    total: U64
    included: frozenset[int]
    dropped: Mapping[int, str] = field(default_factory=dict)
    seconds: float = 0.0
    bytes_sent: Mapping[int, int] = field(default_factory=dict)


class Aggregator(Protocol):
    """Runs one secure aggregation; raises ``secagg.ProtocolAbort`` if too few survive."""

    name: str

    def aggregate(self, config: Config, inputs: Mapping[int, U64],
                  drop: Mapping[int, Stage]) -> AggregateOutcome: ...


def check_broker(broker: str, kinds: Sequence[str] = BROKER_KINDS) -> str:
    """Validate a ``--broker`` value (one of ``kinds`` or an ``mqtt(s)://`` URL); returns it
    or raises ``ValueError`` saying what to use. The one broker check of the command line."""
    if broker in kinds:
        if broker == "mosquitto" and not mosquitto_available():
            raise ValueError("--broker mosquitto: no mosquitto binary found; install it "
                             "(apt-get install mosquitto) or use --broker embedded")
        return broker
    if broker.startswith(("mqtt://", "mqtts://")):
        parse_broker_url(broker)
        return broker
    raise ValueError(f"--broker {broker}: use {', '.join(kinds)}, mqtt://host:port or "
                     "mqtts://host:port")


class TransportAggregator:
    """Each round over ``transport.rounds.run_round`` on a fresh network from ``factory``."""

    def __init__(self, name: str, factory: Callable[[], Any]) -> None:
        self.name = name
        self._factory = factory

    def aggregate(self, config: Config, inputs: Mapping[int, U64],
                  drop: Mapping[int, Stage]) -> AggregateOutcome:
        # every party of the round runs on this one event loop: n clients share a core
        timeouts = round_timeouts(clients=config.num_clients, dim=config.dim,
                                  neighbors=config.neighbors, malicious=config.malicious,
                                  colocated=config.num_clients,
                                  validated=config.norm_bound is not None)

        async def one_round() -> Any:
            return await run_round(self._factory(), config, dict(inputs), dict(drop),
                                   timeouts=timeouts)

        started = time.perf_counter()
        report = asyncio.run(one_round())
        result = report.result
        return AggregateOutcome(
            total=np.asarray(result.total, dtype=np.uint64), included=result.included,
            dropped={cid: Stage(s).label for cid, s in result.dropped.items()},
            seconds=time.perf_counter() - started,
            bytes_sent={cid: sum(o.bytes_sent.values()) for cid, o in report.outcomes.items()})


class InProcessAggregator:
    """``secagg.simulate``: the reference driver, no transport (for comparisons)."""

    name = "inprocess"

    def aggregate(self, config: Config, inputs: Mapping[int, U64],
                  drop: Mapping[int, Stage]) -> AggregateOutcome:
        started = time.perf_counter()
        result = simulate(config, dict(inputs), dict(drop))
        return AggregateOutcome(
            total=np.asarray(result.total, dtype=np.uint64), included=result.included,
            dropped={cid: Stage(s).label for cid, s in result.dropped.items()},
            seconds=time.perf_counter() - started,
            bytes_sent={cid: sum(v.values()) for cid, v in result.bytes_sent.items()})


@contextlib.contextmanager
def open_aggregator(broker: str, site_ids: Sequence[int], *,
                    tap: Tap | None = None) -> Iterator[Aggregator]:
    """An aggregator for the federation's sites over ``broker``, alive for the whole run.

    ``tap`` (memory bus only) sees every publish ``(username, topic, payload)``: tests use it
    to capture what each site puts on the wire.
    """
    if broker == "inprocess":
        yield InProcessAggregator()
        return
    check_broker(broker)
    acl = acl_table(sorted(site_ids))
    if broker == "memory":
        def memory() -> Any:
            network = MemoryNetwork(acl=acl)
            network.tap = tap
            return network

        yield TransportAggregator("memory", memory)
        return
    if tap is not None:
        raise ValueError("tap is only available with the memory broker")

    passwords = {SERVER_USER: secrets.token_urlsafe(18)}
    passwords.update({site_name(cid): secrets.token_urlsafe(18) for cid in site_ids})
    with broker_for(broker, passwords, acl) as settings:
        yield TransportAggregator(broker, lambda: MqttNetwork(settings))
