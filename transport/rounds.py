"""A whole round on one event loop, over any ``transport.link.Network``.

``run_round`` is the transport counterpart of ``secagg.simulate``: the same arguments, the
same result, but every message crosses a real bus (``MemoryNetwork`` or an MQTT broker via
``MqttNetwork``) with framing, receipts, deadlines and last wills. ``serve_client`` and
``serve_server`` are the building blocks a deployment uses for one party each.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from secagg import Config, Stage
from secagg.client import Client
from secagg.input_check import check_input
from secagg.server import AggregateResult, Server
from secagg.simulate import LocalRound
from secagg.uploads import DEFAULT_UPLOAD_BUDGET

from .client_driver import ClientDriver, ClientOutcome, DropHook
from .drivers import (
    DEFAULT_CHUNK_BYTES,
    StageProgress,
    Timeouts,
    client_will,
    server_will,
)
from .errors import TransportError
from .framing import DEFAULT_MAX_PAYLOAD
from .link import LinkLost, Network
from .server_driver import ServerDriver
from .topics import SERVER_USER, Topics, site_name

logger = logging.getLogger(__name__)


def new_round_name() -> str:
    """A fresh, unguessable round name (one topic level)."""
    return "r" + secrets.token_hex(8)


@dataclass
class RoundReport:
    """What ``run_round`` returns: the server's result and what every party saw."""

    result: AggregateResult
    seconds: dict[str, float]
    outcomes: dict[int, ClientOutcome]
    bytes_received: dict[int, dict[str, int]] = field(default_factory=dict)
    gone: dict[int, str] = field(default_factory=dict)
    client_aborts: dict[int, str] = field(default_factory=dict)
    invalid_payloads: int = 0
    rejected: int = 0
    resends: int = 0
    chunks: int = 0  # masked-input chunks the server accepted (the streaming path)
    reassembly_peak: int = 0  # the most bytes the server's reassembly held
    reassembly_bound: int = 0  # what round_reassembler allows it (every sender's quota)

    @property
    def total(self) -> object:
        return self.result.total

    @property
    def included(self) -> frozenset[int]:
        return self.result.included


async def serve_client(network: Network, client: Client, topics: Topics, *,
                       timeouts: Timeouts | None = None,
                       max_payload: int = DEFAULT_MAX_PAYLOAD, drop_at: Stage | None = None,
                       drop_mode: str = "leave", on_drop: DropHook | None = None,
                       on_ready: Callable[[ClientDriver], None] | None = None
                       ) -> ClientOutcome:
    """Connect one site (as ``site-<id>``, with its last will), subscribe to its own topics
    and run its part of the round. ``on_ready(driver)`` is called once it listens."""
    cid = client.client_id
    async with network.connect(site_name(cid), will=client_will(topics, cid)) as link:
        await link.subscribe(topics.client_filter(cid))
        await link.subscribe(topics.control)
        driver = ClientDriver(client, link, topics, timeouts=timeouts,
                              max_payload=max_payload, drop_at=drop_at, drop_mode=drop_mode,
                              on_drop=on_drop)
        if on_ready is not None:
            on_ready(driver)
        return await driver.run()


async def serve_server(network: Network, server: Server, topics: Topics, *,
                       timeouts: Timeouts | None = None,
                       max_payload: int = DEFAULT_MAX_PAYLOAD,
                       on_stage: Callable[[StageProgress], None] | None = None,
                       ready: asyncio.Event | None = None,
                       start: asyncio.Event | None = None,
                       on_message: Callable[[int, Stage], None] | None = None,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                       on_driver: Callable[[ServerDriver], None] | None = None
                       ) -> ServerDriver:
    """Connect the aggregator (as ``server``), then run the round once ``start`` is set.

    Returns the driver (its ``server.result`` holds the aggregate). Raises ``ProtocolAbort``
    or ``TransportError``. ``on_message(client, stage)`` sees every accepted message;
    masked inputs stream in chunks of ``chunk_bytes`` (``ServerDriver``). ``on_driver``
    gets the driver as the round starts (to tell it of clients known lost:
    ``ServerDriver.client_lost``).
    """
    async with network.connect(SERVER_USER, will=server_will(server, topics)) as link:
        await link.subscribe(topics.server_filter)
        if ready is not None:
            ready.set()
        if start is not None:
            await start.wait()
        driver = ServerDriver(server, link, topics, timeouts=timeouts,
                              max_payload=max_payload, on_stage=on_stage,
                              on_message=on_message, chunk_bytes=chunk_bytes)
        if on_driver is not None:
            on_driver(driver)
        await driver.run()
        return driver


