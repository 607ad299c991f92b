"""A step-by-step driver of one real secagg round, for tamper and state-machine tests.

``Round`` runs the real ``Client`` and ``Server`` state machines and stops between any two
legs of the protocol, so a test can take the pending wire bytes (or decoded message
objects) of one party at one stage, tamper with them, deliver them itself, and then let
the round continue with the honest messages. Everything passes through the wire codec,
as in ``secagg.simulate``.

Leg order (``Round.kinds``)::

    AdvertiseKeys -> KeyList -> ShareKeys -> Ciphertexts -> MaskedInput
        [-> SurvivorList -> ConsistencySignature]   (malicious only)
        -> UnmaskRequest -> UnmaskingShares -> result
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import msgpack
import numpy as np

from secagg import Client, Config, ProtocolAbort, ProtocolError, Server, SigningKey
from secagg.crypto import dtype_for_bits
from secagg.messages import (
    MESSAGE_KINDS,
    AdvertiseKeys,
    Ciphertexts,
    ConsistencySignature,
    KeyList,
    MaskedInput,
    ShareKeys,
    SurvivorList,
    UnmaskingShares,
    UnmaskRequest,
    decode,
    encode,
)
from secagg.server import AggregateResult

CLIENT_KINDS: tuple[type, ...] = tuple(s.message for s in MESSAGE_KINDS.values() if s.client)
SERVER_KINDS: tuple[type, ...] = tuple(s.message for s in MESSAGE_KINDS.values()
                                       if not s.client)

# The order-1, -2, -4 and -8 points of Curve25519 and the non-canonical encodings of the
# same u-coordinates: libsodium's blacklist (crypto_scalarmult/curve25519/ref10).
SMALL_ORDER_POINTS: tuple[bytes, ...] = (
    bytes(32),
    b"\x01" + bytes(31),
    bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
    bytes.fromhex("5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157"),
    bytes.fromhex("ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f"),
    bytes.fromhex("edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f"),
    bytes.fromhex("eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f"),
)


def default_inputs(config: Config, roster: Iterable[int], seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {cid: rng.integers(0, config.modulus, size=config.dim, dtype=np.uint64,
                              endpoint=False)
            if config.bits < 64 else rng.integers(0, 2**64 - 1, size=config.dim,
                                                  dtype=np.uint64, endpoint=True)
            for cid in roster}


def modular_sum(inputs: Mapping[int, np.ndarray], ids: Iterable[int], bits: int) -> list[int]:
    """The sum of ``inputs[i]`` for ``i`` in ``ids`` mod 2**bits, with Python ints."""
    ids = list(ids)
    dim = len(next(iter(inputs.values())))
    out = [0] * dim
    for cid in ids:
        for j, value in enumerate(inputs[cid].tolist()):
            out[j] += int(value)
    return [v % (1 << bits) for v in out]


class Round:
    """One round with a server and ``config.num_clients`` clients, stepped leg by leg.

    ``pending`` holds the wire bytes of the current leg not yet delivered, by the client
    id that sends (upstream) or receives (downstream) them. ``step()`` delivers them (or
    the messages it is given) and computes the next leg. ``drop`` names clients that send
    and receive nothing from the given leg on (a message kind)."""

    def __init__(self, config: Config, *, context: bytes = b"harness",
                 inputs: Mapping[int, np.ndarray] | None = None,
                 roster: Iterable[int] | None = None, seed: int = 0,
                 signing: Mapping[int, SigningKey] | None = None) -> None:
        self.config = config
        self.roster = tuple(sorted(roster)) if roster is not None else tuple(
            range(1, config.num_clients + 1))
        self.inputs = dict(inputs) if inputs is not None else default_inputs(
            config, self.roster, seed)
        self.context = context
        self.signing: dict[int, SigningKey] = {}
        self.verify_keys: dict[int, bytes] | None = None
        if config.malicious:
            self.signing = dict(signing) if signing is not None else {
                cid: SigningKey.generate() for cid in self.roster}
            self.verify_keys = {cid: key.public for cid, key in self.signing.items()}
        self.server = Server(config, roster=self.roster, context=context,
                             verify_keys=self.verify_keys)
        self.clients = {
            cid: Client(config, cid, self.inputs[cid], roster=self.roster, context=context,
                        signing_key=self.signing.get(cid), verify_keys=self.verify_keys,
                        nonce=self.server.nonce)
            for cid in self.roster}
        self.kinds: list[type] = [AdvertiseKeys, KeyList, ShareKeys, Ciphertexts, MaskedInput]
        if config.malicious:
            self.kinds += [SurvivorList, ConsistencySignature]
        self.kinds += [UnmaskRequest, UnmaskingShares]
        self.leg = 0
        self.pending: dict[int, bytes] = {
            cid: encode(c.advertise()) for cid, c in self.clients.items()}
        self.client_aborts: dict[int, ProtocolAbort] = {}
        self.client_errors: dict[int, ProtocolError] = {}
        self.server_rejects: dict[int, ProtocolError] = {}
        self.sent: list[tuple[type, int, bytes]] = []  # every leg's messages, in order
        self.stopped: set[int] = set()

    # --- where we are ---------------------------------------------------------------------

    @property
    def kind(self) -> type:
        """The message kind of the pending leg."""
        return self.kinds[self.leg]

    @property
    def upstream(self) -> bool:
        return self.kind in CLIENT_KINDS

    @property
    def finished(self) -> bool:
        return self.server.result is not None

    def decoded(self, cid: int) -> Any:
        """The pending message of ``cid`` as an object."""
        return decode(self.pending[cid])

    # --- stepping -------------------------------------------------------------------------

    def step(self, messages: Mapping[int, Any] | None = None, *,
             stop: Iterable[int] = ()) -> None:
        """Deliver the pending leg (or ``messages``), then compute the next leg.
        ``stop``: clients that send nothing from now on (a dropout)."""
        if self.finished:
            raise RuntimeError("the round has finished")
        self.stopped |= set(stop)
        batch = dict(self.pending if messages is None else messages)
        kind = self.kind
        for cid, data in batch.items():
            raw = data if isinstance(data, bytes) else encode(data)
            self.sent.append((kind, cid, raw))
        if self.upstream:
            for cid, data in batch.items():
                if cid in self.stopped:
                    continue
                try:
                    self.server.receive(cid, data)
                except ProtocolAbort:
                    raise
                except ProtocolError as exc:
                    self.server_rejects[cid] = exc
            out = self.server.advance()  # ProtocolAbort propagates
            self.pending = {cid: encode(m) for cid, m in out.items()}
        else:
            replies: dict[int, bytes] = {}
            for cid, data in batch.items():
                if cid in self.stopped:
                    continue
                try:
                    replies[cid] = encode(self.clients[cid].handle(data))
                except ProtocolAbort as exc:
                    self.client_aborts[cid] = exc
                except ProtocolError as exc:
                    self.client_errors[cid] = exc
            self.pending = replies
        self.leg += 1

    def run_until(self, kind: type) -> dict[int, bytes]:
        """Step honestly until the pending leg is of ``kind``; returns the pending bytes."""
        if kind not in self.kinds:
            raise ValueError(f"{kind.__name__} is not a leg of this round")
        while self.kind is not kind:
            self.step()
        return self.pending

    def finish(self) -> AggregateResult:
        """Step honestly to the end; returns the server's result."""
        while not self.finished:
            self.step()
        assert self.server.result is not None
        return self.server.result

    # --- checking -------------------------------------------------------------------------

    def expected(self, included: Iterable[int]) -> list[int]:
        return modular_sum(self.inputs, included, self.config.bits)

    def assert_correct(self, result: AggregateResult | None = None) -> AggregateResult:
        result = result if result is not None else self.finish()
        assert result.total.dtype == dtype_for_bits(self.config.bits)
        assert result.total.tolist() == self.expected(result.included)
        return result


