"""The private DP-FedAvg+ in distributed mode (docs/privacy.md, "DP-FedAvg+ privately"):
private adaptive clipping whose count travels in the secure sum and is accounted jointly,
and site weights from DP releases only, each site scaling its update before masking with the
noise calibrated to w_max times the clip; a hostile task is refused by the site."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dp.accounting import ORDERS, rdp_to_epsilon
from dp.errors import BudgetExceeded
from dp.mechanisms.dgauss import ddg_tau
from dp.policy import PolicyRefused, SitePolicy
from dp.site_weights import release_for_budget, site_weights
from fl.cli import main
from fl.contribution import RoundTask, TaskError, round_task, site_input
from fl.federation import train
from fl.plan.privacy import distributed_plan
from fl.plan.weights import release_and_weigh
from fl.settings import TrainSettings, tcga_brca_settings
from fl.site.core import open_site_core
from fl.site.weights import CENTRES

pytestmark = pytest.mark.timeout(150)
DIM = 20


class Rows:
    """A trainer whose sampled units' gradients are given (the site's data, for the test)."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        self.num_records = len(rows)

    def unit_gradients(self, model: Any, *, sample_rate: float, unit: str = "patient"
                       ) -> np.ndarray:
        return self.rows


def model() -> Any:
    import torch

    return torch.nn.Linear(DIM - 1, 1)  # DIM parameters


def plan_and_settings(**options: Any) -> tuple[Any, TrainSettings]:
    settings = TrainSettings(sites=3, dp="distributed", noise_multiplier=2.0)
    plan = distributed_plan(model_dim=DIM, epsilon=None, delta=1e-5, sample_rate=1.0,
                            rounds=1, clip_norm=1.0, num_sites=3, threshold=2,
                            max_units_per_site=1000, noise_multiplier=2.0, **options)
    return plan, settings


def signed(vector: np.ndarray, bits: int) -> np.ndarray:
    v = vector.astype(np.int64)
    return np.where(v >= 1 << (bits - 1), v - (1 << bits), v)


def test_each_site_scales_its_rows_and_the_noise_is_that_of_w_max_times_the_clip() -> None:
    plan, settings = plan_and_settings(max_weight=2.0)
    task = round_task(settings, plan, 1, 3, weights={1: 0.5, 2: 2.0, 3: 1.0})
    p = task.params
    assert p is not None and p.clip_norm == pytest.approx(2.0)  # w_max x clip
    # Central noise multiplier 2 over w_max x clip, shared by the threshold's 2 sites.
    assert p.noise_stddev == pytest.approx(2.0 * 2.0 / math.sqrt(2))
    nobody = Rows(np.zeros((0, DIM)))
    for site in (1, 2):  # the actual noise each site adds, read off its input
        draws = np.concatenate([signed(site_input(nobody, model(), task, site).vector, p.bits)
                                for _ in range(40)])
        assert np.std(draws) / p.scale == pytest.approx(p.noise_stddev, rel=0.06)
    # The rows: weight x [g clipped to the clip's update part, count column].
    big = np.full((1, DIM), 10.0)
    codec = task.codec()
    total = sum(codec.encode(big, noise=False, weight=w).astype(np.uint64)
                for w in (0.5, 2.0)) % np.uint64(1 << p.bits)
    sums, count = codec.decode(np.asarray(total, dtype=np.uint64), 2)
    assert count == pytest.approx(2.5, abs=1e-2)  # sum of the weights, one unit each
    assert np.linalg.norm(sums) == pytest.approx(2.5 * math.sqrt(3) / 2, rel=1e-2)
    with pytest.raises(TaskError, match="no weight for site 4"):
        site_input(nobody, model(), task, 4)


def test_a_hostile_weight_or_noise_below_w_max_times_the_clip_is_refused(
        tmp_path: Path) -> None:
    plan, settings = plan_and_settings(max_weight=2.0)
    honest = round_task(settings, plan, 1, 3, weights={1: 0.5, 2: 2.0, 3: 1.0},
                        max_units=1000)
    body = honest.to_wire()
    assert RoundTask.from_wire(body, DIM) == honest  # the wire keeps the weights
    for hostile in ({**body, "weights": [[1, 2.5], [2, 1.0], [3, 1.0]]},  # above w_max
                    {**body, "weights": [[1, 0.0], [2, 1.0], [3, 1.0]]},
                    {**body, "max_weight": None}):
        with pytest.raises(TaskError):
            RoundTask.from_wire(hostile, DIM)
    with pytest.raises(TaskError, match="above the max_weight"):
        replace(honest, weights=((1, 3.0),)).weight_of(1)
    # Noise calibrated to the clip alone while the encoding's clip is w_max x clip: the
    # site's policy floor (judged against the encoding's clip) refuses it.
    assert honest.params is not None
    thin = replace(honest, params=replace(honest.params,
                                          noise_stddev=honest.params.noise_stddev / 2))
    policy = SitePolicy(modes=("distributed",), min_noise_multiplier=1.5)
    with open_site_core(policy=policy, ledger_path=str(tmp_path / "l.json")) as core:
        core.authenticated_roster = True
        with pytest.raises(PolicyRefused, match=r"\[min_noise_multiplier\]"):
            core.admit(thin, secagg_threshold=2, label="round 1")
        core.admit(honest, secagg_threshold=2, label="round 1")  # z = 2 over w_max x clip


