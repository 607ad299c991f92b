"""Per-round privacy plans: what a round costs on the budget and how sites encode.

A plan is fixed before training (docs/architecture.md section 6): the coordinator asks the budget
whether the next round's event fits, runs the round only if it does, and spends the event
only once an aggregate was released (a round that aborts releases nothing).

* :class:`NoPrivacy`: weighted FedAvg, no event.
* :class:`SiteDpPlan`: each site runs ``steps`` DP-SGD steps (Opacus) with noise multiplier
  ``z``; every site's release is private on its own and sites hold disjoint patients, so a
  patient's epsilon is that of one site's ``steps`` sampled-Gaussian steps per round.
* :class:`DistributedPlan`: one noisy sum of clipped per-patient gradients per round; the
  event is the distributed discrete Gaussian RDP of ``dp.distributed.round_rdp``. Per-site
  noise is calibrated to the secagg threshold, so dropouts never lower it.

Also the federation's budget (:func:`make_budget`, :func:`restore_budget`), the plan report
(:func:`schedule`) and the audit trail's lines (:func:`release_record`). The one module of
:mod:`fl.plan` that code a site runs loads (the round's task, :mod:`fl.contribution`, reads
its plans; so does the Flower and NVFlare servers' :mod:`fl.round_plan`): it imports nothing
of the coordinator.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dp import (
    MODE_SITE,
    EncodingParams,
    GaussianRound,
    PrivacyBudget,
    QuantileClipper,
    RdpRound,
    adaptive_clip_update_noise,
    calibrate,
    choose_bits,
    distributed_event,
    effective_noise_multiplier,
    event_from_json,
    event_json,
    mechanisms,
    noise_for_budget,
    noise_multiplier_for,
    rdp_to_epsilon,
)
from fl.codec import DistributedCodec
from fl.modes import counted_count_stddev

Event = GaussianRound | RdpRound


@dataclass(frozen=True)
class NoPrivacy:
    mode: str = "none"

    def event(self) -> Event | None:
        return None

    def describe(self) -> str:
        return "no differential privacy (secure aggregation only)"


@dataclass(frozen=True)
class SiteDpPlan:
    """``noise_multiplier`` is the update's; with adaptive clipping (``count_stddev`` set) the
    step's effective multiplier (update and count together) is lower (Andrew et al. Thm. 1)."""

    noise_multiplier: float
    sample_rate: float
    steps: int
    clip_norm: float
    mode: str = "site"
    count_stddev: float | None = None
    target_quantile: float | None = None

    def event(self) -> GaussianRound:
        return GaussianRound(self.noise_multiplier, self.sample_rate, self.steps,
                             self.count_stddev)

    def describe(self) -> str:
        z = self.event().effective_noise_multiplier
        adaptive = ("" if self.count_stddev is None else
                    f", adaptive clipping to the {self.target_quantile:g} quantile (count "
                    f"noise {self.count_stddev:g}; effective noise multiplier {z:.3f})")
        return (f"site DP-SGD (sampled Gaussian): noise multiplier "
                f"{self.noise_multiplier:.3f}, clip {self.clip_norm}, patient sample rate "
                f"{self.sample_rate}, {self.steps} steps per round{adaptive}")


