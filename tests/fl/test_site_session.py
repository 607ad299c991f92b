"""Safe defaults and the one site session on the site role (``secagg train --role site``,
fl/remote/inputs.py over fl/site/session.py): a site nobody configured refuses tiny noise
and stops at its default budget; a replayed announcement is refused; a charge is withdrawn
when the input never left; an app policy only tightens; a site never runs without a core."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

from dp.encoding import EncodingParams
from dp.policy import (
    DEFAULT_EPSILON,
    DEFAULT_MIN_NOISE_MULTIPLIER,
    DEFAULT_ROUND_EPSILON,
    PolicyRefused,
    SitePolicy,
)
from fl.contribution import RoundTask
from fl.models import make_model
from fl.remote.blob import Blob
from fl.remote.inputs import demo_site_data, site_input
from fl.remote.messages import Announce, WireError
from fl.remote.site import SiteOptions
from fl.settings import TrainSettings
from fl.vector import ParameterLayout
from tests.fl.site_cores import site_core

SETTINGS = TrainSettings(sites=3, rounds=1, dataset="ehr", ehr_patients=60)


def _round(noise_stddev: float, run: bytes | None = None) -> tuple[Blob, Announce]:
    """A distributed-DP round of site 1's table (clip 1, threshold 2 of 3, q = 0.2)."""
    data = demo_site_data(SETTINGS, 1, (1, 2, 3))
    schema = {"features": list(data.schema.features), "labels": list(data.schema.labels),
              "model": "logreg"}
    model = make_model("logreg", len(schema["features"]), len(schema["labels"]))
    vector = ParameterLayout.of(model).to_vector(model)
    params = EncodingParams(dim=vector.size + 1, clip_norm=1.0, scale=4096.0, bits=40,
                            noise_stddev=noise_stddev, rotation_seed=1, threshold=2)
    task = RoundTask(mode="distributed", round=1, cohort=3, seed=0, sample_rate=0.2,
                     params=params, max_units=1000)
    blob = Blob.decode(Blob("train", {**schema, **task.to_wire()}, vector).encode())
    return blob, Announce(run or os.urandom(16), 1, 0, "train", "r1", (1, 2, 3), bytes(32),
                          1, threshold=2)


def _input(guard: object, noise: float, run: bytes | None = None) -> np.ndarray:
    blob, ann = _round(noise, run)
    return site_input(demo_site_data(SETTINGS, 1, (1, 2, 3)), blob, ann, require_dp=None,
                      guard=guard)  # type: ignore[arg-type]


@pytest.mark.parametrize("noise", [1e-9, 1e-4])
def test_a_default_site_refuses_tiny_noise(noise: float) -> None:
    guard = site_core(SitePolicy())
    with pytest.raises(WireError, match=r"\[min_noise_multiplier\]"):
        _input(guard, noise)
    assert guard.ledger.charges == []


def test_a_default_site_stops_repeated_rounds_at_its_default_budget() -> None:
    guard = site_core(SitePolicy())
    joined = 0
    for _ in range(200):
        try:
            _input(guard, 1.2)
        except WireError as exc:
            assert "[budget]" in str(exc)
            continue
        joined += 1
    assert 2 <= joined < 200 and guard.ledger.releases == joined
    assert guard.ledger.epsilon <= DEFAULT_EPSILON


def test_a_replayed_announcement_is_refused_and_a_never_sent_round_is_withdrawn() -> None:
    """The session's rules on the site role, the same answers as on the Flower node and the
    NVFlare site (tests/flower/test_default_node.py, tests/nvflare/test_default_site.py)."""
    guard = site_core(SitePolicy())
    run = os.urandom(16)
    _input(guard, 3.0, run)
    with pytest.raises(WireError, match="already joined this round"):
        _input(guard, 3.0, run)  # the same announcement again: neither charged nor computed
    assert guard.ledger.releases == 1
    _, ann = _round(3.0, run)
    guard.not_sent(ann.key, "not in the round's roster")  # SiteProcess: the session's abandon
    (charge,) = guard.ledger.charges
    assert charge.withdrawn == "not in the round's roster"
    with pytest.raises(WireError, match="already joined this round"):
        _input(guard, 3.0, run)  # withdrawn is still joined


