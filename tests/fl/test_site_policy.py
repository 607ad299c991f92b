"""Issue 13 through the public surface: the plan is what runs, write-ahead accounting
survives a crash, epsilon is always known, exact statistics stay out of DP runs, the site
refuses a hostile coordinator's round under its own policy, and the report's audit trail
recomputes with Google's dp-accounting."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("opacus")

from dp.encoding import EncodingParams
from dp.policy import PolicyRefused, SitePolicy
from fl import checkpoint as ckpt
from fl.cli import main
from fl.contribution import RoundTask
from fl.coordinator import RoundCapture
from fl.federation import privacy_plan, train
from fl.settings import TrainSettings
from fl.site.core import open_site_core

pytestmark = pytest.mark.timeout(180)

EHR = TrainSettings(sites=3, rounds=12, dataset="ehr", ehr_patients=150, dp="distributed",
                    epsilon=2.0, sample_rate=0.2, noise_multiplier=2.0, broker="inprocess",
                    seed=3)


def test_the_run_follows_its_printed_plan_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    plan = privacy_plan(EHR)
    assert 1 <= plan["rounds_run"] < EHR.rounds  # the budget stops it early
    report = train(EHR)
    assert [r["epsilon"] for r in report["rounds"]] == plan["epsilon_after"]
    assert report["stopped"] and f"round {plan['rounds_run'] + 1} not run" in report["stopped"]
    code = main(["train", "--sites", "3", "--rounds", "12", "--dataset", "ehr", "--dp",
                 "distributed", "--epsilon", "2", "--sample-rate", "0.2",
                 "--noise-multiplier", "2", "--seed", "3", "--plan", "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["epsilon_after"] == plan["epsilon_after"][:printed["rounds_run"]]
    assert printed["mechanism"].startswith("distributed discrete Gaussian")
    assert printed["per_site_noise_stddev"] > 0 and printed["secagg_threshold"] >= 2


def test_a_crash_after_the_release_leaves_the_round_counted(tmp_path: Path) -> None:
    """The sum of round 2 is computed (released), then the process dies before its
    checkpoint: the checkpoint must already count round 2."""
    settings = replace(EHR, rounds=3, epsilon=50.0, checkpoint=str(tmp_path))

    def crash(capture: RoundCapture) -> None:
        if capture.round == 2:
            raise KeyboardInterrupt("power cut after unmasking round 2")

    with pytest.raises(KeyboardInterrupt):
        train(settings, on_capture=crash)
    saved = ckpt.load(tmp_path)
    assert saved is not None and saved.round == 1 and len(saved.events) == 2
    resumed = train(replace(settings, resume=True))
    full = train(replace(EHR, rounds=4, epsilon=50.0))
    # Resumed: rounds 1, 2 (lost), 2 (rerun), 3 are all on the budget = four rounds' cost.
    assert resumed["rounds"][-1]["epsilon"] == pytest.approx(full["rounds"][3]["epsilon"])


def test_epsilon_is_always_known_and_contradictions_are_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    report = train(replace(EHR, rounds=2, epsilon=None))
    assert all(r["epsilon"] is not None and r["epsilon"] > 0 for r in report["rounds"])
    with pytest.raises(ValueError, match="without --dp"):
        TrainSettings(epsilon=3.0)
    assert main(["train", "--sites", "3", "--rounds", "1", "--epsilon", "3"]) == 2
    assert "without --dp" in capsys.readouterr().err
    with pytest.raises(ValueError, match="exact feature sums"):
        TrainSettings(dp="site", epsilon=3.0, scaling="secure")
    TrainSettings(dp="distributed", epsilon=3.0, adaptive_clip=0.5)  # accounted jointly
    with pytest.raises(ValueError, match="checkpoints do not hold"):
        TrainSettings(dp="distributed", epsilon=3.0, adaptive_clip=0.5, checkpoint="ck")
    assert main(["train", "--sites", "3", "--rounds", "1", "--dp", "site", "--epsilon", "3",
                 "--min-threshold", "1"]) == 2  # a site's policy is not the coordinator's
    assert "coordinator cannot set it" in capsys.readouterr().err


def test_dp_runs_release_no_exact_feature_statistics() -> None:
    """breast-cancer is not on a public scale: without DP the federation scales it with an
    exact secure sum; with DP it must not (the statistics are noised and charged instead:
    tests/fl/test_private_scaler.py; with --scaling none the only aggregations are the
    rounds)."""
    base = TrainSettings(sites=3, rounds=1, broker="inprocess", dp="site",
                         noise_multiplier=1.0, site_steps=1)
    dims: list[int] = []
    train(base, on_capture=lambda c: dims.append(c.config.dim))
    report = train(replace(base, dp="none", noise_multiplier=None))
    assert len(dims) == 1 and report["rounds"]
    assert privacy_plan(base)["feature_scaling"].startswith("noised secure sum")
    assert privacy_plan(replace(base, scaling="none"))["feature_scaling"] == "none"
    assert privacy_plan(replace(base, dp="none", noise_multiplier=None)
                        )["feature_scaling"].startswith("exact")


def test_a_public_scaler_is_applied_and_releases_nothing(tmp_path: Path) -> None:
    from fl.federation import load_split, public_scaler, tensors

    base = TrainSettings(sites=3, rounds=1, broker="inprocess", dp="site",
                         noise_multiplier=1.0, site_steps=1)
    x = load_split(base).train.x  # stands in for a reference population's statistics
    path = tmp_path / "scaler.json"
    path.write_text(json.dumps({"mean": x.mean(axis=0).tolist(),
                                "std": x.std(axis=0).tolist()}))
    public = replace(base, scaler_file=str(path))
    dims: list[int] = []
    train(public, on_capture=lambda c: dims.append(c.config.dim))
    assert len(dims) == 1 and privacy_plan(public)["feature_scaling"] == "public (--scaler)"
    scaled, _ = tensors(load_split(base).test, public_scaler(public, x.shape[1]))
    assert abs(float(scaled.mean())) < 0.5
    path.write_text(json.dumps({"mean": [0.0], "std": [1.0]}))
    with pytest.raises(ValueError, match="one per feature"):
        train(public)


def test_bits_come_from_a_public_bound_not_the_largest_site() -> None:
    small = privacy_plan(replace(EHR, ehr_patients=60))
    large = privacy_plan(replace(EHR, ehr_patients=600))
    assert small["bits"] == large["bits"]
    assert privacy_plan(replace(EHR, max_units=10))["bits"] < small["bits"]


def _hostile_task() -> RoundTask:
    params = EncodingParams(dim=31, clip_norm=1.0, scale=4096.0, bits=40, noise_stddev=0.0,
                            rotation_seed=1, threshold=1)
    body = RoundTask(mode="distributed", round=1, cohort=3, seed=0, sample_rate=1.0,
                     params=params, max_units=1000).to_wire()
    return RoundTask.from_wire(body, 30)  # exactly what the site decodes from the blob


def test_the_site_refuses_noise0_threshold1_q1_and_its_ledger_survives_restart(
        tmp_path: Path) -> None:
    policy = SitePolicy(modes=("distributed",), min_noise_multiplier=0.5, min_threshold=2,
                        max_sample_rate=0.3, epsilon=4.0)
    ledger = tmp_path / "site-1.json"
    guard = open_site_core(policy=policy, ledger_path=str(ledger))
    with pytest.raises(PolicyRefused) as err:
        guard.admit(_hostile_task(), secagg_threshold=1, label="round 1")
    assert err.value.rule in {"min_threshold", "min_noise_multiplier", "max_sample_rate"}
    for fix in ({"noise_stddev": 1.0}, {"threshold": 2}):  # one broken rule at a time
        task = _hostile_task()
        task = replace(task, params=replace(task.params, **fix))
        with pytest.raises(PolicyRefused):
            guard.admit(task, secagg_threshold=2, label="round 1")
    good = _hostile_task()
    good = replace(good, sample_rate=0.2, params=replace(good.params, noise_stddev=1.0,
                                                         threshold=2))
    with pytest.raises(PolicyRefused, match=r"\[max_sample_rate\]"):
        guard.admit(replace(good, sample_rate=1.0), secagg_threshold=2, label="round 1")
    charge = guard.admit(good, secagg_threshold=2, label="round 1")
    assert charge.epsilon_after > 0
    guard.ledger.close()
    again = open_site_core(policy=policy, ledger_path=str(ledger))  # the site restarts
    assert again.ledger.releases == 1
    assert again.ledger.epsilon == pytest.approx(charge.epsilon_after)
    again.ledger.close()


def test_adaptive_clipping_run_and_its_audit_trail_recompute_independently() -> None:
    audit = pytest.importorskip("dp.audit")
    settings = TrainSettings(sites=3, rounds=2, dataset="ehr", ehr_patients=150, dp="site",
                             noise_multiplier=1.2, site_steps=5, sample_rate=0.1,
                             adaptive_clip=0.5, clip_count_stddev=3.0, broker="inprocess",
                             expected_batch=5.0)
    report = train(settings)
    releases = report["releases"]
    assert [r["round"] for r in releases] == [1, 2]
    assert all(r["count_stddev"] == 3.0 and r["epsilon_charged"] > 0 for r in releases)
    final = report["rounds"][-1]["epsilon"]
    assert audit.recompute_epsilon(report["dp_events"], settings.delta) == pytest.approx(
        final, rel=1e-3)
    prv = train(replace(settings, accountant="prv", rounds=1))
    assert prv["rounds"][0]["epsilon"] < report["rounds"][0]["epsilon"]


def test_a_site_process_refuses_the_hostile_round_before_computing_anything(
        tmp_path: Path) -> None:
    """The site role's own code path (fl.remote.inputs.site_round, as SiteProcess calls it):
    the hostile task is refused naming the rule, nothing is charged; an acceptable task is
    charged before its input exists; the exact feature-statistics task is refused."""
    import os

    import numpy as np

    from fl.models import make_model
    from fl.remote.blob import Blob
    from fl.remote.inputs import demo_site_data, site_input
    from fl.remote.messages import Announce, WireError
    from fl.vector import ParameterLayout

    settings = TrainSettings(sites=3, rounds=1, dataset="ehr", ehr_patients=60)
    data = demo_site_data(settings, 1, (1, 2, 3))
    schema = {"features": list(data.schema.features), "labels": list(data.schema.labels),
              "model": "logreg"}
    model = make_model("logreg", len(schema["features"]), len(schema["labels"]))
    vector = ParameterLayout.of(model).to_vector(model)
    hostile = _hostile_task()
    params = replace(hostile.params, dim=vector.size + 1)
    policy = SitePolicy(modes=("distributed",), min_noise_multiplier=0.5, max_sample_rate=0.3)
    guard = open_site_core(policy=policy, ledger_path=str(tmp_path / "ledger.json"))

    def run(task: RoundTask, threshold: int = 2, kind: str = "train") -> np.ndarray:
        body = {**schema, **task.to_wire()} if kind == "train" else {
            **schema, "dim": 2 * len(schema["features"]) + 1, "bits": 64}
        blob = Blob.decode(Blob(kind, body, vector if kind == "train" else None).encode())
        ann = Announce(os.urandom(16), 1, 0, kind, "r1", (1, 2, 3), bytes(32), 1,
                       threshold=threshold)
        return site_input(data, blob, ann, require_dp=None, guard=guard)

    with pytest.raises(WireError, match=r"refused by site policy \[min_threshold\]"):
        run(replace(hostile, params=params), threshold=1)
    with pytest.raises(WireError, match=r"\[min_noise_multiplier\]"):
        run(replace(hostile, params=replace(params, threshold=2)))
    with pytest.raises(WireError, match=r"\[exact-release\]"):
        run(hostile, kind="scaler")
    assert guard.ledger.releases == 0
    good = replace(hostile, sample_rate=0.2, params=replace(params, threshold=2,
                                                            noise_stddev=1.0))
    assert run(good).size == good.params.encoded_dim
    assert guard.ledger.releases == 1 and guard.ledger.epsilon > 0
    guard.ledger.close()


def test_the_site_operators_policy_file_and_flags_make_the_policy(tmp_path: Path) -> None:
    from fl.cli.app import build_parser
    from fl.cli.train import site_policy_from_args

    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"modes": ["site"], "min_noise_multiplier": 0.7,
                                "max_releases": 50, "epsilon": 2.0, "delta": 1e-6}))
    args = build_parser().parse_args(["train", "--role", "site", "--site-id", "1",
                                      "--policy", str(path), "--min-threshold", "4",
                                      "--max-sample-rate", "0.05"])
    policy = site_policy_from_args(args)
    assert policy == SitePolicy(modes=("site",), min_noise_multiplier=0.7, min_threshold=4,
                                max_sample_rate=0.05, max_releases=50, epsilon=2.0,
                                delta=1e-6)
    args = build_parser().parse_args(["train", "--role", "site", "--site-id", "1",
                                      "--dp", "distributed", "--epsilon", "3"])
    policy = site_policy_from_args(args)
    assert policy.modes == ("distributed",) and policy.requires_dp and policy.epsilon == 3.0


def test_a_lowered_threshold_at_go_is_refused_and_an_unsent_input_is_not_charged(
        tmp_path: Path) -> None:
    guard = open_site_core(policy=SitePolicy(), ledger_path=str(tmp_path / "l.json"))
    task = _hostile_task()
    task = replace(task, sample_rate=0.1, params=replace(task.params, noise_stddev=1.0,
                                                         threshold=3))
    guard.admit(task, secagg_threshold=3, label="round 1", key=b"k1")
    assert guard.ledger.releases == 1
    guard.check_go(b"k1", 3)
    with pytest.raises(PolicyRefused, match=r"\[min_threshold\]"):
        guard.check_go(b"k1", 2)  # the coordinator lowers the threshold at go
    guard.not_sent(b"k1", "refused at go")
    assert guard.ledger.releases == 0 and guard.ledger.charges[0].withdrawn == "refused at go"
    guard.ledger.close()
