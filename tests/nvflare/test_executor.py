"""The site executor's refusals, through its NVFlare interface (no simulator): a train task
without a secure-aggregation setup, a setup of another job, a stage of a round the site
never joined and a task that is not part of a secure round are answered with an error
reply, the user's training never runs and nothing is charged; the site's own job's round
is answered with a key advertisement (session and payload) only."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nvflare.apis")  # not the namespace of tests/nvflare/ itself

from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from dp.ledger import Ledger, read_charges
from dp.policy import DEFAULT_EPSILON
from fl.nvflare import SecAggExecutor, SiteConfig
from fl.nvflare.common import PAYLOAD, SESSION, SETUP_HEADER, STAGE_TASK, run_id, site_id
from fl.round_plan import fixed_setup
from fl.round_setup import DpSpec, RoundSetup, encoded_dim
from fl.vector import ArrayLayout
from secagg import Server, Stage, encode
from secagg.messages import KeyList


class Trainer(Executor):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext,
                abort_signal: Signal) -> Shareable:
        self.calls += 1
        return shareable


def _site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
          policy: dict[str, Any] | None = None) -> tuple[SecAggExecutor, Trainer]:
    """Site-1's executor; ``policy``: its operator's policy.json (None: none, the default
    policy)."""
    monkeypatch.setenv("SECAGG_NVFLARE_DIR", str(tmp_path))
    (tmp_path / "site-1").mkdir(exist_ok=True)
    if policy is not None:
        (tmp_path / "site-1" / "policy.json").write_text(json.dumps(policy))
    executor, trainer = SecAggExecutor(), Trainer()
    executor.trainer, executor.site = trainer, "site-1"
    executor.config = SiteConfig.for_site("site-1")
    return executor, trainer


def _context(job_id: str) -> FLContext:
    ctx = FLContext()
    ctx.set_prop(ReservedKey.RUN_NUM, job_id, private=False, sticky=False)
    return ctx


def _train_task(job: str) -> Shareable:
    params = {"w": np.ones((2, 2), dtype=np.float32)}
    setup = fixed_setup(run_id=run_id(job), server_round=0,
                        roster=[site_id("site-1"), site_id("site-2"), site_id("site-3")],
                        arrays=ArrayLayout.of(params).specs, metrics=(),
                        weight_key="NUM_STEPS_CURRENT_ROUND", neighbors=None, threshold=None,
                        dropout_rate=0.1, corrupt_rate=0.1, security="semi-honest", bits=64,
                        frac_bits=24, verify_keys={})
    task = FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL, params=params))
    task.set_header(SETUP_HEADER, setup.to_bytes())
    return task


def test_a_site_answers_only_secure_rounds_and_never_trains_for_a_refused_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    executor, trainer = _site(tmp_path, monkeypatch, {"modes": ["none"]})
    ctx = _context("job-a")
    plain = FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL,
                                              params={"w": np.ones((2, 2))}))
    refused = [
        executor.execute("train", plain, ctx, Signal()),  # no setup: a plain FedAvg round
        executor.execute("train", _train_task("job-b"), ctx, Signal()),  # another job's
        executor.execute("validate", plain, ctx, Signal()),  # not part of a secure round
        executor.execute(STAGE_TASK, Shareable({SESSION: b"x" * 32, PAYLOAD: b"y"}), ctx,
                         Signal()),  # a stage of a round never joined
    ]
    assert [r.get_return_code() for r in refused] == [ReturnCode.EXECUTION_EXCEPTION] * 4
    assert trainer.calls == 0
    # the same site answers its own job's round with a key advertisement only
    reply = executor.execute("train", _train_task("job-a"), ctx, Signal())
    assert reply.get_return_code() == ReturnCode.OK and trainer.calls == 1
    assert set(reply) - {"__headers__"} == {SESSION, PAYLOAD}
    assert executor.config is not None
    with Ledger.open(tmp_path / "site-1" / "ledger.json", executor.config.policy) as ledger:
        assert ledger.releases == 1  # the refused tasks charged nothing


def test_the_nvflare_site_holds_the_same_dp_rules_as_the_flower_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The site core's rules that the red team found missing in the Flower node hold here
    too (one round setup path, fl/round_setup.py): a DP modulus other than the secure sum's
    is refused before training, and a DP round is charged at the replace-one sensitivity of
    the site's one clipped update (its own noise share: the roster is the server's word)."""

    from dp.distributed import effective_noise_multiplier
    from fl.round_setup import DpSpec, RoundSetup, dp_params

    executor, trainer = _site(tmp_path, monkeypatch, {  # the charge, not a floor
        "modes": ["distributed"], "min_noise_multiplier": 0, "round_epsilon": None,
        "epsilon": None})
    ctx = _context("job-a")

    def dp_task(bits: int, dp_bits: int) -> tuple[Shareable, RoundSetup]:
        task = _train_task("job-a")
        fixed = RoundSetup.from_bytes(task.get_header(SETUP_HEADER))
        setup = replace(fixed, mode="distributed", frac_bits=0, metrics=(), bits=bits,
                        dp=DpSpec(1.0, 100.0, dp_bits, 0.5, 3, "dgauss", 0.5, fixed.threshold))
        task.set_header(SETUP_HEADER, setup.to_bytes())
        return task, setup

    mismatched, _ = dp_task(64, 40)
    assert executor.execute("train", mismatched, ctx, Signal()).get_return_code() == (
        ReturnCode.EXECUTION_EXCEPTION)
    assert trainer.calls == 0
    task, setup = dp_task(40, 40)
    assert executor.execute("train", task, ctx, Signal()).get_return_code() == ReturnCode.OK
    with Ledger.open(tmp_path / "site-1" / "ledger.json", executor.config.policy) as ledger:
        (charge,) = ledger.charges
    own = replace(dp_params(setup), threshold=1)
    assert charge.noise_multiplier == pytest.approx(
        effective_noise_multiplier(own.replace_one()))
    assert charge.noise_multiplier == pytest.approx(effective_noise_multiplier(own) / 2,
                                                    rel=0.05)


