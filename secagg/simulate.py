"""``secagg.simulate``: one round with the real client and server state machines in one
process, every message passing through the wire codec. The reference driver, not a
shortcut: transports must produce exactly what it produces.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .client import Client
from .config import Config
from .crypto import SigningKey
from .errors import ProtocolAbort, ProtocolError
from .masked_stream import MaskedStream
from .messages import encode
from .server import Server
from .stage import Stage, round_stages
from .uploads import DEFAULT_UPLOAD_BUDGET


@dataclass(frozen=True)
class SimulationResult:
    """``total`` (the sum of included inputs mod 2**bits, in the natural width
    ``secagg.crypto.dtype_for_bits(bits)``) and ``included`` as in
    docs/architecture.md section 4, plus what a report needs."""

    total: np.ndarray
    included: frozenset[int]
    dropped: Mapping[int, Stage]
    seconds: Mapping[str, float]
    bytes_sent: Mapping[int, Mapping[str, int]]
    bytes_received: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    client_aborts: Mapping[int, str] = field(default_factory=dict)
    corrupt_shares: Mapping[int, frozenset[int]] = field(default_factory=dict)
    unattributable: frozenset[int] = frozenset()
    refused: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LocalRound:
    """One round's parties made in one place (a simulation or a test, where every party is
    local): the roster, the context, each client's signing key and the verify keys
    (``malicious`` mode; fresh Ed25519 keys), and the ``Server`` with its fresh nonce.
    ``client`` builds a client bound to all of it. ``simulate``, ``transport.run_round``
    and ``secagg simulate``'s runner all start here."""

    config: Config
    roster: tuple[int, ...]
    context: bytes
    signing_keys: Mapping[int, SigningKey]
    verify_keys: Mapping[int, bytes] | None
    server: Server

    @classmethod
    def new(cls, config: Config, client_ids: Iterable[int], context: bytes | None = None,
            *, upload_budget: int = DEFAULT_UPLOAD_BUDGET) -> LocalRound:
        roster = tuple(sorted(int(c) for c in client_ids))
        context = os.urandom(32) if context is None else context
        signing: dict[int, SigningKey] = {}
        verify: dict[int, bytes] | None = None
        if config.malicious:
            signing = {cid: SigningKey.generate() for cid in roster}
            verify = {cid: key.public for cid, key in signing.items()}
        server = Server(config, roster=roster, context=context, verify_keys=verify,
                        upload_budget=upload_budget)
        return cls(config, roster, context, signing, verify, server)

    def client(self, client_id: int, vector: object) -> Client:
        """Client ``client_id`` of this round with ``vector``, its key and the nonce bound."""
        return Client(self.config, client_id, vector, roster=self.roster,
                      context=self.context, signing_key=self.signing_keys.get(client_id),
                      verify_keys=self.verify_keys, nonce=self.server.nonce)


def _parse_drop(drop: Mapping[int, Stage | str] | None, ids: set[int]) -> dict[int, Stage]:
    out: dict[int, Stage] = {}
    for cid, stage in (drop or {}).items():
        if cid not in ids:
            raise ValueError(f"drop names client {cid!r}, which has no input")
        if isinstance(stage, str):
            stage = Stage.parse(stage)
        if not isinstance(stage, Stage):
            raise ValueError(f"drop[{cid}]={stage!r}: use a secagg.Stage")
        out[cid] = stage
    return out


STREAM_CHUNK_BYTES = 4 << 20
"""The chunk size (bytes of masked vector) ``simulate`` streams masked inputs in."""


