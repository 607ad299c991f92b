"""The site executor's refusals, through its NVFlare interface (no simulator): a train task
without a secure-aggregation setup, a setup of another job, a stage of a round the site
never joined and a task that is not part of a secure round are answered with an error
reply, the user's training never runs and nothing is charged; the site's own job's round
is answered with a key advertisement (session and payload) only."""

from __future__ import annotations

import json
from pathlib import Path

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

from dp.ledger import Ledger
from fl.nvflare import SecAggExecutor, SiteConfig
from fl.nvflare.common import PAYLOAD, SESSION, SETUP_HEADER, STAGE_TASK, run_id, site_id
from fl.round_setup import fixed_setup
from fl.vector import ArrayLayout


class Trainer(Executor):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext,
                abort_signal: Signal) -> Shareable:
        self.calls += 1
        return shareable


def _site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[SecAggExecutor, Trainer]:
    monkeypatch.setenv("SECAGG_NVFLARE_DIR", str(tmp_path))
    (tmp_path / "site-1").mkdir()
    (tmp_path / "site-1" / "policy.json").write_text(json.dumps({"modes": ["none"]}))
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
    executor, trainer = _site(tmp_path, monkeypatch)
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
    from dataclasses import replace

    from dp.distributed import effective_noise_multiplier
    from fl.round_setup import DpSpec, RoundSetup, dp_params

    executor, trainer = _site(tmp_path, monkeypatch)
    (tmp_path / "site-1" / "policy.json").write_text(json.dumps({"modes": ["distributed"]}))
    executor.config = SiteConfig.for_site("site-1")
    ctx = _context("job-a")

    def dp_task(bits: int, dp_bits: int) -> tuple[Shareable, RoundSetup]:
        task = _train_task("job-a")
        fixed = RoundSetup.from_bytes(task.get_header(SETUP_HEADER))
        setup = replace(fixed, encoding="ddp", frac_bits=0, metrics=(), bits=bits,
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
