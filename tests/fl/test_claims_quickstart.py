"""docs/quickstart.md section 1, what a run does with dropouts and in site mode.

An attempt left with fewer sites than the threshold aborts, releases nothing and is
retried; the round is charged once (write-ahead), however many attempts it takes; a round
that fails every attempt stops the run with its charge kept. In site mode every site's
input carries the weight 1, not its record count."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from fl import checkpoint as ckpt
from fl.codec import FixedPointCodec
from fl.coordinator import RoundFailed
from fl.federation import privacy_plan, train
from fl.settings import TrainSettings

# seed 2: round 2's first attempt loses too many sites and aborts (drop_schedule is seeded)
RUN = TrainSettings(sites=5, rounds=2, drop_rate=0.3, broker="memory", seed=2, dataset="ehr",
                    ehr_patients=120, dp="distributed", epsilon=4.0, sample_rate=0.2)


def test_an_aborted_attempt_is_retried_releases_nothing_and_costs_nothing_more() -> None:
    plan = privacy_plan(RUN)
    report = train(RUN)
    rows = report["rounds"]
    assert [r["attempts"] for r in rows] == [1, 2]
    # charged once per round, exactly the plan (which knows nothing of attempts)
    assert [r["epsilon"] for r in rows] == plan["epsilon_after"][:2]
    # one release per round: the aborted attempt released nothing
    rounds_released = [x["round"] for x in report["releases"] if x["round"] >= 1]
    assert rounds_released == [1, 2]
    assert all(r["aggregate_correct"] for r in rows)


def test_a_round_that_fails_every_attempt_stays_charged(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    hopeless = replace(RUN, drop_rate=0.9, max_attempts=2, checkpoint=str(ck))
    with pytest.raises(RoundFailed, match="aborted 2 times"):
        train(hopeless)
    state = ckpt.load(ck)
    assert state is not None
    # nothing was released (no round completed), but round 1's write-ahead charge is kept
    assert state.round == 0 and state.history == []
    assert len(state.events) == 1 and state.events[0]["kind"] == "rdp"


def test_site_mode_weighs_sites_uniformly_and_sends_no_record_count() -> None:
    """docs/quickstart.md section 1, --dp site: the sites are averaged uniformly because an
    exact count would not be protected: every site's secure-aggregation input carries the
    weight 1, whatever its number of records, so the sum reveals only how many sites were
    included."""
    captures = []
    settings = TrainSettings(sites=4, rounds=1, broker="memory", seed=5, dataset="ehr",
                             ehr_patients=160, dp="site", noise_multiplier=1.0,
                             site_steps=1, sample_rate=0.2)
    report = train(settings, on_capture=captures.append)
    (capture,) = captures
    assert len(set(capture.counts.values())) == 1 and set(capture.counts.values()) == {1}
    codec = FixedPointCodec(capture.config.dim, bits=64, max_summands=len(capture.inputs))
    for vector in capture.inputs.values():
        assert codec.decode(vector)[-1] == 1.0  # the weight column of this site's input
    assert codec.decode(capture.total)[-1] == len(capture.included)
    assert report["rounds"][0]["count"] == len(capture.included)