@dataclass(frozen=True)
class DistributedPlan:
    """One noisy secure sum per round. ``params.clip_norm`` is the encoding's clip: the
    rows' clip :attr:`clip_norm` times ``max_weight`` (heterogeneity-aware site weights,
    :mod:`dp.site_weights`; 1 without them), so the noise is that of the largest weighted
    row. With ``target_quantile`` every round also releases the private adaptive-clipping
    count (:class:`dp.adaptive_clip.QuantileClipper`, noise ``count_stddev``) in the same
    secure sum, accounted jointly with the update (:func:`dp.distributed.round_rdp`)."""

    params: EncodingParams
    sample_rate: float
    mode: str = "distributed"
    target_quantile: float | None = None
    count_stddev: float | None = None
    max_weight: float = 1.0
    charged: Callable[[EncodingParams], EncodingParams] | None = field(
        default=None, compare=False, repr=False)
    """The encoding as each site's ledger charges it, when that is not :attr:`params`
    (:func:`distributed_plan`'s ``charged``: e.g. its own noise share only, when the roster
    is the coordinator's word); :meth:`event` is then that charge."""

    @property
    def clip_norm(self) -> float:
        """The rows' clip before weighting (the initial one, under adaptive clipping)."""
        return self.params.clip_norm / self.max_weight

    def clipper(self, clip_norm: float | None = None) -> QuantileClipper | None:
        """The adaptive clip's state at ``clip_norm`` (default the plan's), or None."""
        if self.target_quantile is None or self.count_stddev is None:
            return None
        return QuantileClipper(clip_norm=clip_norm or self.clip_norm,
                               target_quantile=self.target_quantile,
                               count_stddev=self.count_stddev,
                               threshold=self.params.threshold, bits=self.params.bits)

    @property
    def counted(self) -> EncodingParams:
        """The encoding as the budget is spent on it (:attr:`charged`)."""
        return self.params if self.charged is None else self.charged(self.params)

    def event(self) -> Event:
        counted = self.counted
        return distributed_event(counted, self.sample_rate,
                                 clipper=counted_clipper(self.clipper(), counted))

    def at_clip(self, clip_norm: float) -> EncodingParams:
        """The encoding for rows clipped to ``clip_norm``: clip, scale and noise move
        together, so the integer-domain sensitivity, noise and modulus (hence the round's
        privacy cost) are the planned ones whatever the adaptive clip becomes."""
        ratio = clip_norm / self.clip_norm
        p = self.params
        return replace(p, clip_norm=p.clip_norm * ratio, scale=p.scale / ratio,
                       noise_stddev=p.noise_stddev * ratio)

    def codec(self, seed: int, round_number: int, clip_norm: float | None = None
              ) -> DistributedCodec:
        """The round's codec; a fresh public rotation per round (KLS 2021, Algorithm 1)."""
        digest = hashlib.sha256(f"fl-rotation|{seed}|{round_number}".encode()).digest()
        rotation = int.from_bytes(digest[:8], "big") >> 1
        params = self.params if clip_norm is None else self.at_clip(clip_norm)
        return DistributedCodec(replace(params, rotation_seed=rotation),
                                max_weight=self.max_weight)

    def describe(self) -> str:
        p = self.params
        z = math.sqrt(p.threshold) * p.noise_stddev / p.clip_norm
        extra = ""
        if self.max_weight != 1.0:
            extra += (f", site weights up to {self.max_weight:g} (noise calibrated to "
                      f"{self.max_weight:g} x clip)")
        if self.target_quantile is not None:
            extra += (f", adaptive clipping to the {self.target_quantile:g} quantile (count "
                      f"noise {self.count_stddev:.4g}, accounted jointly)")
        counted = self.counted.threshold
        if counted != p.threshold:
            extra += ("; epsilon as each site's ledger counts it: "
                      + ("its own noise share only (the roster is the coordinator's word; "
                         "sites that know each other's keys, --peer-keys, count every share)"
                         if counted == 1 else f"{counted} shares of the noise"))
        return (f"distributed discrete Gaussian (secure sum): central noise multiplier {z:.3f} "
                f"(per-site "
                f"stddev {p.noise_stddev:.4g}, any {p.threshold} sites carry it), clip "
                f"{self.clip_norm:g}, patient sample rate {self.sample_rate}, {p.bits} bits"
                + extra)


Plan = NoPrivacy | SiteDpPlan | DistributedPlan

#: The public bound on the units (patients) one site sums in a distributed round when the
#: federation gives none (``--max-units``): the modulus is sized for it, never for a site's
#: real patient count (``bits`` is published). A site that samples more refuses the round.
DEFAULT_MAX_UNITS = 100_000


