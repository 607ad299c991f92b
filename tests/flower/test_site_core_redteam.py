"""The red team's findings against the one site core (2026-11-27), each tried again through
the public surface: a malicious Flower server driving real nodes, and the site role."""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp.strategy import FedAvg

from dp.encoding import EncodingParams
from dp.policy import SitePolicy
from fl.codec import EncodingOverflow, FixedPointCodec
from fl.errors import NothingReleased
from fl.flower import DistributedDP, NodeOptions, SecureAggregation, make_secagg_mod
from fl.flower.encoding import dp_params
from fl.flower.setup import RoundSetup, SetupError
from fl.round_reply import round_release
from fl.vector import ArraySpec
from tests.flower import apps
from tests.flower.test_site_core import Trained, _grid, _ledger, _reasons


def test_a_plain_train_message_is_refused_not_trained_on() -> None:
    """Before: the node ran the user's training and returned its raw update, uncharged."""
    grid, trained = _grid(3)
    node = grid.nodes[0]
    content = RecordDict({"arrays": apps.initial_arrays(),
                          "config": ConfigRecord({"server-round": 1})})
    reply = grid.deliver(Message(content, dst_node_id=node, message_type="train",
                                 group_id="1"))
    assert reply.has_error() and "secure aggregation" in reply.error.reason
    assert trained.calls == 0 and _ledger(grid, node) == []
    assert not reply.has_content()  # no update in the reply


class BitsTrick(SecureAggregation):
    """Sums over 2**64 while the DP encoding wraps mod 2**8: per coordinate the sum then
    counts the nodes whose noisy value was negative."""

    def _setup(self, *args: Any, **kwargs: Any) -> RoundSetup | None:
        setup = super()._setup(*args, **kwargs)
        assert setup is not None and setup.dp is not None
        return replace(setup, bits=64, dp=replace(setup.dp, bits=8))