def test_the_policy_fields_table_in_the_docs_is_the_dataclass() -> None:
    """docs/nvflare.md's table of policy.json fields names every SitePolicy field, and only
    those (an operator writes policy.json from it)."""
    import dataclasses
    import re

    from dp.policy import SitePolicy

    doc = (Path(__file__).resolve().parents[2] / "docs" / "nvflare.md").read_text()
    table = doc[doc.index("| `policy.json` field |"):]
    table = table[:table.index("\n\n")]
    named = {name for row in table.splitlines()[2:]
             for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert named == {f.name for f in dataclasses.fields(SitePolicy)}


# --- issue 27: a site nobody configured, and the site session's rules ---------------------


def _task(noise_stddev: float | None = None) -> Shareable:
    """A train task of job-a: exact (None) or distributed DP with that noise (clip 1)."""
    params = {"w": np.ones((2, 2), dtype=np.float32)}
    setup = fixed_setup(run_id=run_id("job-a"), server_round=0,
                        roster=[site_id(f"site-{i}") for i in (1, 2, 3)],
                        arrays=ArrayLayout.of(params).specs, metrics=(),
                        weight_key="NUM_STEPS_CURRENT_ROUND", neighbors=None, threshold=None,
                        dropout_rate=0.1, corrupt_rate=0.1, security="semi-honest", bits=64,
                        frac_bits=24, verify_keys={})
    if noise_stddev is not None:
        setup = replace(setup, mode="distributed", frac_bits=0, metrics=(), bits=40,
                        dp=DpSpec(1.0, 4096.0, 40, noise_stddev, 3, "dgauss", 0.5,
                                  setup.threshold))
    task = FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL, params=params))
    task.set_header(SETUP_HEADER, setup.to_bytes())
    _ROUND_NONCES[setup.nonce] = setup.round_nonce  # the server's single-use nonce
    return task


_ROUND_NONCES: dict[bytes, Any] = {}
"""Each task's round nonce (host-side, never on the wire), for the round's Server."""


def _charges(tmp_path: Path) -> list[dict]:
    path = tmp_path / "site-1" / "ledger.json"
    return [asdict(c) for c in read_charges(path)] if path.exists() else []