async def run_round(network: Network, config: Config, inputs: Mapping[int, object],
                    drop: Mapping[int, Stage | str] | None = None, *,
                    context: bytes | None = None, round_name: str | None = None,
                    timeouts: Timeouts | None = None, max_payload: int = DEFAULT_MAX_PAYLOAD,
                    drop_mode: str = "leave",
                    on_stage: Callable[[StageProgress], None] | None = None,
                    connect_timeout: float = 60.0, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                    upload_budget: int = DEFAULT_UPLOAD_BUDGET) -> RoundReport:
    """Run one round with every party on this loop; ``drop={id: stage}`` as in
    ``secagg.simulate``. Raises ``ProtocolAbort`` when the round cannot finish and
    ``TransportError`` when the bus fails. Masked inputs stream in chunks of
    ``chunk_bytes``, ``upload_budget // vector bytes`` senders at a time (``Server``)."""
    if len(inputs) != config.num_clients:
        raise ValueError(f"inputs has {len(inputs)} clients but num_clients="
                         f"{config.num_clients}; give one vector per client")
    checked = {cid: check_input(vec, config, f"inputs[{cid}]") for cid, vec in inputs.items()}
    drops = {cid: Stage.parse(s) if isinstance(s, str) else Stage(s)
             for cid, s in (drop or {}).items()}
    unknown = sorted(set(drops) - set(checked))
    if unknown:
        raise ValueError(f"drop names clients {unknown[:10]} that have no input")
    topics = Topics(round_name or new_round_name())
    parties = LocalRound.new(config, checked, context, upload_budget=upload_budget)
    server = parties.server
    clients = [parties.client(cid, checked[cid]) for cid in parties.roster]
    server_ready, start = asyncio.Event(), asyncio.Event()
    server_task = asyncio.create_task(serve_server(
        network, server, topics, timeouts=timeouts, max_payload=max_payload,
        on_stage=on_stage, ready=server_ready, start=start, chunk_bytes=chunk_bytes))
    ready: set[int] = set()
    all_ready = asyncio.Event()

    def on_ready(driver: ClientDriver) -> None:
        ready.add(driver.client_id)
        if len(ready) == len(clients):
            all_ready.set()

    client_tasks = [asyncio.create_task(serve_client(
        network, c, topics, timeouts=timeouts, max_payload=max_payload,
        drop_at=drops.get(c.client_id), drop_mode=drop_mode, on_ready=on_ready))
        for c in clients]
    waiters = [asyncio.ensure_future(all_ready.wait()),
               asyncio.ensure_future(server_ready.wait())]
    joined = asyncio.gather(*waiters)
    try:
        watched: list[asyncio.Future[Any]] = [joined, server_task, *client_tasks]
        done, _ = await asyncio.wait(watched,
                                     timeout=connect_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if not (all_ready.is_set() and server_ready.is_set()):
            for task in done:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    exc = task.exception()
                    raise TransportError(f"a party could not join the round: {exc}") from exc
            raise TransportError(f"only {len(ready)} of {len(clients)} clients connected "
                                 f"within {connect_timeout} s")
        start.set()
        try:
            driver = await server_task
        except LinkLost as exc:
            raise TransportError(f"the server lost the broker: {exc}") from exc
        outcomes = await asyncio.gather(*client_tasks, return_exceptions=True)
    finally:
        # every future this function made is cancelled and awaited: an orphaned gather
        # logs "exception was never retrieved" at loop shutdown
        for task in [server_task, *client_tasks, *waiters]:
            if not task.done():
                task.cancel()
        joined.cancel()
        await asyncio.gather(server_task, *client_tasks, joined, return_exceptions=True)
    result = server.result
    assert result is not None
    by_id: dict[int, ClientOutcome] = {}
    for client, outcome in zip(clients, outcomes, strict=True):
        if isinstance(outcome, ClientOutcome):
            by_id[client.client_id] = outcome
        else:
            by_id[client.client_id] = ClientOutcome(client.client_id, "lost",
                                                    reason=repr(outcome))
    return RoundReport(result=result, seconds=dict(driver.seconds), outcomes=by_id,
                       bytes_received=driver.bytes_received, gone=dict(driver.gone),
                       client_aborts=dict(driver.client_aborts),
                       invalid_payloads=driver.invalid_payloads, rejected=driver.rejected,
                       resends=driver.resends, chunks=driver.chunks,
                       reassembly_peak=driver.reassembly_peak,
                       reassembly_bound=driver.reassembly_bound)