# --- state snapshots ----------------------------------------------------------------------


def server_state(server: Server) -> tuple[object, ...]:
    """Everything a rejected message must leave unchanged on the server."""
    return (server.stage, server.pending, server.received, dict(server.dropped),
            server.finished, bytes(server._uploads.sum.tobytes()), dict(server._accepted_digest))


def assert_pending_consistent(server: Server) -> None:
    """The server's O(1) stage queries (kept incrementally as messages arrive) agree with
    their definition: expected this stage and not received."""
    want = frozenset(server._expected) - server.received
    assert server.pending == want
    assert server.pending_count == len(want)
    assert all(server.is_pending(c) == (c in want) for c in server.roster)
    assert all(server.is_uploading(c) == (c in server.uploading) for c in server.roster)


def client_state(client: Client) -> tuple[object, ...]:
    """Everything a rejected (not aborting) message must leave unchanged on a client."""
    if client.aborted is not None:  # an aborted client keeps no secrets to compare
        return (client.stage, str(client.aborted), dict(client.revealed))
    return (client.stage, client.done, dict(client.revealed), client.snapshot())


# --- wire-level tampering -----------------------------------------------------------------


def unpack(data: bytes) -> list[Any]:
    obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    assert isinstance(obj, list)
    return obj


def pack(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj, use_bin_type=True))


def pack_with_pairs(head: list[Any], pairs: list[tuple[Any, Any]],
                    tail: tuple[Any, ...] = ()) -> bytes:
    """An array ``[*head, {pairs}, *tail]`` whose map may repeat a key (msgpack allows it)."""
    packer = msgpack.Packer(use_bin_type=True)
    out = packer.pack_array_header(len(head) + 1 + len(tail))
    out += b"".join(packer.pack(x) for x in head)
    out += packer.pack_map_header(len(pairs))
    out += b"".join(packer.pack(k) + packer.pack(v) for k, v in pairs)
    out += b"".join(packer.pack(x) for x in tail)
    return bytes(out)


def flip(data: bytes, index: int, mask: int = 0x01) -> bytes:
    buf = bytearray(data)
    buf[index % len(buf)] ^= mask
    return bytes(buf)


def flip_last(blob: bytes) -> bytes:
    return blob[:-1] + bytes([blob[-1] ^ 0x80])


def replace(message: Any, **changes: Any) -> Any:
    return dataclasses.replace(message, **changes)


def digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()
