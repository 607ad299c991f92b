"""Review PoC (withdrawal rule, Flower and NVFlare runtimes): "a charge is withdrawn exactly
when the site's masked input never left it" (fl/site/session.py).

:meth:`fl.site.session.SiteSession.admit` abandons the unfinished earlier round (withdraws
its charge) *before* it charges the new setup. When that charge is refused (the new setup
breaks the policy: noise below the floor, over budget), ``admit`` raises after the
withdrawal, and the runtime, which drops its earlier round only once ``join`` returned
(``context.state.config_records.pop(STATE)`` in fl/flower/client.py ``_start``,
``self.rounds.clear()`` in fl/nvflare/client.py ``_start``), still holds the round it was
told is abandoned. A malicious server:

1. starts round A (a DP round the site's default policy accepts): the site advertises,
   round A is charged;
2. sends the site a new setup B with noise below the default floor: the site withdraws A's
   charge ("replaced by a newer round's setup") and refuses B;
3. carries on with round A: the site answers with its masked input (and would unmask).

A's masked input left the site and its ledger no longer counts it; repeated, the default
node's total (epsilon 10) bounds nothing. The site role is not exposed: it runs one
announced round at a time and ``admit`` gets no ``previous``.

Fixed: the round ``previous`` names is erased in the same step that withdraws it.
``SiteSession.join``/``admit`` take an ``erase`` callable from the runtime and call it
just before ``abandon(previous)``, so a refusal after
that point leaves nothing to answer: NVFlare ``erase=self.rounds.clear``; Flower
``context.state.config_records.pop(STATE)`` *and* the replaced round's stage record marked
aborted (``fl/flower/guard.py``: ``_continue`` refuses an aborted round), since a Flower
runtime need not save the Context of a message whose mod raised.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from adversary import threat

ATTACK = dict(attack="Refused replacement setup withdraws a live round's charge",
              adversary="malicious server",
              controls="a second setup, refused by the site's policy, between a DP round's "
                        "advertisement and its masked_input request",
              protocol="a withdrawn round can answer nothing more (the runtime erases it)")

def _tiny(raw: bytes) -> bytes:
    """The same round's setup with noise far below the default floor (a new session)."""
    from fl.round_setup import RoundSetup

    setup = RoundSetup.from_bytes(raw)
    assert setup.dp is not None
    return replace(setup, dp=replace(setup.dp, noise_stddev=setup.dp.noise_stddev * 1e-9)
                   ).to_bytes()


@threat(**ATTACK)
def test_flower_a_refused_setup_does_not_uncharge_a_round_that_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("flwr")
    from flwr.app import Message, RecordDict
    from flwr.serverapp.strategy import FedAvg

    from fl.errors import NothingReleased
    from fl.flower import DistributedDP, SecureAggregation
    from fl.flower.records import RECORD, SETUP
    from tests.flower import apps
    from tests.flower.test_site_core import _grid, _ledger

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    grid, _ = _grid(3)  # default nodes: the default policy
    # 1. round A up to the masked_input request, which the server holds back
    grid.silent = lambda node, msg: apps.stage_of(msg) == "masked_input"
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=3),
                                neighbors=None,
                                privacy=DistributedDP(clip_norm=1.0, noise_multiplier=6.0))
    with pytest.raises(NothingReleased):
        wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    node = grid.nodes[0]
    sent_to = [m for m in grid.sent if m.metadata.dst_node_id == node]
    setup = next(m for m in sent_to if apps.stage_of(m) == "advertise_keys")
    request = next(m for m in sent_to if apps.stage_of(m) == "masked_input")
    (a,) = _ledger(grid, node)
    assert a["withdrawn"] is None
    # 2. setup B, below the noise floor: refused
    content = RecordDict(setup.content)
    record = content.config_records[RECORD]
    record[SETUP] = _tiny(record[SETUP])
    refused = grid.deliver(Message(content, dst_node_id=node, message_type="train",
                                   group_id="2"))
    assert refused is not None and refused.has_error()
    assert "min_noise_multiplier" in str(refused.error.reason)
    # 3. round A goes on: the node answers the masked_input request it was holding
    grid.silent = lambda node, msg: False
    reply = grid.deliver(Message(request.content, dst_node_id=node, message_type="train",
                                 group_id="1"))
    assert reply is not None
    masked_left = not reply.has_error() and bool(reply.content.array_records)
    (after,) = _ledger(grid, node)
    # the guarantee: either the masked input did not leave, or its charge stands
    assert not masked_left or after["withdrawn"] is None, (
        f"round A's masked input left node {node}, its charge was withdrawn: "
        f"{after['withdrawn']!r}")


@threat(**ATTACK)
def test_nvflare_a_refused_setup_does_not_uncharge_a_round_that_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("nvflare.apis")
    from nvflare.apis.fl_constant import ReturnCode
    from nvflare.apis.shareable import Shareable
    from nvflare.apis.signal import Signal

    from fl.nvflare import SecAggExecutor, SiteConfig
    from fl.nvflare.common import PAYLOAD, REFUSAL_HEADER, SESSION, SETUP_HEADER, STAGE_TASK
    from fl.round_setup import RoundSetup, encoded_dim
    from secagg import Server, encode
    from secagg.messages import MaskedInput
    from tests.nvflare.test_executor import _ROUND_NONCES, Trainer, _charges, _context, _task

    monkeypatch.setenv("SECAGG_NVFLARE_DIR", str(tmp_path))
    names = ["site-1", "site-2", "site-3"]
    sites: dict[str, SecAggExecutor] = {}
    for name in names:  # no policy.json: the default policy
        executor = SecAggExecutor()
        executor.trainer, executor.site = Trainer(), name
        executor.config = SiteConfig.for_site(name)
        sites[name] = executor
    ctx = _context("job-a")
    # 1. round A: every site advertises, the server sends share_keys
    task = _task(6.0)
    setup = RoundSetup.from_bytes(task.get_header(SETUP_HEADER))
    replies = [sites[n].execute("train", task, ctx, Signal()) for n in names]
    assert all(r.get_return_code() == ReturnCode.OK for r in replies)
    server = Server(setup.config(encoded_dim(setup)), roster=range(1, 4),
                    context=setup.context(), nonce=_ROUND_NONCES.pop(setup.nonce))
    for c, reply in enumerate(replies, start=1):
        server.receive(c, reply[PAYLOAD])

    def stage() -> dict[int, Any]:
        out = {}
        for c, message in server.advance().items():
            answer = sites[names[c - 1]].execute(STAGE_TASK, Shareable(
                {SESSION: server.session_id, PAYLOAD: encode(message)}), ctx, Signal())
            if answer.get_return_code() == ReturnCode.OK:
                server.receive(c, answer[PAYLOAD])
                out[c] = answer[PAYLOAD]
        return out

    stage()  # share_keys
    # 2. site-1 gets setup B of the same job, below the noise floor: refused
    hostile = _task(6.0)
    hostile.set_header(SETUP_HEADER, _tiny(hostile.get_header(SETUP_HEADER)))
    refused = sites["site-1"].execute("train", hostile, ctx, Signal())
    assert refused.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert "min_noise_multiplier" in str(refused.get_header(REFUSAL_HEADER))
    # 3. round A goes on to the masked inputs
    masked = stage()
    from secagg import decode

    masked_left = 1 in masked and isinstance(decode(masked[1]), MaskedInput)
    first = _charges(tmp_path)[0]
    assert not masked_left or first["withdrawn"] is None, (
        f"round A's masked input left site-1, its charge was withdrawn: "
        f"{first['withdrawn']!r}")
