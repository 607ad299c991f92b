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
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Any

from dp.budget import GaussianRound, PrivacyBudget, RdpRound
from dp.distributed import calibrate, choose_bits, noise_for_budget, round_rdp
from dp.encoding import EncodingParams
from fl.codec import DistributedCodec

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
    noise_multiplier: float
    sample_rate: float
    steps: int
    clip_norm: float
    mode: str = "site"

    def event(self) -> Event:
        return GaussianRound(self.noise_multiplier, self.sample_rate, self.steps)

    def describe(self) -> str:
        return (f"site DP-SGD: noise multiplier {self.noise_multiplier:.3f}, clip "
                f"{self.clip_norm}, patient sample rate {self.sample_rate}, {self.steps} steps "
                "per round")


@dataclass(frozen=True)
class DistributedPlan:
    params: EncodingParams
    sample_rate: float
    mode: str = "distributed"

    def event(self) -> Event:
        return RdpRound.from_array(round_rdp(self.params, self.sample_rate), "ddg")

    def codec(self, seed: int, round_number: int) -> DistributedCodec:
        """The round's codec; a fresh public rotation per round (KLS 2021, Algorithm 1)."""
        digest = hashlib.sha256(f"fl-rotation|{seed}|{round_number}".encode()).digest()
        rotation = int.from_bytes(digest[:8], "big") >> 1
        return DistributedCodec(replace(self.params, rotation_seed=rotation))

    def describe(self) -> str:
        p = self.params
        z = math.sqrt(p.threshold) * p.noise_stddev / p.clip_norm
        return (f"distributed discrete Gaussian: central noise multiplier {z:.3f} (per-site "
                f"stddev {p.noise_stddev:.4g}, any {p.threshold} sites carry it), clip "
                f"{p.clip_norm}, patient sample rate {self.sample_rate}, {p.bits} bits")


Plan = NoPrivacy | SiteDpPlan | DistributedPlan


def site_plan(*, epsilon: float | None, delta: float, sample_rate: float, steps: int,
              rounds: int, clip_norm: float, noise_multiplier: float | None) -> SiteDpPlan:
    """Smallest noise multiplier whose ``rounds * steps`` steps fit in epsilon (or the given)."""
    from dp.accounting import noise_multiplier_for

    if noise_multiplier is None:
        if epsilon is None:
            raise ValueError("site DP needs --epsilon (or --noise-multiplier)")
        noise_multiplier = noise_multiplier_for(epsilon, delta, sample_rate, rounds * steps)
    return SiteDpPlan(noise_multiplier, sample_rate, steps, clip_norm)


def distributed_plan(*, model_dim: int, epsilon: float | None, delta: float,
                     sample_rate: float, rounds: int, clip_norm: float, num_sites: int,
                     threshold: int, max_units_per_site: int,
                     noise_multiplier: float | None, granularity_bits: int = 12
                     ) -> DistributedPlan:
    """Per-site noise for ``rounds`` rounds within epsilon, and the bits the sum needs.

    ``scale`` puts the clip norm at ``2**granularity_bits`` integer units, fine enough that
    rounding adds little to the sensitivity; ``choose_bits`` then bounds the sum of the
    largest possible site contributions (every patient sampled) so it never wraps.
    """
    scale = 2.0**granularity_bits / clip_norm
    template = EncodingParams(dim=model_dim + 1, clip_norm=clip_norm, scale=scale, bits=64,
                              noise_stddev=0.0, rotation_seed=0, threshold=threshold)
    if noise_multiplier is None:
        if epsilon is None:
            raise ValueError("distributed DP needs --epsilon (or --noise-multiplier)")
        params = noise_for_budget(template, epsilon, delta, sample_rate, rounds)
    else:
        per_site = calibrate(noise_multiplier, clip_norm, num_sites, threshold).per_site_stddev
        params = replace(template, noise_stddev=per_site)
    bits = choose_bits(dim=model_dim + 1, clip_norm=clip_norm, scale=scale,
                       noise_stddev=params.noise_stddev, num_sites=num_sites,
                       units_per_site=max(1, max_units_per_site)).bits
    return DistributedPlan(replace(params, bits=max(bits, 8)), sample_rate)


# --- budget persistence (checkpoints) ------------------------------------------------------
def event_to_json(event: Event) -> dict[str, Any]:
    if isinstance(event, GaussianRound):
        return {"kind": "gaussian", "noise_multiplier": event.noise_multiplier,
                "sample_rate": event.sample_rate, "steps": event.steps}
    return {"kind": "rdp", "label": event.label, "rdp_curve": list(event.rdp_curve)}


def event_from_json(data: dict[str, Any]) -> Event:
    if data["kind"] == "gaussian":
        return GaussianRound(float(data["noise_multiplier"]), float(data["sample_rate"]),
                             int(data["steps"]))
    return RdpRound(tuple(float(x) for x in data["rdp_curve"]), str(data["label"]))


def restore_budget(epsilon: float, delta: float, events: list[dict[str, Any]]) -> PrivacyBudget:
    """A budget with ``events`` already spent (in order), as saved in a checkpoint."""
    budget = PrivacyBudget(epsilon, delta)
    for data in events:
        budget.spend(event_from_json(data))
    return budget
