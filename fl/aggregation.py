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
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from secagg import Config, Stage

if TYPE_CHECKING:
    from transport.drivers import Timeouts

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
        if broker == "mosquitto":
            from transport.mosquitto import mosquitto_available

            if not mosquitto_available():
                raise ValueError("--broker mosquitto: no mosquitto binary found; install it "
                                 "(apt-get install mosquitto) or use --broker embedded")
        return broker
    if broker.startswith(("mqtt://", "mqtts://")):
        from transport.mqtt import parse_broker_url

        parse_broker_url(broker)
        return broker
    raise ValueError(f"--broker {broker}: use {', '.join(kinds)}, mqtt://host:port or "
                     "mqtts://host:port")


# The round's cost model (docs/performance.md "Round deadlines"). Seconds per unit of work,
# measured on this 2-core machine with ``python benchmarks/bench_simulate_scale.py
# --calibrate`` under a load average of about 5 (other jobs running): the largest of two runs,
# rounded up. The deadlines allow SAFETY times the modelled work, so a slower or busier
# machine still finishes.
PAIR_SECONDS: Mapping[str, Mapping[str, float]] = {
    # one client's computation per neighbour for its message of each stage: X25519
    # agreements, Shamir shares and AEAD encryptions (share_keys; malicious: signature
    # checks too), agreements and key derivation (masked_input), decryption (unmasking;
    # malicious: the consistency signatures are checked there)
    "semi-honest": {"advertise_keys": 0.0, "share_keys": 500e-6, "masked_input": 200e-6,
                    "consistency_check": 0.0, "unmasking": 20e-6},
    "malicious": {"advertise_keys": 0.0, "share_keys": 1100e-6, "masked_input": 250e-6,
                  "consistency_check": 10e-6, "unmasking": 500e-6},
}
ELEMENT_SECONDS = 3.5e-9
"""Expanding one mask element (AES-CTR keystream) and adding it: masked_input costs each
client (neighbours + 1) x dim of these, the server's unmasking its dropped pairs x dim."""
SERVER_PAIR_SECONDS = 15e-6
"""The server and the broker per (client, neighbour) pair and stage: decoding, storing and
routing n x k ciphertexts and keys (in ``secagg simulate`` on the same cores as the sites)."""
LOGIN_SECONDS = 20e-3
"""The broker checks one login (hash of a generated token) and its subscriptions."""
SAFETY = 4.0
"""The deadlines allow SAFETY x the modelled work."""
MAX_STAGE_SECONDS = 3600.0
"""No stage deadline, re-publish timer or wait for the round start exceeds this (or the
caller's own ``stage``, if larger), whatever the round's size: a site sizes its deadlines
from the roster the coordinator sends (up to 65,535 ids), which must not keep it waiting,
charged, for days."""
MAX_GIVE_UP_SECONDS = 6 * 3600.0
"""A client gives up on a silent round after at most this long (or 3 x ``stage``)."""


def round_work(*, clients: int, dim: int, neighbors: int | None = None,
               malicious: bool = False, colocated: int = 1) -> dict[str, float]:
    """Seconds of computation each stage of one round needs (by stage label), and under
    ``"finish"`` the server's unmasking: the cost model, defined once.

    ``clients`` n and ``neighbors`` k (SecAgg+'s neighbourhood, the client included;
    ``None``: the complete graph, k = n) give n x k pairs: each client computes k
    agreements, shares and encryptions (SecAgg+ scales with n x k, the complete graph with
    n^2) and the server routes n x k ciphertexts; masking costs k x ``dim`` per client
    (k - 1 pairwise masks and its self mask). ``colocated`` is how many clients compute
    one after another on one core (1 when every site has its own machine; n / cores in
    ``secagg simulate``, n when every party runs on one event loop)."""
    n = max(0, int(clients))
    k = n if neighbors is None else min(n, int(neighbors))
    per_pair = PAIR_SECONDS["malicious" if malicious else "semi-honest"]
    share = max(1, colocated)
    work = {label: share * k * per_pair[label] + n * k * SERVER_PAIR_SECONDS
            for label in per_pair}
    work["masked_input"] += share * k * dim * ELEMENT_SECONDS
    # at most half of the pairs have a dropped end, and every survivor's self mask
    work["finish"] = (n * k / 2 + n) * dim * ELEMENT_SECONDS + n * k * SERVER_PAIR_SECONDS
    return work


def round_timeouts(stage: float = 60.0, *, clients: int = 0, dim: int = 0,
                   neighbors: int | None = None, malicious: bool = False,
                   colocated: int = 1) -> Timeouts:
    """The protocol deadlines of every round the package runs (defined once): ``stage``
    seconds per stage for the network, plus SAFETY x the stage's modelled work
    (``round_work``: pass what the caller knows of the round). A client re-publishes an
    unconfirmed message only after the stage's work could have delayed the receipt (its
    event loop may be busy with co-located clients), waits for the round start while the
    broker checks every login, and gives up on a silent round after a few stages' worth
    of time. Sites that drop sign off or leave a last will, so the deadlines only guard
    against a wedged broker or a hung site. Every deadline is capped (MAX_STAGE_SECONDS,
    MAX_GIVE_UP_SECONDS): the model's numbers for a huge roster are no reason to wait days."""
    from transport.drivers import Timeouts

    work = round_work(clients=clients, dim=dim, neighbors=neighbors, malicious=malicious,
                      colocated=colocated)
    finish = SAFETY * work.pop("finish")
    slack = {label: SAFETY * w for label, w in work.items()}
    most = max(slack.values())
    cap = max(MAX_STAGE_SECONDS, stage)
    return Timeouts(stage=min(cap, stage + most),
                    per_stage={label: min(cap, stage + s) for label, s in slack.items()},
                    start=min(cap, max(60.0, stage) + SAFETY * clients * LOGIN_SECONDS),
                    retry=min(cap, 2.0 + most),
                    answer=min(cap, min(10.0, stage) + most + finish),
                    give_up=min(max(MAX_GIVE_UP_SECONDS, 3 * stage),
                                max(120.0, 3 * stage) + 2 * (most + finish)))


class TransportAggregator:
    """Each round over ``transport.rounds.run_round`` on a fresh network from ``factory``."""

    def __init__(self, name: str, factory: Callable[[], Any]) -> None:
        self.name = name
        self._factory = factory

    def aggregate(self, config: Config, inputs: Mapping[int, U64],
                  drop: Mapping[int, Stage]) -> AggregateOutcome:
        from transport.rounds import run_round

        # every party of the round runs on this one event loop: n clients share a core
        timeouts = round_timeouts(clients=config.num_clients, dim=config.dim,
                                  neighbors=config.neighbors, malicious=config.malicious,
                                  colocated=config.num_clients)

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
        from secagg import simulate

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
    from transport.topics import SERVER_USER, acl_table, site_name

    if broker == "inprocess":
        yield InProcessAggregator()
        return
    check_broker(broker)
    acl = acl_table(sorted(site_ids))
    if broker == "memory":
        from transport.memory import MemoryNetwork

        def memory() -> Any:
            network = MemoryNetwork(acl=acl)
            network.tap = tap
            return network

        yield TransportAggregator("memory", memory)
        return
    if tap is not None:
        raise ValueError("tap is only available with the memory broker")
    from transport.launch import broker_for
    from transport.mqtt import MqttNetwork

    passwords = {SERVER_USER: secrets.token_urlsafe(18)}
    passwords.update({site_name(cid): secrets.token_urlsafe(18) for cid in site_ids})
    with broker_for(broker, passwords, acl) as settings:
        yield TransportAggregator(broker, lambda: MqttNetwork(settings))
