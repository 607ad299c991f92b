"""Federated training end to end over the in-memory MQTT-semantics bus: FedAvg learns,
FedProx changes the update, checkpoints resume, the budget stops training, and every
aggregate under dropouts equals the plaintext sum of the included sites' inputs."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fl.coordinator import Coordinator, RoundCapture
from fl.data import synthetic_ehr
from fl.federation import train, train_central
from fl.settings import TrainSettings
from fl.site.training import Site
from fl.vector import ParameterLayout

pytestmark = pytest.mark.timeout(120)

BASE = TrainSettings(sites=5, rounds=3, broker="memory", seed=0)


def _check_sum(capture: RoundCapture) -> None:
    """Independent of the coordinator's own check: sum the captured inputs here."""
    modulus = 1 << capture.config.bits
    expected = [0] * capture.config.dim
    for cid in capture.included:
        expected = [(a + int(b)) % modulus for a, b in zip(expected, capture.inputs[cid],
                                                           strict=True)]
    assert [int(t) for t in capture.total] == expected


def test_short_fedavg_beats_chance() -> None:
    captures: list[RoundCapture] = []
    report = train(BASE, on_capture=captures.append)
    chance = train_central(BASE)["chance"]
    assert len(report["rounds"]) == 3
    assert report["final_accuracy"] > chance + 0.2
    assert all(r["aggregate_correct"] for r in report["rounds"])
    assert all(r["included"] == [1, 2, 3, 4, 5] for r in report["rounds"])
    for c in captures:
        _check_sum(c)
        # The secure count is the number of training records: weighted FedAvg.
        assert sum(c.counts.values()) == 456


def test_fedprox_term_changes_the_update() -> None:
    table = synthetic_ehr(100, seed=0)
    site = Site(1, table)
    model = torch.nn.Linear(table.num_features, 2)
    layout = ParameterLayout.of(model)
    kw = {"epochs": 3, "lr": 0.1, "batch_size": 16, "seed": 5}
    fedavg = site.fedavg_update(model, layout, mu=0.0, **kw)
    again = site.fedavg_update(model, layout, mu=0.0, **kw)
    prox = site.fedavg_update(model, layout, mu=5.0, **kw)
    assert np.array_equal(fedavg, again)  # same seed, same update: the difference is mu
    assert not np.allclose(fedavg, prox)
    assert np.linalg.norm(prox) < 0.8 * np.linalg.norm(fedavg)  # pulled toward w_global


def test_checkpoint_resume_continues_from_saved_round(tmp_path: Path) -> None:
    straight = train(replace(BASE, rounds=4, drop_rate=0.3, seed=4))
    ck = str(tmp_path / "ck")
    first = train(replace(BASE, rounds=2, drop_rate=0.3, seed=4, checkpoint=ck))
    assert [r["round"] for r in first["rounds"]] == [1, 2]
    with pytest.raises(ValueError, match="--resume"):
        train(replace(BASE, rounds=4, drop_rate=0.3, seed=4, checkpoint=ck))
    seen: list[int] = []
    resumed = train(replace(BASE, rounds=4, drop_rate=0.3, seed=4, checkpoint=ck,
                            resume=True), on_capture=lambda c: seen.append(c.round))
    assert seen == [3, 4]  # rounds 1 and 2 were not run again
    assert [r["round"] for r in resumed["rounds"]] == [1, 2, 3, 4]
    # Secure aggregation is exact and the run is seeded: resuming changes nothing.
    assert np.allclose(resumed["model"], straight["model"], atol=1e-9)
    with pytest.raises(ValueError, match="other settings"):
        train(replace(BASE, rounds=5, lr=0.5, seed=4, checkpoint=ck, resume=True))


def test_crash_mid_round_loses_only_that_round(tmp_path: Path, monkeypatch) -> None:
    ck = str(tmp_path / "ck")
    settings = replace(BASE, rounds=3, checkpoint=ck)
    original = Coordinator.run_round

    def crash_in_round_3(self: Coordinator, r: int) -> bool:
        if r == 3:
            raise RuntimeError("coordinator killed")
        return original(self, r)

    monkeypatch.setattr(Coordinator, "run_round", crash_in_round_3)
    with pytest.raises(RuntimeError, match="killed"):
        train(settings)
    monkeypatch.setattr(Coordinator, "run_round", original)
    resumed = train(replace(settings, resume=True))
    assert [r["round"] for r in resumed["rounds"]] == [1, 2, 3]