def test_the_site_charges_the_clip_count_jointly(tmp_path: Path) -> None:
    plan, settings = plan_and_settings(target_quantile=0.5, count_stddev=3.0)
    task = round_task(settings, plan, 1, 3)
    assert task.clip_count and task.encoded_dim(DIM) == task.params.encoded_dim + 1
    policy = SitePolicy(modes=("distributed",))
    charged = []
    for i, t in enumerate((task, replace(task, count_stddev=None, target_quantile=None))):
        with open_site_core(policy=policy, ledger_path=str(tmp_path / f"{i}.json")) as core:
            core.authenticated_roster = True
            charged.append(core.admit(t, secagg_threshold=2, label="r").epsilon_after)
    expected = rdp_to_epsilon(plan.event().rdp(), 1e-5)
    assert charged[0] == pytest.approx(expected, rel=1e-6) and charged[0] > charged[1] * 1.01


def test_adaptive_clip_in_distributed_mode_is_accounted_as_dp_accounting_computes() -> None:
    """The planner calibrates the rounds with the count; their epsilon equals dp-accounting's
    composition of the two zCDP releases per round (the update's and the count's, KLS 2021),
    computed here from the published parameters."""
    dp_accounting = pytest.importorskip("dp_accounting")
    rounds, delta = 10, 1e-5
    plan = distributed_plan(model_dim=DIM, epsilon=3.0, delta=delta, sample_rate=1.0,
                            rounds=rounds, clip_norm=1.0, num_sites=6, threshold=4,
                            max_units_per_site=1000, noise_multiplier=None,
                            target_quantile=0.75, count_stddev=4.0)
    ours = rdp_to_epsilon(plan.event().rdp() * rounds, delta)
    assert 0.99 * 3.0 <= ours <= 3.0
    p, t = plan.params, plan.params.threshold

    def zcdp(l2: float, sigma: float, dim: int) -> Any:
        return dp_accounting.ZCDpEvent(rho=(l2 / (math.sqrt(t) * sigma)) ** 2 / 2,
                                       xi=ddg_tau(sigma, t) * dim)

    count_sigma = 2 * 4.0 / math.sqrt(t)  # per site, on the 2b - 1 scale
    step = dp_accounting.ComposedDpEvent([
        zcdp(p.rounded_l2_bound, p.scale * p.noise_stddev, p.encoded_dim),
        zcdp(1.0, count_sigma, 1)])
    accountant = dp_accounting.rdp.RdpAccountant(list(ORDERS))
    theirs = accountant.compose(dp_accounting.SelfComposedDpEvent(step, rounds)).get_epsilon(
        delta)
    assert ours == pytest.approx(theirs, rel=5e-3)
    without = distributed_plan(model_dim=DIM, epsilon=3.0, delta=delta, sample_rate=1.0,
                               rounds=rounds, clip_norm=1.0, num_sites=6, threshold=4,
                               max_units_per_site=1000, noise_multiplier=None)
    assert plan.params.noise_stddev > without.params.noise_stddev  # the count is paid for
    from dp.distributed import effective_noise_multiplier

    default = distributed_plan(model_dim=DIM, epsilon=3.0, delta=delta, sample_rate=1.0,
                               rounds=rounds, clip_norm=1.0, num_sites=6, threshold=4,
                               max_units_per_site=1000, noise_multiplier=None,
                               target_quantile=0.75)
    assert default.count_stddev == pytest.approx(
        10 * effective_noise_multiplier(without.params))
    # when the clip moves, scale and noise move with it: every round costs the planned event
    for clip in (0.3, 2.7):
        moved = replace(plan, params=plan.at_clip(clip))
        assert moved.clip_norm == pytest.approx(clip)
        np.testing.assert_allclose(moved.event().rdp(), plan.event().rdp(), rtol=1e-9)


