"""A site's input is computed by one function in every role: the simulated coordinator and
a hospital's own process (the multi-machine site role) produce the same secure-aggregation
input for the same seed, from the task the coordinator role puts on the wire."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

from fl.aggregation import InProcessAggregator
from fl.contribution import RoundTask, TaskError, decoder, round_task, site_input
from fl.coordinator import Coordinator
from fl.federation import load_split, make_plan
from fl.models import make_model
from fl.remote.blob import Blob
from fl.remote.coordinator import RemoteCoordinator, RemoteOptions
from fl.remote.inputs import dataset_schema, demo_site_data
from fl.remote.inputs import site_input as remote_site_input
from fl.remote.messages import Announce
from fl.settings import TrainSettings
from fl.site.training import Site
from fl.vector import ParameterLayout
from tests.fl.site_cores import ANY, site_core

pytestmark = pytest.mark.timeout(60)
IDS = (1, 2, 3)


def _roles(settings: TrainSettings) -> tuple[Coordinator, Coordinator]:
    """The simulated coordinator and the multi-machine coordinator role, same settings."""
    split = load_split(settings)
    sites = {i + 1: Site(i + 1, t) for i, t in enumerate(split.site_tables)}
    model = make_model(settings.model, split.train.num_features, split.train.num_classes,
                       settings.seed)
    dim = ParameterLayout.of(model).size
    plan = make_plan(settings, sites, dim, 2)
    simulated = Coordinator(settings, model, sites, None, plan, InProcessAggregator())
    max_units = max(s.num_patients for s in sites.values())
    remote = RemoteCoordinator(
        settings, model, None, plan, channel=None, loop=None,  # type: ignore[arg-type]
        options=RemoteOptions(site_ids=IDS, max_units=max_units),
        schema=dataset_schema(split.train.num_features, split.train.num_classes),
        scaler=None, log=print)
    return simulated, remote


def _remote_input(settings: TrainSettings, remote: Coordinator, cid: int, r: int) -> np.ndarray:
    """What site ``cid``'s own process computes from the blob the coordinator role sends."""
    _, body = remote.wire_task(r, list(IDS))
    blob = Blob.decode(Blob("train", body, remote.layout.to_vector(remote.model)).encode())
    data = demo_site_data(settings, cid, IDS)
    announce = Announce(os.urandom(16), r, 0, "train", "r1", IDS, bytes(32), 1, threshold=2)
    return remote_site_input(data, blob, announce, require_dp=None, guard=site_core(ANY))


def test_remote_site_and_simulated_coordinator_compute_identical_inputs() -> None:
    seed = 7
    settings = TrainSettings(sites=3, rounds=2, dataset="ehr", ehr_patients=60, seed=seed,
                             broker="inprocess", local_epochs=2, fedprox_mu=0.05)
    simulated, remote = _roles(settings)
    for r in (1, 2):
        inputs, _, counts = simulated._inputs(r, list(IDS))
        for cid in IDS:
            got = _remote_input(settings, remote, cid, r)
            assert got.dtype == np.uint64
            assert np.array_equal(got, inputs[cid]), (r, cid)
        assert set(counts) == set(IDS)
    # The same vector for another seed would mean the seed does not reach the site.
    other, _ = _roles(TrainSettings(sites=3, rounds=2, dataset="ehr", ehr_patients=60,
                                    seed=seed + 1, broker="inprocess", local_epochs=2,
                                    fedprox_mu=0.05))
    assert not np.array_equal(other._inputs(1, list(IDS))[0][1], inputs[1])


@pytest.mark.parametrize("dp", ["site", "distributed"])
def test_dp_tasks_survive_the_wire_unchanged(dp: str) -> None:
    """With noise drawn from the OS, DP inputs differ run to run; what must be identical is
    the task both roles apply (clip, noise, sampling, encoding) and the decoder."""
    settings = TrainSettings(sites=3, rounds=4, dataset="ehr", ehr_patients=60, seed=3,
                             broker="inprocess", dp=dp, epsilon=8.0, sample_rate=0.2,
                             site_steps=1)
    simulated, remote = _roles(settings)
    sent, body = remote.wire_task(2, list(IDS))
    received = RoundTask.from_wire(Blob.decode(Blob("train", body, np.zeros(1)).encode()).task,
                                   remote.layout.size)
    assert received == sent
    local = simulated.task(2, list(IDS))
    # The simulated coordinator knows its sites, so it needs no public --max-units bound.
    assert local == replace(sent, max_units=None)
    if dp == "distributed":
        assert received.params is not None and received.params.noise_stddev > 0
        # A fresh public rotation per round, the same in both roles.
        assert remote.wire_task(3, list(IDS))[0].params != sent.params
    # Both roles decode a sum of the remote site's inputs the same way.
    vectors = [_remote_input(settings, remote, cid, 2) for cid in IDS]
    total = np.zeros_like(vectors[0])
    for v in vectors:
        np.add(total, v, out=total)
    if received.bits < 64:
        total &= np.uint64((1 << received.bits) - 1)
    a, count_a = decoder(local, simulated.layout.size)(total, 3)
    b, count_b = decoder(received, remote.layout.size)(total, 3)
    assert np.array_equal(a, b) and count_a == count_b and np.all(np.isfinite(a))


def test_a_task_that_oversteps_its_bounds_is_refused() -> None:
    settings = TrainSettings(sites=3, rounds=1, dataset="ehr", ehr_patients=60, seed=1,
                             broker="inprocess", dp="distributed", epsilon=8.0,
                             sample_rate=1.0)
    simulated, _ = _roles(settings)
    plan_task = round_task(settings, simulated.plan, 1, 3, max_units=1)
    # a sample above max_units keeps max_units of its units (never a refusal)
    assert site_input(simulated.sites[1], simulated.model, plan_task, 1).count == 1
    body = plan_task.to_wire()
    for bad in ({"params": {**body["params"], "dim": 3}}, {"sample_rate": 0},
                {"mode": "central"}, {"seed": "0"}, {"max_units": 0}, {"cohort": True}):
        with pytest.raises(TaskError):
            RoundTask.from_wire({**body, **bad}, simulated.layout.size)