def site_plan(*, epsilon: float | None, delta: float, sample_rate: float, steps: int,
              rounds: int, clip_norm: float, noise_multiplier: float | None,
              accountant: str = "rdp", target_quantile: float | None = None,
              count_stddev: float | None = None, prior: Sequence[Event] = ()) -> SiteDpPlan:
    """Smallest noise multiplier whose ``rounds * steps`` steps fit in epsilon (or the given).

    With adaptive clipping (``target_quantile``) that multiplier is the *effective* one of
    update and count together; the update gets ``adaptive_clip_update_noise`` of it.
    ``prior``: releases made before the rounds (the noised feature statistics), which the
    rounds' epsilon composes with.
    """
    if noise_multiplier is None:
        if epsilon is None:
            raise ValueError("site DP needs --epsilon (or --noise-multiplier)")
        noise_multiplier = noise_multiplier_for(epsilon, delta, sample_rate, rounds * steps,
                                                accountant, _prior_rdp(prior))
    if target_quantile is None:
        return SiteDpPlan(noise_multiplier, sample_rate, steps, clip_norm)
    sigma_b = count_stddev if count_stddev is not None else 10.0 * noise_multiplier
    update = adaptive_clip_update_noise(noise_multiplier, sigma_b)
    return SiteDpPlan(update, sample_rate, steps, clip_norm, count_stddev=sigma_b,
                      target_quantile=target_quantile)


def distributed_plan(*, model_dim: int, epsilon: float | None, delta: float,
                     sample_rate: float, rounds: int, clip_norm: float, num_sites: int,
                     threshold: int, max_units_per_site: int,
                     noise_multiplier: float | None, granularity_bits: int = 12,
                     prior: Sequence[Event] = (), target_quantile: float | None = None,
                     count_stddev: float | None = None, max_weight: float = 1.0,
                     charged: Callable[[EncodingParams], EncodingParams] | None = None,
                     mechanism: str = "dgauss") -> DistributedPlan:
    """Per-site noise for ``rounds`` rounds within epsilon, and the bits the sum needs.

    ``scale`` puts the encoding's clip at ``2**granularity_bits`` integer units, fine enough
    that rounding adds little to the sensitivity; ``choose_bits`` then bounds the sum of the
    largest possible site contributions (every patient sampled) so it never wraps.
    ``max_weight``: the encoding's clip is ``max_weight * clip_norm`` (site weights).
    ``mechanism``: the integer noise's name in :mod:`dp.mechanisms`.
    ``target_quantile``: private adaptive clipping; the rounds' noise is calibrated with its
    count accounted jointly. ``count_stddev`` defaults to 10 times the central noise
    multiplier the rounds would need without the count (the count then costs about 1/400 of
    a round, as in site mode). ``charged``: the encoding as the budget is spent on it, when
    that is not the encoding itself (a Flower or NVFlare node charges its one row at the
    replace-one sensitivity, and its own noise share only without an authenticated roster:
    :func:`fl.round_reply.charged_params`); the noise is the least whose ``rounds`` fit
    ``epsilon`` as charged.
    """
    as_charged = charged or (lambda params: params)
    encoding_clip = max_weight * clip_norm
    scale = 2.0**granularity_bits / encoding_clip
    template = EncodingParams(dim=model_dim + 1, clip_norm=encoding_clip, scale=scale,
                              bits=64, noise_stddev=0.0, rotation_seed=0, threshold=threshold,
                              mechanism=mechanism)
    if noise_multiplier is None:
        if epsilon is None:
            raise ValueError("distributed DP needs --epsilon (or --noise-multiplier)")
        params = replace(template, noise_stddev=noise_for_budget(
            as_charged(template), epsilon, delta, sample_rate, rounds,
            _prior_rdp(prior)).noise_stddev)
    else:
        per_site = calibrate(noise_multiplier, encoding_clip, num_sites,
                             threshold).per_site_stddev
        params = replace(template, noise_stddev=per_site)
    if target_quantile is not None:
        if count_stddev is None:
            count_stddev = 10.0 * effective_noise_multiplier(params)
        if noise_multiplier is None:  # the rounds and their counts fit epsilon together
            clipper = QuantileClipper(clip_norm=clip_norm, target_quantile=target_quantile,
                                      count_stddev=count_stddev, threshold=threshold)
            params = replace(template, noise_stddev=noise_for_budget(
                as_charged(template), epsilon or 0.0, delta, sample_rate, rounds,
                _prior_rdp(prior), clipper=counted_clipper(
                    clipper, as_charged(template))).noise_stddev)
    bits = choose_bits(dim=model_dim + 1, clip_norm=encoding_clip, scale=scale,
                       noise_stddev=params.noise_stddev, num_sites=num_sites,
                       units_per_site=max(1, max_units_per_site), mechanism=mechanism).bits
    return DistributedPlan(replace(params, bits=max(bits, 8)), sample_rate,
                           target_quantile=target_quantile, count_stddev=count_stddev,
                           max_weight=max_weight, charged=charged)