def test_a_round_charged_but_lost_in_a_crash_is_charged_again_and_said_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The write-ahead charge of round 2 is checkpointed, then the run dies mid-round: the
    resumed run says in one line that round 2 is charged again, and its final epsilon is
    that of an uninterrupted run plus one round's cost (never less)."""
    settings = TrainSettings(sites=3, rounds=3, dataset="ehr", ehr_patients=150,
                             dp="distributed", noise_multiplier=2.0, sample_rate=0.2,
                             broker="memory", seed=1, checkpoint=str(tmp_path / "ck"))
    original = Coordinator._aggregate

    def die_in_round_2(self: Coordinator, r: int, cohort: list[int]) -> object:
        if r == 2:
            raise RuntimeError("coordinator killed")
        return original(self, r, cohort)

    monkeypatch.setattr(Coordinator, "_aggregate", die_in_round_2)
    with pytest.raises(RuntimeError, match="killed"):
        train(settings)
    monkeypatch.setattr(Coordinator, "_aggregate", original)
    lines: list[str] = []
    resumed = train(replace(settings, resume=True), log=lines.append)
    said = [line for line in lines if "charged again" in line or "charges it again" in line]
    assert said == ["round 2 was charged to the privacy budget but did not complete before "
                    "the run stopped: its charge stays, and running it again charges it "
                    "again (conservative)"], lines
    straight = train(replace(settings, checkpoint=None))
    assert [r["round"] for r in resumed["rounds"]] == [1, 2, 3]
    assert len(resumed["dp_events"]["events"]) == len(straight["dp_events"]["events"]) + 1
    assert resumed["final_epsilon"] > straight["final_epsilon"]
    again: list[str] = []
    train(replace(settings, resume=True, rounds=4), log=again.append)  # completed: silent
    assert not [line for line in again if "charges it again" in line], again


def test_budget_stops_training_before_the_round_that_would_exceed_it() -> None:
    settings = TrainSettings(sites=3, rounds=40, dataset="ehr", ehr_patients=150,
                             dp="distributed", epsilon=2.0, noise_multiplier=2.0,
                             sample_rate=0.2, broker="memory", seed=1)
    report = train(settings)
    rounds = report["rounds"]
    assert 2 <= len(rounds) < 40
    stop = report["stopped"]
    assert stop and f"round {len(rounds) + 1} not run" in stop
    eps = [r["epsilon"] for r in rounds]
    assert eps == sorted(eps) and eps[-1] <= 2.0
    # The round that was refused really would have overshot: the stop is not premature.
    would = float(re.search(r"epsilon to ([0-9.]+) >", stop).group(1))
    assert would > 2.0 > eps[-1]


@pytest.mark.parametrize("dp", ["none", "distributed"])
def test_dropouts_every_aggregate_verified(dp: str) -> None:
    captures: list[RoundCapture] = []
    settings = TrainSettings(sites=5, rounds=8, drop_rate=0.3, broker="memory", seed=11,
                             dataset="ehr", ehr_patients=250, dp=dp,
                             epsilon=4.0 if dp != "none" else None)
    report = train(settings, on_capture=captures.append)
    rows = report["rounds"]
    assert [r["round"] for r in rows] == list(range(1, 9))  # training completed
    dropped = [r for r in rows if r["dropped"]]
    assert len(dropped) >= 3
    stages = {st for r in rows for st in r["dropped"].values()}
    assert len(stages) >= 2
    for r, c in zip(rows, captures, strict=True):
        assert r["aggregate_correct"] is True
        assert set(r["included"]) == set(c.included) and len(c.included) >= 3
        _check_sum(c)
        # A site that dropped before sending its masked input is not in the sum.
        for cid, stage in r["dropped"].items():
            assert (int(cid) in c.included) == (stage == "unmasking")
