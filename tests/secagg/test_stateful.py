"""Hypothesis drives one Server and a handful of Clients through random schedules.

Messages are delivered in any order, duplicated (QoS 1), delivered late or to the wrong
client, mutated byte by byte, or never delivered (dropouts), and the server closes stages
whenever the schedule says so. Invariants, after every step:

* no client ever reveals both the self-mask share and the masking-key share of one peer
  (``client.revealed`` and every UnmaskingShares actually sent), so the server never holds
  t shares of both secrets of anyone;
* a message rejected with a ``ProtocolError`` that is not a ``ProtocolAbort`` changes no
  state (client or server); an aborted client never sends shares;
* the round ends in a clean ``ProtocolAbort`` or in ``result.total`` equal to the modular
  sum of the inputs of ``result.included`` (a masked vector altered in transit counts as
  that client's altered input), and ``included`` is exactly the clients whose masked input
  the server accepted.

Correctness is not asserted once a client has *accepted* a mutated server message: the
server-to-client channel is only authenticated by signatures in malicious mode, and not
every field even then (see test_tamper.py for the exact cases).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from harness import Round, assert_pending_consistent, client_state, digest, server_state
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from secagg import Config, ProtocolAbort, ProtocolError, Stage, decode, encode
from secagg.crypto import dtype_for_bits
from secagg.messages import MaskedInput, UnmaskingShares


class SecAggSchedules(RuleBasedStateMachine):
    rnd: Round

    @initialize(n=st.integers(4, 7), dim=st.integers(1, 3),
                bits=st.sampled_from([8, 13, 16, 32, 64]),
                security=st.sampled_from(["semi-honest", "malicious"]),
                sparse=st.booleans(), seed=st.integers(0, 2**16),
                plan=st.lists(st.tuples(st.integers(1, 7), st.sampled_from(list(Stage))),
                              max_size=2))
    def setup(self, n: int, dim: int, bits: int, security: str, sparse: bool,
              seed: int, plan: list[tuple[int, Stage]]) -> None:
        neighbors = n - 1 if sparse and n >= 5 else None
        config = Config(num_clients=n, dim=dim, bits=bits, neighbors=neighbors,
                        security=security, unchecked_graph=True)
        self.rnd = Round(config, context=b"stateful-%d" % seed, seed=seed)
        self.t = config.threshold
        self.up: dict[int, bytes] = dict(self.rnd.pending)  # in flight to the server
        self.down: dict[int, bytes] = {}  # in flight to clients
        self.honest_up: list[tuple[int, bytes]] = []
        self.seen_down: list[tuple[int, bytes]] = []
        self.accepted_up: set[bytes] = set()
        self.honest_masked: dict[int, bytes] = {}
        self.accepted_masked: dict[int, bytes] = {}
        self.replies: dict[int, dict[bytes, bytes]] = {c: {} for c in self.rnd.roster}
        self.last_in: dict[int, bytes] = {}
        self.shares: dict[int, list[UnmaskingShares]] = {c: [] for c in self.rnd.roster}
        self.gone: set[int] = set()
        self.tainted = False
        self.server_aborted = False
        # scheduled dropouts: the client goes silent when the server opens that stage
        self.plan = {cid: stage for cid, stage in plan if cid <= n}
        self.apply_plan()

    def apply_plan(self) -> None:
        for cid, stage in self.plan.items():
            if stage <= self.rnd.server.stage:
                self.gone.add(cid)
                self.up.pop(cid, None)
                self.down.pop(cid, None)

    # --- helpers --------------------------------------------------------------------------

    @property
    def over(self) -> bool:
        return self.server_aborted or self.rnd.finished

    def to_server(self, cid: int, data: bytes, *, honest: bool) -> None:
        server = self.rnd.server
        before = server_state(server)
        was_received = cid in server.received
        try:
            server.receive(cid, data)
        except ProtocolAbort as exc:  # pragma: no cover - receive never aborts
            raise AssertionError(f"Server.receive raised ProtocolAbort: {exc}") from exc
        except ProtocolError:
            assert server_state(server) == before, "a rejected message changed the server"
            return
        if data in self.accepted_up or was_received:
            assert server_state(server) == before, "a redelivered message changed state"
            return
        if server_state(server) == before:
            return  # a late redelivery of the previous stage's message: ignored
        self.accepted_up.add(data)
        msg = decode(data)
        if isinstance(msg, MaskedInput):
            self.accepted_masked[cid] = data
        if honest:
            self.honest_up.append((cid, data))

    def to_client(self, cid: int, data: bytes, *, mutated: bool = False) -> None:
        client = self.rnd.clients[cid]
        before = client_state(client)
        aborted_before = client.aborted is not None
        try:
            reply = encode(client.handle(data))
        except ProtocolAbort:
            assert client.aborted is not None
            return
        except ProtocolError:
            assert client_state(client) == before, "a refused message changed the client"
            return
        key = digest(data)
        if key in self.replies[cid]:
            assert self.replies[cid][key] == reply, "a redelivery got a different answer"
        elif aborted_before:
            raise AssertionError("an aborted client answered a new message")
        self.replies[cid][key] = reply
        self.last_in[cid] = data
        if mutated:
            self.tainted = True
        msg = decode(reply)
        if isinstance(msg, MaskedInput):
            self.honest_masked.setdefault(cid, reply)
            assert self.honest_masked[cid] == reply, "a client masked its input twice"
        if isinstance(msg, UnmaskingShares):
            self.shares[cid].append(msg)
        if cid not in self.gone:
            self.up[cid] = reply

    # --- rules ----------------------------------------------------------------------------

    @precondition(lambda self: bool(self.up) and not self.over)
    @rule(data=st.data())
    def deliver_to_server(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.up)))
        self.to_server(cid, self.up.pop(cid), honest=True)

    @precondition(lambda self: bool(self.down) and not self.over)
    @rule(data=st.data())
    def deliver_to_client(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.down)))
        message = self.down.pop(cid)
        self.seen_down.append((cid, message))
        self.to_client(cid, message)

    @precondition(lambda self: not self.over and (
        not self.up or len(self.rnd.server.received) >= self.t))
    @rule()
    def close_stage(self) -> None:
        """The stage deadline: may pass with messages still in flight (they arrive late)."""
        try:
            out = self.rnd.server.advance()
        except ProtocolAbort:
            self.server_aborted = True
            return
        self.down = {cid: encode(m) for cid, m in out.items() if cid not in self.gone}
        self.apply_plan()

    @precondition(lambda self: not self.over)
    @rule(stages=st.integers(1, 6))
    def run_honestly(self, stages: int) -> None:
        """Deliver everything in flight and close the stage, ``stages`` times."""
        for _ in range(stages):
            if self.over:
                return
            for cid in sorted(self.down):
                message = self.down.pop(cid)
                self.seen_down.append((cid, message))
                self.to_client(cid, message)
            for cid in sorted(self.up):
                self.to_server(cid, self.up.pop(cid), honest=True)
            self.close_stage()

    @precondition(lambda self: not self.over and self.rnd.server.stage > 0)
    @rule(data=st.data())
    def drop_one_then_finish(self, data: st.DataObject) -> None:
        """A dropout in the middle of a round that otherwise runs to the end: the case
        where the server must reconstruct a dropped client's masking key."""
        self.drop_client(data)
        self.run_honestly(12)

    @precondition(lambda self: not self.over)
    @rule(data=st.data())
    def drop_client(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(self.rnd.roster))
        self.gone.add(cid)
        self.up.pop(cid, None)
        self.down.pop(cid, None)

    @precondition(lambda self: bool(self.honest_up) and not self.over)
    @rule(data=st.data())
    def redeliver_to_server(self, data: st.DataObject) -> None:
        cid, message = data.draw(st.sampled_from(self.honest_up))
        self.to_server(cid, message, honest=False)

    @precondition(lambda self: bool(self.last_in) and not self.over)
    @rule(data=st.data())
    def redeliver_last_to_client(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.last_in)))
        self.to_client(cid, self.last_in[cid])

    @precondition(lambda self: bool(self.seen_down) and not self.over)
    @rule(data=st.data())
    def deliver_stale_or_misaddressed(self, data: st.DataObject) -> None:
        _, message = data.draw(st.sampled_from(self.seen_down))
        cid = data.draw(st.sampled_from(self.rnd.roster))
        self.to_client(cid, message)

    @precondition(lambda self: bool(self.up or self.honest_up) and not self.over)
    @rule(data=st.data(), index=st.integers(0, 10**6), mask=st.integers(1, 255))
    def mutate_to_server(self, data: st.DataObject, index: int, mask: int) -> None:
        pool = sorted(self.up.items()) + self.honest_up
        cid, message = data.draw(st.sampled_from(pool))
        buf = bytearray(message)
        buf[index % len(buf)] ^= mask
        self.to_server(cid, bytes(buf), honest=False)

    @precondition(lambda self: bool(self.down) and not self.over)
    @rule(data=st.data(), index=st.integers(0, 10**6), mask=st.integers(1, 255))
    def mutate_to_client(self, data: st.DataObject, index: int, mask: int) -> None:
        cid = data.draw(st.sampled_from(sorted(self.down)))
        buf = bytearray(self.down[cid])
        buf[index % len(buf)] ^= mask
        self.to_client(cid, bytes(buf), mutated=True)

    @precondition(lambda self: self.over)
    @rule(data=st.data())
    def poke_after_the_end(self, data: st.DataObject) -> None:
        """A finished server refuses everything new (a redelivery of an unmasking message
        is reported as a duplicate); clients still never over-reveal."""
        if self.rnd.finished and self.honest_up:
            cid, message = data.draw(st.sampled_from(self.honest_up))
            before = server_state(self.rnd.server)
            try:
                new = self.rnd.server.receive(cid, message)
            except ProtocolError as exc:
                assert not isinstance(exc, ProtocolAbort)
            else:
                assert new is False, "a finished server accepted a new message"
            assert server_state(self.rnd.server) == before
        if self.seen_down:
            cid, message = data.draw(st.sampled_from(self.seen_down))
            self.to_client(cid, message)

    # --- invariants -----------------------------------------------------------------------

    @invariant()
    def never_both_shares_of_one_peer(self) -> None:
        if not hasattr(self, "rnd"):
            return
        by_owner: dict[int, dict[str, set[int]]] = {}
        for cid, sent in self.shares.items():
            seeds = {p for m in sent for p in m.self_mask_shares}
            keys = {p for m in sent for p in m.masking_key_shares}
            assert not seeds & keys, f"client {cid} revealed both shares of {seeds & keys}"
            revealed = self.rnd.clients[cid].revealed
            assert {p for p, k in revealed.items() if k == "self_mask"} == seeds
            assert {p for p, k in revealed.items() if k == "masking_key"} == keys
            assert len({encode(m) for m in sent}) <= 1, "a client answered two requests"
            if self.rnd.clients[cid].aborted is not None:
                assert not sent, "an aborted client sent shares"
            for p in seeds:
                by_owner.setdefault(p, {"s": set(), "k": set()})["s"].add(cid)
            for p in keys:
                by_owner.setdefault(p, {"s": set(), "k": set()})["k"].add(cid)
        for owner, holders in by_owner.items():
            assert not (len(holders["s"]) >= self.t and len(holders["k"]) >= self.t), (
                f"the server could reconstruct both secrets of client {owner}")

    @invariant()
    def pending_is_expected_minus_received(self) -> None:
        if hasattr(self, "rnd"):
            assert_pending_consistent(self.rnd.server)

    @invariant()
    def result_is_exact_or_absent(self) -> None:
        if not hasattr(self, "rnd") or not self.rnd.finished:
            return
        result = self.rnd.server.result
        assert result is not None
        assert result.included == frozenset(self.accepted_masked)
        assert result.total.dtype == dtype_for_bits(self.rnd.config.bits)
        assert result.total.shape == (self.rnd.config.dim,)
        if self.tainted:
            return
        cfg = self.rnd.config
        dtype = dtype_for_bits(cfg.bits)
        expected = self.rnd.expected(result.included)
        for cid in result.included:
            honest_msg, got_msg = (decode(self.honest_masked[cid]),
                                   decode(self.accepted_masked[cid]))
            assert isinstance(honest_msg, MaskedInput) and isinstance(got_msg, MaskedInput)
            honest = np.frombuffer(honest_msg.masked, dtype=dtype)
            got = np.frombuffer(got_msg.masked, dtype=dtype)
            for j in range(cfg.dim):
                expected[j] = (expected[j] + int(got[j]) - int(honest[j])) % cfg.modulus
        assert result.total.tolist() == expected

    def teardown(self) -> None:
        if not hasattr(self, "rnd"):
            return
        outcome = ("finished" if self.rnd.finished else
                   "aborted" if self.server_aborted else "unfinished")
        event(f"{outcome}{' (tainted)' if self.tainted else ''}")
        if self.rnd.finished:
            result = self.rnd.server.result
            assert result is not None
            late = sorted(s.label for s in result.dropped.values() if s >= Stage.MASKED_INPUT)
            event(f"finished; dropped in {', '.join(late) or 'no late stage'}")


TestSecAggSchedules: Any = SecAggSchedules.TestCase
TestSecAggSchedules.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