def counted_clipper(clipper: QuantileClipper | None, counted: EncodingParams
                    ) -> QuantileClipper | None:
    """``clipper`` as the budget counts its clip count's noise beside the update's
    ``counted`` encoding: as many of the equal shares as the update's noise
    (:func:`fl.modes.counted_count_stddev`)."""
    if clipper is None or counted.threshold == clipper.threshold:
        return clipper
    return replace(clipper, threshold=counted.threshold, count_stddev=counted_count_stddev(
        clipper.count_stddev, clipper.threshold, counted.threshold))


def _prior_rdp(prior: Sequence[Event]) -> Any:
    """The RDP curve of releases made before the rounds (None: there are none)."""
    return sum((e.rdp() for e in prior[1:]), prior[0].rdp()) if prior else None


# --- budget persistence (checkpoints) ------------------------------------------------------
def restore_budget(epsilon: float | None, delta: float, events: list[dict[str, Any]],
                   accountant: str = "rdp") -> PrivacyBudget:
    """A budget with ``events`` already spent (in order), as saved in a checkpoint."""
    budget = make_budget(epsilon, delta, accountant)
    for data in events:
        budget.spend(event_from_json(data))
    return budget


def make_budget(epsilon: float | None, delta: float, accountant: str = "rdp") -> PrivacyBudget:
    """The run's budget; without ``epsilon`` (a fixed noise multiplier) it has no cap but
    still accounts, so every round reports its epsilon."""
    return PrivacyBudget(sys.float_info.max if epsilon is None else epsilon, delta, accountant)


# --- the privacy plan: what a run will release, computed by the code the run uses -----------
def mechanism_of(plan: Plan) -> str:
    if isinstance(plan, SiteDpPlan):
        return "sampled Gaussian (Opacus DP-SGD at each site)" + (
            " with adaptive clipping" if plan.count_stddev is not None else "")
    if isinstance(plan, DistributedPlan):
        return f"{mechanisms.mechanism(plan.params.mechanism).title} (secure sum)"
    return "none: exact secure sum"


