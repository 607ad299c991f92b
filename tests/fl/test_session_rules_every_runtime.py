"""The site session's two rules give the same answer in every runtime (issue 27, "one site
session"; fl/site/session.py): a site that joined a round and is sent the same setup again
refuses it, naming the rule, without charging it again; when that round ends before the
site's masked input existed its charge is withdrawn; the withdrawn round is still joined (a
second replay is refused too; the site role's after a restart over its ledger). Each
runtime is driven through its own surface: the Flower mod on the in-process grid, the
NVFlare executor, the site role's join (:func:`fl.remote.inputs.site_round`) in its
``SiteProcess``'s session; each joins through the session
(:meth:`fl.site.session.SiteSession.admit`) and ends a round through it."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

Outcome = tuple[list[str], list[bool], int]
"""(the two replay refusals, whether each of the round's charges is withdrawn, charges of
the round)."""


def flower(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Outcome:
    pytest.importorskip("flwr")
    from flwr.app import Message
    from flwr.serverapp.strategy import FedAvg

    from fl.errors import NothingReleased
    from fl.flower import DistributedDP, SecureAggregation
    from tests.flower import apps
    from tests.flower.test_site_core import _grid, _ledger

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    grid, _ = _grid(3)  # default nodes
    grid.silent = lambda node, msg: apps.stage_of(msg) == "share_keys"  # A ends early
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=3),
                                neighbors=None,
                                privacy=DistributedDP(clip_norm=1.0, noise_multiplier=6.0))
    with pytest.raises(NothingReleased):
        wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    node = grid.nodes[0]
    setup = next(m for m in grid.sent if m.metadata.dst_node_id == node
                 and apps.stage_of(m) == "advertise_keys")

    def replay() -> str:
        reply = grid.deliver(Message(setup.content, dst_node_id=node, message_type="train",
                                     group_id="1"))
        assert reply is not None and reply.has_error()
        return str(reply.error.reason)

    refusals = [replay()]
    grid.silent = lambda node, msg: False
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)  # B replaces A
    refusals.append(replay())
    first = _ledger(grid, node)[0]
    return refusals, [first["withdrawn"] is not None], 1


def nvflare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Outcome:
    pytest.importorskip("nvflare.apis")
    from nvflare.apis.fl_constant import ReturnCode
    from nvflare.apis.signal import Signal

    from fl.nvflare.common import REFUSAL_HEADER
    from tests.nvflare.test_executor import _charges, _context, _site, _task

    executor, _ = _site(tmp_path, monkeypatch, {"modes": ["distributed"]})  # the defaults
    ctx = _context("job-a")
    first = _task(4.0)
    assert executor.execute("train", first, ctx, Signal()).get_return_code() == ReturnCode.OK

    def replay() -> str:
        reply = executor.execute("train", first, ctx, Signal())
        assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
        return str(reply.get_header(REFUSAL_HEADER))

    refusals = [replay()]
    executor.execute("train", _task(4.0), ctx, Signal())  # B replaces A
    refusals.append(replay())
    charges = _charges(tmp_path)
    return refusals, [charges[0]["withdrawn"] is not None], 1


def site_role(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Outcome:
    import os

    from dp.policy import SitePolicy
    from fl.remote.inputs import demo_site_data, site_round
    from fl.remote.messages import WireError
    from fl.remote.site import SiteOptions, SiteProcess
    from fl.site.core import open_site_core
    from tests.fl.site_cores import site_core
    from tests.fl.test_site_session import SETTINGS, _round
    from transport.memory import MemoryNetwork

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    data = demo_site_data(SETTINGS, 1, (1, 2, 3))
    guard = site_core(SitePolicy())
    site = SiteProcess(data, MemoryNetwork(), SiteOptions(federation="fed", guard=guard),
                       lambda text: None)
    run = os.urandom(16)
    admitted, _ = site_round(data, *_round(3.0, run), require_dp=None, session=site.session)

    def replay() -> str:
        with pytest.raises(WireError) as caught:  # the same announcement again
            site_round(data, *_round(3.0, run), require_dp=None, session=site.session)
        return str(caught.value)

    refusals = [replay()]
    site._ended(admitted, None, None, "not in the round's roster")  # what it does at go
    path = guard.ledger.path
    guard.close()  # the site restarts over the same ledger: the round is still joined
    guard = open_site_core(policy=SitePolicy(), ledger_path=str(path))
    site = SiteProcess(data, MemoryNetwork(), SiteOptions(federation="fed", guard=guard),
                       lambda text: None)
    refusals.append(replay())
    try:
        return refusals, [c.withdrawn is not None for c in guard.ledger.charges], \
            len(guard.ledger.charges)
    finally:
        guard.close()


@pytest.mark.parametrize("runtime", [flower, nvflare, site_role],
                         ids=["flower", "nvflare", "site-role"])
def test_a_replay_is_refused_and_a_never_sent_round_withdrawn_in_every_runtime(
        runtime: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    refusals, withdrawn, charges = runtime(tmp_path, monkeypatch)
    # the same answer, from the one gate (fl.site.session.SiteSession.admit)
    assert len(refusals) == 2 and all(
        "already joined this round" in r
        and "a round is joined once, a replayed setup is neither charged nor trained" in r
        for r in refusals), refusals
    assert withdrawn == [True] and charges == 1


def test_a_session_runs_over_exactly_one_site_core() -> None:
    """The core is mandatory in every runtime: a session without one, or with two, is a
    ``TypeError``; anything but a ``SiteCore`` held by the runtime a ``ValueError``."""
    from dp.policy import SitePolicy
    from fl.site.session import SiteSession
    from tests.fl.site_cores import site_core

    core = site_core(SitePolicy())
    with pytest.raises(TypeError, match="runs over its site core"):
        SiteSession(runtime="next")
    with pytest.raises(TypeError, match="exactly one"):
        SiteSession(lambda: core, runtime="next", core=core)
    with pytest.raises(ValueError, match=r"must be a fl\.site\.core\.SiteCore"):
        SiteSession(runtime="next", core=object())  # type: ignore[arg-type]
    assert SiteSession(runtime="next", core=core).core is core