def test_the_default_policy_states_its_guarantee_in_one_line() -> None:
    policy = SitePolicy()
    assert policy.min_noise_multiplier == DEFAULT_MIN_NOISE_MULTIPLIER > 0
    assert policy.round_epsilon == DEFAULT_ROUND_EPSILON and policy.epsilon == DEFAULT_EPSILON
    assert policy.requires_dp
    line = policy.describe()
    assert "\n" not in line and "{" not in line and "exact sums refused" in line
    assert f"noise multiplier >= {DEFAULT_MIN_NOISE_MULTIPLIER:g}" in line
    assert f"at most {DEFAULT_ROUND_EPSILON:g} per release" in line
    assert f"at most {DEFAULT_EPSILON:g} in total" in line


def test_an_apps_policy_only_tightens_the_operators() -> None:
    operator = SitePolicy(min_noise_multiplier=1.0, epsilon=8.0, round_epsilon=2.0,
                          max_sample_rate=0.5)
    app = SitePolicy(modes=("none", "distributed"), min_noise_multiplier=0.1,
                     epsilon=None, round_epsilon=1.0, max_sample_rate=1.0, min_threshold=5)
    merged = operator.tighten(app)
    assert merged.modes == ("distributed",)  # no exact sums: the app cannot opt in
    assert merged.min_noise_multiplier == 1.0 and merged.min_threshold == 5
    assert merged.epsilon == 8.0 and merged.round_epsilon == 1.0
    assert merged.max_sample_rate == 0.5
    assert operator.tighten(None) is operator
    with pytest.raises(PolicyRefused, match=r"\[exact-release\].*secagg-dp='none'"):
        operator.tighten(SitePolicy(modes=("none",)))
    with pytest.raises(PolicyRefused, match=r"\[unit\]"):
        operator.tighten(SitePolicy(unit="record"))


def test_a_release_above_the_cap_per_release_is_refused_naming_the_rule() -> None:
    guard = site_core(SitePolicy(min_noise_multiplier=0.1))
    with pytest.raises(WireError, match=r"\[round_epsilon\]"):
        _input(guard, 0.3)
    assert guard.ledger.charges == []
    guard = site_core(replace(SitePolicy(min_noise_multiplier=0.1), round_epsilon=None,
                              epsilon=None))
    assert _input(guard, 0.3).size > 0  # the operator's explicit opt-out


def test_a_site_never_runs_without_its_core() -> None:
    with pytest.raises(TypeError, match="guard"):
        SiteOptions(federation="fed")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="site core"):
        SiteOptions(federation="fed", guard=None)  # type: ignore[arg-type]


def test_secagg_train_asking_exact_sums_from_default_sites_fails_naming_the_opt_in() -> None:
    """``secagg train --role coordinator --dp none`` against site roles nobody configured:
    every attempt is declined on ``[exact-release]``; the coordinator says the rule, how
    many sites and the fix, and fails with a typed error (the CLI exits non-zero)."""
    import asyncio

    from fl.coordinator import RoundFailed
    from fl.remote.coordinator import RunFailed
    from tests.fl.test_remote_roles import IDS, CountingNetwork, _federation

    settings = TrainSettings(sites=3, rounds=1, dataset="ehr", ehr_patients=60, seed=0,
                             max_attempts=2)
    logs: list[str] = []
    options = {cid: SiteOptions(federation="fed", idle_timeout=5, guard=site_core(SitePolicy()))
               for cid in IDS}
    with pytest.raises((RoundFailed, RunFailed)) as caught:  # RunFailed: the remote one's
        asyncio.run(_federation(settings, CountingNetwork(), options, logs))
    line = str(caught.value)
    assert "3 of 3 sites refused by their site policy ([exact-release] 3)" in line
    assert "--dp none on secagg train --role site" in line
    assert any("refused by their site policy" in entry for entry in logs
               if entry.startswith("[coordinator]"))