def test_a_dp_modulus_other_than_the_secure_sums_is_refused_before_training() -> None:
    grid, trained = _grid(3)
    wrapper = BitsTrick(FedAvg(fraction_evaluate=0.0, min_available_nodes=3), neighbors=None,
                        privacy=DistributedDP(clip_norm=1.0, noise_multiplier=1.0))
    apps.unreleased(wrapper.start, grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    reasons = _reasons(grid)
    assert reasons and all("modulus" in r for r in reasons), reasons
    assert trained.calls == 0 and all(_ledger(grid, n) == [] for n in grid.nodes)


def test_the_node_is_charged_at_the_replace_one_sensitivity_of_its_one_row() -> None:
    """One patient can move a node's single clipped row from +clip to -clip: the charged
    sensitivity must cover that distance (before: half of it was charged, z 0.707 where the
    release had 0.41, under a floor of 0.6)."""
    params = EncodingParams(dim=16, clip_norm=1.0, scale=64.0, bits=32, noise_stddev=1.0,
                            rotation_seed=3, threshold=3)
    from fl.codec import DistributedCodec

    codec = DistributedCodec(params)
    row = np.full(15, 1.0 / np.sqrt(15))  # norm exactly the clip (the 16th: the count)
    plus = codec.encoder.integer_units(codec.rows(row[None, :])).sum(axis=0)
    minus = codec.encoder.integer_units(codec.rows(-row[None, :])).sum(axis=0)
    moved = float(np.linalg.norm(plus.astype(float) - minus.astype(float)))
    assert moved > params.rounded_l2_bound  # what was charged before
    assert moved <= params.replace_one().rounded_l2_bound  # what is charged now
    setup = _ddp_setup(params)  # and what a real node's ledger is charged with
    release = round_release(setup)(SitePolicy(modes=("distributed",)))
    assert release.params is not None
    assert release.params.rounded_l2_bound == 2 * dp_params(setup).rounded_l2_bound


def _ddp_setup(params: EncodingParams) -> RoundSetup:
    grid, _ = _grid(3)
    captured: list[RoundSetup] = []

    class Capture(SecureAggregation):
        def _setup(self, *args: Any, **kwargs: Any) -> RoundSetup | None:
            setup = super()._setup(*args, **kwargs)
            assert setup is not None
            captured.append(setup)
            return setup

    wrapper = Capture(FedAvg(fraction_evaluate=0.0, min_available_nodes=3), neighbors=None,
                      privacy=DistributedDP(clip_norm=params.clip_norm, noise_multiplier=1.0))
    with contextlib.suppress(NothingReleased):  # refused runs raise
        wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    assert dp_params(captured[0]).clip_norm == params.clip_norm
    return captured[0]


def test_a_noise_floor_is_held_at_the_replace_one_sensitivity() -> None:
    """The red team's round: noise multiplier 1 over 3 nodes, a node floor of 0.6. Its own
    share at the replace-one sensitivity is below the floor: refused, untrained, uncharged."""
    policy = SitePolicy(modes=("distributed",), min_noise_multiplier=0.6)
    grid, trained = _grid(3, make_secagg_mod(NodeOptions(policy=policy)))
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=3),
                                neighbors=None,
                                privacy=DistributedDP(clip_norm=1.0, noise_multiplier=1.0))
    apps.unreleased(wrapper.start, grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    reasons = _reasons(grid)
    assert len(reasons) == 3 and all("noise" in r for r in reasons), reasons
    assert trained.calls == 0


def test_a_shape_whose_size_wraps_int64_is_refused_at_the_setup() -> None:
    spec = ArraySpec("w", (1 << 28, 1 << 28, 1 << 8), "float32")
    assert spec.size == 1 << 64  # np.prod(int64) made it 0
    setup = RoundSetup(7, 1, os.urandom(32), (1, 2, 3), 3, None, 64, "semi-honest", (spec,),
                       (), "num-examples", "none", 24)
    with pytest.raises(SetupError, match="more than"):
        RoundSetup.from_bytes(setup.to_bytes())


def test_an_overflow_refusal_carries_no_value_of_the_update() -> None:
    """A runtime passes refusal texts to the server: the codec's must not quote the site's
    update (before: 'a coordinate of 12.88 does not fit', the node's weighted loss)."""
    codec = FixedPointCodec(4, bits=16, frac_bits=13, max_summands=3)
    with pytest.raises(EncodingOverflow) as caught:
        codec.encode(np.array([0.0, 12.875, 0.0, 0.0]))
    assert "12.8" not in str(caught.value) and "12.9" not in str(caught.value)
    assert "frac_bits" in str(caught.value)


@pytest.mark.parametrize("records", [69, 70, 71, 500])
def test_a_coordinator_bisecting_max_units_learns_nothing_from_the_sites_answer(
        records: int) -> None:
    """Before: a sample above the task's ``max_units`` was refused after the charge, so a
    coordinator bisecting ``max_units`` read a site's patient count (70) in 10 rounds. Now
    a larger sample keeps a random ``max_units`` of its units: the site answers every
    round the same way (an input of the same shape), whatever its count."""
    import torch

    from fl.contribution import RoundTask, site_input

    class Rows:
        def unit_gradients(self, model: Any, **kwargs: Any) -> np.ndarray:
            return np.full((records, 2), 0.5)

    params = EncodingParams(dim=3, clip_norm=1.0, scale=8.0, bits=32, noise_stddev=0.0,
                            rotation_seed=1, threshold=2)
    task = RoundTask(mode="distributed", round=1, cohort=3, seed=0, params=params,
                     max_units=70)
    given = site_input(Rows(), torch.nn.Linear(1, 3, bias=False), task, 1)  # type: ignore[arg-type]
    assert given.vector.shape == (params.encoded_dim,)
    assert given.count == min(records, 70)  # the site's own count, never sent


def test_a_non_finite_unit_is_zeroed_not_refused() -> None:
    """Before: a model that overflows float32 on one record made the site decline after
    the charge (a feature's maximum read to 6e-7 in 26 rounds). A unit with a NaN or an
    infinity now contributes a zero row; the others are encoded as usual."""
    from dp.encoding import IntegerEncoder

    params = EncodingParams(dim=3, clip_norm=1.0, scale=64.0, bits=32, noise_stddev=0.0,
                            rotation_seed=1, threshold=2)
    rows = np.array([[0.5, 0.0, 0.0], [np.inf, 1.0, 0.0], [np.nan, 0.0, 0.0]])
    units = IntegerEncoder(params).integer_units(rows)
    assert units.shape[0] == 3 and not np.any(units[1:]) and np.any(units[0])


_ = Trained  # the counting mod, shared with test_site_core