def schedule(plan: Plan, *, rounds: int, epsilon: float | None, delta: float,
             accountant: str = "rdp", threshold: int, max_affordable: int = 100_000,
             prior: Sequence[Event] = ()) -> dict[str, Any]:
    """The privacy plan of a run: the budget the coordinator keeps (:func:`make_budget`),
    spent round by round with the plan's event exactly as :class:`fl.coordinator.Coordinator`
    does, until ``rounds`` or the budget stops it. ``prior``: releases before the first
    round (the noised feature statistics, :mod:`fl.plan.scaler`), spent first as the run
    spends them. ``secagg train --plan`` prints it; the run follows it
    (tests/fl/test_site_policy.py)."""
    out: dict[str, Any] = {"mode": plan.mode, "mechanism": mechanism_of(plan),
                           "accountant": accountant, "delta": delta, "epsilon_budget": epsilon,
                           "secagg_threshold": threshold, "rounds_requested": rounds}
    event = plan.event()
    if isinstance(plan, SiteDpPlan):
        out.update(noise_multiplier=plan.noise_multiplier, sample_rate=plan.sample_rate,
                   steps_per_round=plan.steps, clip_norm=plan.clip_norm,
                   effective_noise_multiplier=plan.event().effective_noise_multiplier,
                   count_stddev=plan.count_stddev, noise_added_by="each site, every step")
    elif isinstance(plan, DistributedPlan):
        p = plan.params
        out.update(noise_multiplier=effective_noise_multiplier(p),
                   counted_noise_multiplier=effective_noise_multiplier(plan.counted),
                   per_site_noise_stddev=p.noise_stddev, calibration_threshold=p.threshold,
                   sample_rate=plan.sample_rate, steps_per_round=1, clip_norm=plan.clip_norm,
                   bits=p.bits, scale=p.scale, noise_added_by="each site, a share",
                   max_site_weight=plan.max_weight, adaptive_clip=plan.target_quantile,
                   count_stddev=plan.count_stddev)
    if event is None:
        out.update(rounds_run=rounds, rounds_affordable=None, epsilon_after=[None] * rounds,
                   epsilon_final=None)
        return out
    budget = make_budget(epsilon, delta, accountant)
    for release in prior:
        budget.spend(release)
    out["epsilon_before_rounds"] = budget.spent[0]
    after: list[float] = []
    while len(after) < rounds and budget.can_run(event):
        after.append(budget.spend(event)[0])
    out.update(rounds_run=len(after), epsilon_after=after,
               epsilon_final=after[-1] if after else 0.0,
               rounds_affordable=_affordable(event, epsilon, delta, accountant, len(after),
                                             rounds, max_affordable, prior))
    return out


def _affordable(event: Event, epsilon: float | None, delta: float, accountant: str,
                run: int, rounds: int, cap: int, prior: Sequence[Event] = ()) -> int | None:
    """Rounds the budget affords in all (None: no epsilon budget, or more than ``cap``)."""
    if epsilon is None:
        return None
    if run < rounds:
        return run
    if accountant != "rdp":
        return None if run >= cap else run

    before = sum((e.rdp() for e in prior), start=0.0 * event.rdp())

    def fits(r: int) -> bool:
        return rdp_to_epsilon(before + event.rdp() * r, delta) <= epsilon

    lo, hi = run, max(run * 2, 1)
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    if hi > cap:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def release_record(plan: Plan, round_number: int, included: list[int], event: Event | None,
                   epsilon_before: float | None, epsilon_after: float | None,
                   attempts: int) -> dict[str, Any]:
    """One line of the audit trail: what was released, to whom, how, and at what cost."""
    record: dict[str, Any] = {
        "round": round_number, "to": "the coordinator (and whoever it shares the model with)",
        "what": ("the sum over the included sites of their updates and unit counts"
                 if plan.mode != MODE_SITE else
                 "the sum of the included sites' DP-SGD model updates and the number of sites"),
        "included": included, "mode": plan.mode, "mechanism": mechanism_of(plan),
        "attempts": attempts}
    if isinstance(plan, SiteDpPlan):
        record.update(noise_multiplier=plan.noise_multiplier, sample_rate=plan.sample_rate,
                      steps=plan.steps, count_stddev=plan.count_stddev)
    elif isinstance(plan, DistributedPlan):
        record.update(per_site_noise_stddev=plan.params.noise_stddev,
                      calibration_threshold=plan.params.threshold,
                      sample_rate=plan.sample_rate, count_stddev=plan.count_stddev,
                      max_site_weight=plan.max_weight)
    if event is not None and epsilon_after is not None:
        record.update(epsilon_charged=epsilon_after - (epsilon_before or 0.0),
                      epsilon_after=epsilon_after, dp_event=event_json(event))
    return record