def _stream(server: Server, cid: int, stream: MaskedStream, aborts: dict[int, str],
            chunk_bytes: int) -> int:
    """Client ``cid``'s masked input, chunk by chunk through the wire codec into the
    server (its upload slot granted first, released when it completes); the bytes sent."""
    server.grant_uploads([cid])
    sent = 0
    if stream.proof is not None:  # norm_bound: the input proof precedes the masked input
        data = encode(stream.proof)
        sent += len(data)
        if not _deliver(server, cid, data, aborts):
            return sent  # refused: its masked input would not count
    elements = max(1, chunk_bytes * stream.dim // max(1, stream.nbytes))
    for chunk in stream.chunks(elements):
        data = encode(chunk)
        sent += len(data)
        if not _deliver(server, cid, data, aborts):
            break
    return sent


def _deliver(server: Server, cid: int, data: bytes, aborts: dict[int, str]) -> bool:
    """Client ``cid``'s encoded message into the server; False (its reason kept in
    ``aborts``) when the server refuses it. A protocol abort propagates."""
    try:
        server.receive(cid, data)
    except ProtocolAbort:
        raise
    except ProtocolError as exc:
        aborts.setdefault(cid, str(exc))
        return False
    return True


def simulate(config: Config, inputs: Mapping[int, object],
             drop: Mapping[int, Stage | str] | None = None, seed: int | None = None, *,
             context: bytes | None = None, chunk_bytes: int = STREAM_CHUNK_BYTES
             ) -> SimulationResult:
    """Run one round. ``drop={id: stage}``: that client sends nothing from ``stage`` on.

    Raises ``ProtocolAbort`` when too few clients survive, ``ValueError`` for bad inputs.
    ``seed`` makes the session context reproducible; keys and masks always come from the
    operating system's CSPRNG. Masked inputs stream into the server in chunks of
    ``chunk_bytes`` (docs/protocol.md 6.3), one client at a time.
    """
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes!r}: use a positive number of bytes")
    if not isinstance(config, Config):
        raise TypeError("config must be a secagg.Config")
    if not isinstance(inputs, Mapping):
        raise TypeError("inputs must be a mapping of client id -> uint64 vector")
    if len(inputs) != config.num_clients:
        raise ValueError(f"inputs has {len(inputs)} clients but num_clients="
                         f"{config.num_clients}; give one vector per client")
    drops = _parse_drop(drop, set(inputs))
    if context is None:
        context = (b"secagg.simulate|seed=%d" % seed) if seed is not None else os.urandom(32)
    parties = LocalRound.new(config, inputs, context)
    roster, server = parties.roster, parties.server
    clients: dict[int, Client] = {}
    for cid in roster:  # each input is checked and copied once, by its client
        try:
            clients[cid] = parties.client(cid, inputs[cid])
        except ValueError as exc:
            text = str(exc)
            raise ValueError(f"inputs[{cid}]{text[5:]}" if text.startswith("input ")
                             else text) from None
    seconds: dict[str, float] = {}
    sent: dict[int, dict[str, int]] = {cid: {} for cid in roster}
    received: dict[int, dict[str, int]] = {cid: {} for cid in roster}
    aborts: dict[int, str] = {}
    outgoing: dict[int, bytes] = {}

    def stops(cid: int, stage: Stage) -> bool:
        at = drops.get(cid)
        if at is None:
            return False
        # a drop at consistency_check in a semi-honest round means "from unmasking on"
        return stage >= at

    for stage in round_stages(config):
        started = time.perf_counter()
        if stage is Stage.ADVERTISE_KEYS:
            replies = {cid: encode(clients[cid].advertise()) for cid in roster
                       if not stops(cid, stage)}
        else:
            replies = {}
            for cid, data in outgoing.items():
                received[cid][stage.label] = len(data)
                if stops(cid, stage):
                    continue
                try:
                    reply = clients[cid].stream(data)
                except ProtocolAbort as exc:
                    aborts[cid] = str(exc)
                    continue
                if isinstance(reply, MaskedStream):
                    sent[cid][stage.label] = _stream(server, cid, reply, aborts, chunk_bytes)
                else:
                    replies[cid] = encode(reply)
        for cid, data in replies.items():
            sent[cid][stage.label] = len(data)
            _deliver(server, cid, data, aborts)
        messages = server.advance()
        outgoing = {cid: encode(msg) for cid, msg in messages.items()}
        seconds[stage.label] = time.perf_counter() - started
    seconds["total"] = sum(seconds.values())
    result = server.result
    assert result is not None
    dropped = dict(result.dropped)
    for cid, stage in drops.items():
        dropped.setdefault(cid, stage)
    return SimulationResult(total=result.total, included=result.included, dropped=dropped,
                            seconds=seconds, bytes_sent=sent, bytes_received=received,
                            client_aborts=aborts, corrupt_shares=result.corrupt_shares,
                            unattributable=result.unattributable, refused=result.refused)
