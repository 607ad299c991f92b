"""A site that counts only its own share of a round's noise (the coordinator alone named
the roster, fl.site.core.lone_share) and refuses the round for it says so: the refusal
quotes its share beside the noise multiplier the round asked for, and why they differ."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from dp.policy import PolicyRefused, SitePolicy
from fl.contribution import round_task
from fl.federation import federation_plan, load_split
from fl.settings import TrainSettings
from fl.site.core import lone_share, site_proposal


def test_a_refusal_on_the_lone_share_quotes_the_requested_noise_and_why() -> None:
    settings = TrainSettings(sites=3, rounds=2, dataset="ehr", ehr_patients=90, seed=1,
                             dp="distributed", epsilon=30.0, sample_rate=0.5)
    split = load_split(settings)
    _, threshold, plan = federation_plan(settings, split.train.num_features,
                                         split.train.num_classes)
    task = round_task(settings, plan, 1, 3, max_units=1000)
    asked = site_proposal(task, secagg_threshold=threshold)
    share = lone_share(task, asked)
    assert share.noise_multiplier < asked.noise_multiplier
    floor = (share.noise_multiplier + asked.noise_multiplier) / 2
    policy = SitePolicy(modes=("distributed",), min_noise_multiplier=floor, round_epsilon=None,
                        epsilon=None)  # only the noise floor is under test
    policy.check(asked)  # the whole round's noise would do
    with pytest.raises(PolicyRefused) as refused:
        policy.check(share)
    message = str(refused.value)
    assert f"noise multiplier {share.noise_multiplier:.4g} (this site's own share" in message
    assert f"round's noise multiplier {asked.noise_multiplier:.4g}" in message
    assert "authenticated roster" in message