def test_the_server_moves_the_clip_from_the_noised_count_only() -> None:
    """Through ``train``: each round's next clip is the geometric step computed from the
    secure sum's last coordinate (the noised count) and the round's noised unit count, and
    nothing else; each site's count coordinate carries its own noise."""
    captures: list[Any] = []
    settings = TrainSettings(sites=3, rounds=4, dp="distributed", epsilon=8.0,
                             adaptive_clip=0.5, clip_count_stddev=6.0, sample_rate=0.5,
                             broker="memory", scaling="none", seed=2)
    report = train(settings, on_capture=captures.append)
    rows = report["rounds"]
    bits = captures[0].config.bits
    for row, nxt, capture in zip(rows, rows[1:], captures, strict=False):
        v = int(signed(capture.total[-1:], bits)[0])
        fraction = v / 2 / max(row["count"], 1.0) + 0.5
        assert nxt["clip_norm"] == pytest.approx(
            row["clip_norm"] * math.exp(-0.2 * (fraction - 0.5)), rel=1e-9)
    assert len({row["clip_norm"] for row in rows}) == len(rows)
    nobody = Rows(np.zeros((0, DIM)))
    plan, small = plan_and_settings(target_quantile=0.5, count_stddev=6.0)
    task = round_task(small, plan, 1, 3)
    shares = [int(signed(site_input(nobody, model(), task, 1).vector[-1:], task.bits)[0])
              for _ in range(200)]
    # no unit: the bare count is 0; the share is the site's noise, stddev 2 x 6 / sqrt(2)
    assert np.std(shares) == pytest.approx(2 * 6.0 / math.sqrt(2), rel=0.2)


def test_private_weights_end_to_end_from_the_releases_and_within_the_budget(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``secagg train --site-weights``: the weights the rounds used are those computed from
    the audit record's releases alone; the composed epsilon (weights' release + rounds with
    their clip counts) is dp-accounting's for the same events and never above the budget."""
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp.audit import recompute_epsilon

    out = tmp_path / "r.json"
    args = ["train", "--dataset", "tcga-brca", "--model", "discrete-time", "--dp",
            "distributed", "--epsilon", "4", "--delta", "1e-5", "--rounds", "3",
            "--sample-rate", "1", "--adaptive-clip", "0.75", "--site-weights", "1",
            "--strategy", "fedavg", "--server-lr", "2", "--broker", "memory"]
    assert main([*args, "--plan", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert main([*args, "--report", str(out)]) == 0
    report = json.loads(out.read_text())
    # the plan is what runs: the weights' release first, then the rounds
    assert [r["epsilon"] for r in report["rounds"]] == pytest.approx(plan["epsilon_after"])
    assert plan["site_weights"] and plan["epsilon_before_rounds"] == pytest.approx(1.0, 1e-2)
    (weighing,) = [r for r in report["releases"] if "weights" in r]
    releases = {int(k): np.asarray(v) for k, v in weighing["releases"].items()}
    assert site_weights(releases, CENTRES, strength=1.0, min_weight=0.5, max_weight=1.0) == {
        int(k): w for k, w in weighing["weights"].items()}
    final = report["final_epsilon"]
    assert final <= 4.0 and final == pytest.approx(
        recompute_epsilon(report["dp_events"], 1e-5, "rdp"), rel=5e-3)
    sigma = weighing["noise_stddev"]  # the release, rebuilt by hand as a Gaussian
    accountant = dp_accounting.rdp.RdpAccountant(list(ORDERS))
    alone = accountant.compose(dp_accounting.GaussianDpEvent(sigma / math.sqrt(2)))
    assert weighing["epsilon_after"] == pytest.approx(alone.get_epsilon(1e-5), rel=1e-2)


def test_training_stops_before_a_round_that_would_exceed_the_budget() -> None:
    settings = tcga_brca_settings("fedavg", model="discrete-time", dp="distributed",
                                  noise_multiplier=6.0, epsilon=2.0, rounds=50, sample_rate=1.0,
                                  site_weights=1.0, weights_epsilon=0.5, broker="memory",
                                  server_lr=2.0)
    report = train(settings)
    assert report["stopped"] is not None and 2 <= len(report["rounds"]) < 50
    after = float(report["stopped"].split("bring epsilon to ")[1].split(" ")[0])
    assert report["final_epsilon"] <= 2.0 < after
    # the release is made only if it fits: on a spent budget it raises, nothing released

    from types import SimpleNamespace

    from fl.plan.privacy import make_budget

    spent = SimpleNamespace(budget=make_budget(0.1, 1e-5), events=[], releases=[], sites={})
    with pytest.raises(BudgetExceeded):
        release_and_weigh(spent, release_for_budget(1.0, 1e-5, 11), settings)
    assert spent.releases == [] and spent.events == []


def test_flower_and_nvflare_refuse_what_their_round_setup_cannot_carry() -> None:
    from fl.round_plan import DistributedDP
    from fl.round_setup import SetupError

    for option in ({"adaptive_clip": 0.75}, {"site_weights": 1.0}):
        with pytest.raises(SetupError, match="does not carry"):
            DistributedDP(clip_norm=1.0, epsilon=4.0, **option)


def test_site_weights_are_refused_across_the_roles(capsys: pytest.CaptureFixture[str]
                                                   ) -> None:
    assert main(["train", "--dataset", "tcga-brca", "--model", "discrete-time", "--dp",
                 "distributed", "--epsilon", "4", "--site-weights", "1", "--role",
                 "coordinator", "--sites", "1,2,3,4,5,6", "--broker", "mqtt://127.0.0.1:1"]
                ) == 2
    assert "--site-weights runs with --role all" in capsys.readouterr().err