@pytest.mark.parametrize("noise", [1e-9, 1e-4])
def test_a_default_site_refuses_tiny_noise_before_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, noise: float) -> None:
    executor, trainer = _site(tmp_path, monkeypatch)
    reply = executor.execute("train", _task(noise), _context("job-a"), Signal())
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert trainer.calls == 0 and _charges(tmp_path) == []


def test_a_default_site_stops_200_repeated_rounds_at_its_default_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same DP round driven 200 times to its masked inputs (an in-process secagg server
    over three default sites): each charge stays, so the sites stop at their budget."""
    names = ["site-1", "site-2", "site-3"]
    monkeypatch.setenv("SECAGG_NVFLARE_DIR", str(tmp_path))
    sites = {}
    for name in names:
        executor, trainer = SecAggExecutor(), Trainer()
        executor.trainer, executor.site = trainer, name
        executor.config = SiteConfig.for_site(name)
        sites[name] = executor
    ctx = _context("job-a")
    joined = 0
    for _ in range(200):
        task = _task(6.0)
        setup = RoundSetup.from_bytes(task.get_header(SETUP_HEADER))
        replies = [sites[n].execute("train", task, ctx, Signal()) for n in names]
        if any(r.get_return_code() != ReturnCode.OK for r in replies):
            assert all(r.get_return_code() == ReturnCode.EXECUTION_EXCEPTION for r in replies)
            continue
        joined += 1
        server = Server(setup.config(encoded_dim(setup)), roster=range(1, 4),
                        context=setup.context(), nonce=_ROUND_NONCES.pop(setup.nonce))
        for c, reply in enumerate(replies, start=1):
            server.receive(c, reply[PAYLOAD])
        for _stage in ("share_keys", "masked_input"):
            for c, message in server.advance().items():
                out = sites[names[c - 1]].execute(STAGE_TASK, Shareable(
                    {SESSION: server.session_id, PAYLOAD: encode(message)}), ctx, Signal())
                server.receive(c, out[PAYLOAD])
    assert 2 <= joined < 60  # the red team's default node joined all 166-239
    for name in names:
        charges = [asdict(c) for c in read_charges(tmp_path / name / "ledger.json")]
        assert len(charges) == joined and all(c["withdrawn"] is None for c in charges)
        assert charges[-1]["epsilon_after"] <= DEFAULT_EPSILON
        step = charges[-1]["epsilon_after"] - charges[-2]["epsilon_after"]
        assert charges[-1]["epsilon_after"] + step > DEFAULT_EPSILON  # the budget stopped it
        assert sites[name].trainer.calls == joined  # type: ignore[union-attr]


def test_the_site_refuses_a_replayed_setup_and_withdraws_a_never_sent_round(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: NVFlare trained and charged a replayed setup again and never withdrew. Now
    the same rules as the Flower node: a replay is refused; a round replaced before its
    masked input existed is withdrawn; a round that aborts before it is withdrawn too."""
    executor, trainer = _site(tmp_path, monkeypatch, {"modes": ["none"]})
    ctx = _context("job-a")
    first = _task()
    assert executor.execute("train", first, ctx, Signal()).get_return_code() == ReturnCode.OK
    again = executor.execute("train", first, ctx, Signal())
    assert again.get_return_code() == ReturnCode.EXECUTION_EXCEPTION and trainer.calls == 1
    assert len(_charges(tmp_path)) == 1 and _charges(tmp_path)[0]["withdrawn"] is None
    second = executor.execute("train", _task(), ctx, Signal())  # replaces the first
    assert second.get_return_code() == ReturnCode.OK
    first_charge, second_charge = _charges(tmp_path)
    assert "replaced" in first_charge["withdrawn"] and second_charge["withdrawn"] is None
    # the server aborts the second round before the masked input: a bad share_keys message
    (client, _), = executor.rounds.values()
    assert client.stage < Stage.MASKED_INPUT
    hostile = encode(KeyList(b"\x01" * 32, client.client_id,
                             {client.client_id: client.own_entry}))  # another session's
    aborted = executor.execute(STAGE_TASK, Shareable({SESSION: second[SESSION],
                                                      PAYLOAD: hostile}), ctx, Signal())
    assert aborted.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert executor.rounds == {}
    assert _charges(tmp_path)[1]["withdrawn"] is not None
