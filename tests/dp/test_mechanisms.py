"""Integer mechanisms are registered objects (dp.mechanisms): the built-in ones give exactly
the numbers they gave before the registry, and a mechanism registered from a test runs
through the whole public path (round setup, plan, encoding, policy, accountant, audit)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from dp.adaptive_clip import QuantileClipper
from dp.audit import distributed_event, event_json, recompute_epsilon
from dp.budget import PrivacyBudget
from dp.distributed import choose_bits, noise_for_budget, round_epsilon, round_rdp
from dp.encoding import EncodingParams, IntegerEncoder
from dp.errors import PrivacyConfigError
from dp.mechanisms import IntegerMechanism, mechanism, names, register, sample_noise, unregister
from dp.mechanisms.base import I64
from dp.mechanisms.dgauss import DGAUSS
from dp.policy import Proposal, SitePolicy
from dp.randomness import RandomSource, SeededRandom
from dp.site_weights import HistogramRelease


def _outputs(mech: str) -> list[Any]:
    """Every number the public path computes for ``mech``, seeds fixed."""
    out: list[Any] = [sample_noise(mech, 37.5, 300, SeededRandom(7)).tolist()]
    p = EncodingParams(dim=20, clip_norm=1.0, scale=40.0, bits=24, noise_stddev=0.2,
                       rotation_seed=5, mechanism=mech, threshold=3)
    units = np.linspace(-1, 1, 60).reshape(3, 20)
    out.append(IntegerEncoder(p, SeededRandom(3)).encode_units(units, noise=True).tolist())
    b = choose_bits(dim=100, clip_norm=1.0, scale=50.0, noise_stddev=0.3, num_sites=5,
                    mechanism=mech)
    out.append([b.bits, b.max_abs_bound, b.noise_bound])
    out.append(round_rdp(p, 0.1, 3).tolist())
    clip = QuantileClipper(clip_norm=1.0, count_stddev=2.0, threshold=3, bits=24)
    out.append(round_rdp(p, 0.1, 3, clipper=clip).tolist())
    out.append(round_epsilon(p, 0.5, 4, 1e-5))
    for q in (0.1, 1.0):
        e = event_json(distributed_event(p, q, 3, clip))
        out.append(e)
        out.append(recompute_epsilon(e, 1e-5, "zhu-wang"))
    out.append(noise_for_budget(p, 3.0, 1e-5, 0.2, 10).noise_stddev)
    pr = Proposal.distributed(p, sample_rate=0.3, secagg_threshold=3, count_stddev=2.0)
    assert pr.event is not None
    out.append([pr.noise_multiplier, pr.mechanism, event_json(pr.event)])
    small = EncodingParams(dim=4, clip_norm=1.0, scale=1.0, bits=16, noise_stddev=0.3,
                           rotation_seed=1, mechanism=mech)
    out.append(round_rdp(small, 0.5, 1).tolist())
    return out


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=repr).encode()).hexdigest()


# sha256 of _outputs(...) computed by the code before the registry (commit 28d69fa, where
# each module switched on the mechanism's name): the objects must not move a single bit
BEFORE = {
    "dgauss": "faa89f5d3e46342d7e837cb85dcf152f5af7e51817ed1fca1840ddc52d3e6622",
    "skellam": "06018ed1df56227a19d31efba0fffa0b1bf5453cd738d753f8913c35f0acd496",
}
HISTOGRAM_BEFORE = "32cd11ae5fbe165e6ecab707ba59ebfa690475cfcc2a4882a4f7628e4b265526"


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_the_built_in_mechanisms_give_the_numbers_they_gave_before(name: str) -> None:
    assert _digest(_outputs(name)) == BEFORE[name]


def test_the_site_weights_histogram_gives_the_numbers_it_gave_before() -> None:
    event = HistogramRelease(8, 2.0).event()
    assert _digest([list(event.rdp_curve), event_json(event)]) == HISTOGRAM_BEFORE


def test_an_unknown_mechanism_is_refused_by_name_everywhere() -> None:
    assert names() == ("dgauss", "skellam")
    with pytest.raises(PrivacyConfigError, match=r"one of .*'dgauss', 'skellam'.*'laplace'"):
        mechanism("laplace")
    with pytest.raises(PrivacyConfigError, match="laplace"):
        EncodingParams(dim=3, clip_norm=1.0, scale=1.0, bits=16, noise_stddev=1.0,
                       rotation_seed=1, mechanism="laplace")
    with pytest.raises(PrivacyConfigError, match="laplace"):
        SitePolicy(mechanisms=("gaussian", "laplace"))
    with pytest.raises(PrivacyConfigError, match="already registered"):
        register(type(DGAUSS)())  # a second object under a taken name


class Coarse(IntegerMechanism):
    """A test-only mechanism: the discrete Gaussian's noise with twice its RDP and twice its
    tail bound (looser bounds of the same noise, so still true), counting its draws."""

    name = "coarse-dgauss"
    title = "coarse discrete Gaussian (test)"
    min_stddev = 0.5

    def __init__(self) -> None:
        self.draws = 0

    def sample(self, variance: float, n: int, source: RandomSource | None = None) -> I64:
        self.draws += n
        return DGAUSS.sample(variance, n, source)

    def tail_bound(self, variance: float, log_term: float) -> float:
        return 2 * DGAUSS.tail_bound(variance, log_term)

    def rdp_fn(self, l2: float, l1: float, sigma: float, threshold: int, dim: int
               ) -> Callable[[int], float]:
        fn = DGAUSS.rdp_fn(l2, l1, sigma, threshold, dim)
        return lambda a: 2 * fn(a)

    def zcdp(self, l2: float, l1: float, sigma: float, threshold: int, dim: int
             ) -> tuple[float, float]:
        rho, xi = DGAUSS.zcdp(l2, l1, sigma, threshold, dim)
        return 2 * rho, 2 * xi


@pytest.fixture
def coarse() -> Iterator[Coarse]:
    mech = Coarse()
    register(mech)
    yield mech
    unregister(mech.name)


def test_a_mechanism_registered_from_a_test_runs_through_the_public_path(coarse: Coarse
                                                                         ) -> None:
    fl = pytest.importorskip("fl.round_setup")
    fl_plan = pytest.importorskip("fl.round_plan")
    fl_reply = pytest.importorskip("fl.round_reply")
    from fl.plan.privacy import mechanism_of
    from fl.vector import ArraySpec

    setup = fl_plan.fixed_setup(
        run_id=1, server_round=1, roster=[11, 12, 13, 14], arrays=(ArraySpec("w", (6,),
                                                                             "float64"),),
        metrics=(), weight_key="n", neighbors=None, threshold=None, dropout_rate=0.1,
        corrupt_rate=0.1, security="semi-honest", bits=64, frac_bits=24, verify_keys={})

    def plan(name: str) -> Any:
        privacy = fl_plan.DistributedDP(clip_norm=1.0, epsilon=4.0, delta=1e-5, rounds=3,
                                   mechanism=name)
        return fl_plan.round_plan(privacy, setup, {})

    ours, theirs = plan(coarse.name), plan("dgauss")
    assert ours.params.mechanism == coarse.name
    assert mechanism_of(ours) == "coarse discrete Gaussian (test) (secure sum)"
    # twice the RDP: the budget needs more noise, and the doubled tail at least as many bits
    assert ours.params.noise_stddev > 1.2 * theirs.params.noise_stddev
    assert ours.params.bits >= theirs.params.bits
    # the round setup carries it over the wire and the node encodes with its sampler
    received = fl.RoundSetup.from_bytes(fl_plan.with_distributed_dp(setup, ours, b"t").to_bytes())
    assert received.dp is not None and received.dp.mechanism == coarse.name
    sent = np.zeros(6)
    reply = fl_reply.encode_reply(received, np.full(6, 0.1), {}, 1.0, sent)
    params = fl.dp_params(received)
    assert reply.shape == (params.encoded_dim,) and coarse.draws >= params.encoded_dim
    # the accountant: its own RDP (twice the discrete Gaussian's at q = 1), in the budget
    same = EncodingParams(**{**{k: getattr(params, k) for k in (
        "dim", "clip_norm", "scale", "bits", "noise_stddev", "rotation_seed", "beta",
        "threshold")}, "mechanism": "dgauss"})
    np.testing.assert_array_equal(round_rdp(params, 1.0, 2), 2 * round_rdp(same, 1.0, 2))
    proposal = Proposal.distributed(params, sample_rate=1.0, secagg_threshold=4)
    SitePolicy(min_threshold=1, round_epsilon=None, epsilon=None).check(proposal)
    assert proposal.event is not None
    spent, _ = PrivacyBudget(100.0, 1e-5).spend(proposal.event)
    assert spent == pytest.approx(round_epsilon(params, 1.0, 1, 1e-5))
    # the audit export describes it by its own zCDP, which recomputes to a finite epsilon
    step = event_json(proposal.event)["event"]
    rho, xi = DGAUSS.zcdp(params.rounded_l2_bound, params.rounded_l1_bound,
                          params.scale * params.noise_stddev, params.threshold,
                          params.encoded_dim)
    assert (step["rho"], step["xi"]) == (2 * rho, 2 * xi)
    assert math.isfinite(recompute_epsilon(event_json(proposal.event), 1e-5, "zhu-wang"))
    # once it is gone, the same setup is refused by name
    unregister(coarse.name)
    with pytest.raises(fl.SetupError, match="'mechanism' must be one of"):
        fl.RoundSetup.from_bytes(fl_plan.with_distributed_dp(setup, ours, b"t").to_bytes())
