"""The round deadlines follow the round's cost model (transport.deadlines.round_work,
docs/performance.md "Round deadlines"): they grow with n x k (shares, agreements, routing),
with k x dim (masking) and with the clients sharing a core, and every caller passes what it
knows of the round. Pure arithmetic: no processes, no clock."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from fl.cli import simulate
from secagg import Config, Stage
from transport.deadlines import (
    MAX_GIVE_UP_SECONDS,
    MAX_STAGE_SECONDS,
    SAFETY,
    round_timeouts,
    round_work,
)

SHARE = Stage.SHARE_KEYS
MASK = Stage.MASKED_INPUT

MEASURED_SHARE_KEYS_300 = 26.5
"""Seconds share_keys took in ``python -m fl.cli simulate --clients 300 --dim 1000 --seed 1``
(embedded broker, 2 worker processes, 2 cores, load average about 2; docs/performance.md):
the stage that timed out at 60 s when the deadline ignored the n^2 work."""


def _simulate_deadlines(n: int, neighbors: int | None = None, dim: int = 1000,
                        processes: int = 2, security: str = "semi-honest") -> Any:
    config = Config(num_clients=n, dim=dim, neighbors=neighbors, security=security,
                    dropout_rate=0.0 if neighbors is not None else None)
    return simulate._timeouts(config, processes)


def test_a_300_client_complete_graph_share_keys_gets_the_measured_time_times_the_safety():
    timeouts = _simulate_deadlines(300)
    assert timeouts.deadline(SHARE) >= MEASURED_SHARE_KEYS_300 * SAFETY
    # the clients keep their message unconfirmed that long without re-publishing it
    assert timeouts.retry >= MEASURED_SHARE_KEYS_300 * SAFETY - 60.0


@pytest.mark.parametrize("colocated", [1, 150])
def test_complete_graph_work_grows_with_n_squared(colocated):
    work = [round_work(clients=n, dim=1000, colocated=colocated)["share_keys"]
            for n in (100, 200, 400)]
    # n x k pairs at the server/broker; k per client, times the clients sharing a core
    assert work[0] < work[1] < work[2]
    if colocated == 1:  # each site on its own machine: n^2 routing dominates at scale
        assert 3.0 < work[2] / work[1] < 4.5
    deadlines = [round_timeouts(60.0, clients=n, dim=1000, colocated=n // 2).deadline(SHARE)
                 for n in (100, 200, 300, 500)]
    assert deadlines == sorted(deadlines) and len(set(deadlines)) == 4
    # in simulate (n / 2 clients per core) share_keys is n^2: doubling n about 4x the work
    w = [round_work(clients=n, dim=1000, colocated=n // 2)["share_keys"] for n in (250, 500)]
    assert 3.9 < w[1] / w[0] < 4.1


def test_secagg_plus_work_grows_with_n_times_k_not_n_squared():
    k = 40
    sparse = [round_work(clients=n, dim=1000, neighbors=k)["share_keys"]
              for n in (500, 1000, 2000)]
    # each site computes for k neighbours; the server routes n x k: linear in n
    assert 1.9 < sparse[1] / sparse[0] < 2.1 and 1.9 < sparse[2] / sparse[1] < 2.1
    complete = round_work(clients=1000, dim=1000)["share_keys"]
    assert complete > 10 * sparse[1]
    by_k = [round_work(clients=500, dim=1000, neighbors=kk)["share_keys"]
            for kk in (20, 40, 80)]
    assert 1.9 < by_k[1] / by_k[0] < 2.1 and 1.9 < by_k[2] / by_k[1] < 2.1
    # through the command line's own config: SecAgg+ gets a shorter share_keys deadline
    assert (_simulate_deadlines(300, neighbors=40).deadline(SHARE)
            < _simulate_deadlines(300).deadline(SHARE))


def test_masking_grows_with_dim_and_malicious_costs_more():
    small = round_work(clients=100, dim=1000, neighbors=20)
    large = round_work(clients=100, dim=1_000_000, neighbors=20)
    assert large["masked_input"] > 2 * small["masked_input"]
    assert large["share_keys"] == small["share_keys"]  # shares do not depend on d
    assert large["finish"] > small["finish"]  # the server removes dropped pairs' masks
    semi = round_timeouts(60.0, clients=200, dim=1000, colocated=100)
    mal = round_timeouts(60.0, clients=200, dim=1000, colocated=100, malicious=True)
    for stage in (SHARE, Stage.UNMASKING):
        assert mal.deadline(stage) > semi.deadline(stage)


def test_co_located_clients_lengthen_the_deadlines_and_the_re_publish_timer():
    alone = round_timeouts(60.0, clients=300, dim=1000, colocated=1)
    shared = round_timeouts(60.0, clients=300, dim=1000, colocated=150)
    assert shared.deadline(SHARE) > alone.deadline(SHARE)
    assert shared.retry > alone.retry
    # a client's retry covers the stage's modelled work, the stage deadline covers it too,
    # and a client gives up only after more than the longest stage
    work = round_work(clients=300, dim=1000, colocated=150)
    assert shared.retry >= SAFETY * work["share_keys"]
    assert shared.give_up > max(shared.deadline(s) for s in Stage)
    assert shared.answer >= SAFETY * (work["share_keys"] + work["finish"])


def test_a_round_with_no_size_keeps_the_plain_stage_deadline():
    plain = round_timeouts(2.0)
    assert all(plain.deadline(s) == 2.0 for s in Stage)
    assert plain.retry == 2.0 and plain.give_up == 120.0


def test_simulate_counts_the_clients_per_core(monkeypatch):
    monkeypatch.setattr(simulate.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    config = Config(num_clients=300, dim=1000)
    two = simulate._timeouts(config, processes=2)
    one = simulate._timeouts(config, processes=1)
    assert two == round_timeouts(60.0, clients=300, dim=1000, colocated=150)
    assert one == round_timeouts(60.0, clients=300, dim=1000, colocated=300)
    # more worker processes than cores do not make the cores faster
    assert simulate._timeouts(config, processes=8) == two
    # what the command line parsed (here: malicious) reaches the model
    args = argparse.Namespace(drop_rate=0.0, threshold=None, bits=32, neighbors=None,
                              security="malicious")
    malicious = simulate._timeouts(simulate.build_config(args, 300, 1000), processes=2)
    assert malicious == round_timeouts(60.0, clients=300, dim=1000, malicious=True,
                                       colocated=150)


@pytest.mark.parametrize("size", [
    {"clients": 65_535, "dim": 10**6},  # a site sizing its deadlines from a coordinator's roster
    {"clients": 500, "dim": 10**8},
    {"clients": 1000, "dim": 10**7, "malicious": True, "colocated": 500},
])
def test_no_roster_or_model_size_makes_a_party_wait_longer_than_the_caps(size):
    timeouts = round_timeouts(60.0, **size)
    waits = [timeouts.deadline(s) for s in Stage] + [timeouts.start, timeouts.retry,
                                                     timeouts.answer]
    assert max(waits) == MAX_STAGE_SECONDS  # the model asked for more; the cap holds
    assert timeouts.give_up == MAX_GIVE_UP_SECONDS
    assert min(waits) >= 60.0  # still at least the caller's stage time
    # a caller whose own stage time exceeds the cap keeps it
    stage = 3 * MAX_STAGE_SECONDS
    slow = round_timeouts(stage, **size)
    assert slow.deadline(MASK) == stage and slow.give_up == max(MAX_GIVE_UP_SECONDS, 3 * stage)


def test_deadlines_below_the_caps_are_the_model_s():
    timeouts = round_timeouts(60.0, clients=300, dim=1000, colocated=150)
    work = round_work(clients=300, dim=1000, colocated=150)
    assert timeouts.deadline(SHARE) == 60.0 + SAFETY * work["share_keys"] < MAX_STAGE_SECONDS
    assert timeouts.give_up < MAX_GIVE_UP_SECONDS
