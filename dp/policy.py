"""The site's own privacy policy (docs/architecture.md section 9: the site is
sovereign over its privacy; docs/privacy.md section 1).

The coordinator *proposes* each release (a training round, or feature statistics); the site
checks the proposal against the :class:`SitePolicy` its operator set (flags or a policy file,
never the coordinator) and against its :class:`dp.ledger.Ledger`, and refuses with
:class:`PolicyRefused` naming the rule that would break. The site computes the privacy cost
itself from the proposed parameters (:class:`Proposal` builds the event; nothing the
coordinator says about epsilon is believed).

The ledger that records and caps what the policy admits is :mod:`dp.ledger`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from dp.budget import Event, GaussianRound
from dp.errors import PrivacyConfigError, PrivacyError
from dp.mechanisms import names as integer_mechanisms

MODE_NONE = "none"
"""The privacy mode of an exact sum (no DP; a site's operator opts in)."""
MODE_SITE = "site"
"""The privacy mode of DP-SGD at each site (the site role only)."""
MODE_DISTRIBUTED = "distributed"
"""The privacy mode of distributed DP: each site adds its share of integer noise."""
MODES = (MODE_NONE, MODE_SITE, MODE_DISTRIBUTED)
"""The privacy modes of a release, the one vocabulary of every round description (the site
role's :class:`fl.contribution.RoundTask`, the runtimes' :class:`fl.round_setup.RoundSetup`),
of site policies and of ``--dp``: an exact sum, DP-SGD at each site, distributed DP."""
GAUSSIAN = "gaussian"
"""Site mode's mechanism: the sampled Gaussian of DP-SGD (Opacus)."""
UNITS = ("patient", "record", "patient-idp")
"""The privacy units a site's policy can name: whose data one unit of sensitivity
covers (``patient-idp``: the patient, by individual per-record sampling rates per rate group,
:mod:`dp.idp`; accounted per group)."""
DEFAULT_MIN_NOISE_MULTIPLIER = 0.5
"""The noise floor of a site nobody configured: the Gaussian-equivalent noise standard
deviation over the release's sensitivity (the clip, or twice it for a replace-one release)
that every release must carry at least."""
DEFAULT_ROUND_EPSILON = 4.0
"""The most one release (a round, or the noised feature statistics) may cost a site nobody
configured, at its ``delta`` (RDP, the ledger's accountant)."""
DEFAULT_EPSILON = 10.0
"""The total budget per patient of a site nobody configured (every release composed)."""
OPT_IN = ("secagg-dp='none' in the Flower node config, \"modes\": [\"none\"] in the "
          "NVFlare site's policy.json, or --dp none on secagg train --role site")
"""How a site's operator opts in to exact sums, in every runtime (named by every
``[exact-release]`` refusal)."""


def all_mechanisms() -> tuple[str, ...]:
    """Every mechanism a policy can name: site mode's Gaussian and the registered integer
    mechanisms of distributed mode (:mod:`dp.mechanisms`)."""
    return (GAUSSIAN, *integer_mechanisms())


FIXES = {
    "exact-release": f"the round asks for an exact sum; the sites' operators opt in with "
                     f"{OPT_IN}, or the server runs distributed DP",
    "modes": "the round's privacy mode is not among the sites' policy modes",
    "min_noise_multiplier": "raise the noise (a larger noise_multiplier, or a smaller "
                            "epsilon per round; without the sites' keys each site counts "
                            "only its own noise share)",
    "round_epsilon": "one round costs more than the sites' cap per release: raise the "
                     "noise, lower the sample rate, or run more rounds at a smaller epsilon "
                     "each",
    "budget": "the sites' privacy budgets are spent; their operators decide whether to "
              "raise them",
    "min_threshold": "raise the secure-aggregation threshold (and the noise calibration) "
                     "to the sites' min_threshold",
    "unit": "compute the release per the sites' privacy unit",
    "min_dropout_rate": "derive the secure-aggregation graph for at least the sites' "
                        "dropout and corrupt rates (their refusal names the safe pair)",
    "min_corrupt_rate": "raise the secure-aggregation threshold above the corrupt parties "
                        "the sites assume",
    "max_releases": "the sites took part in their maximum number of releases",
}
"""The fix a server names for each policy rule its sites refused on (one place; every
runtime's server side uses :func:`refusal_summary`)."""


def refusal_rule(reason: str) -> str | None:
    """The rule a site's refusal text names (``refused by site policy [rule]``), if any."""
    mark = "refused by site policy ["
    start = reason.find(mark)
    if start < 0:
        return None
    end = reason.find("]", start + len(mark))
    return reason[start + len(mark):end] if end > 0 else None


def refusal_summary(reasons: list[str], sites: int) -> str | None:
    """One line for a server's log: which policy rules how many of ``sites`` refused on,
    and the fix (None when no refusal names a policy rule)."""
    counts: dict[str, int] = {}
    for reason in reasons:
        rule = refusal_rule(reason)
        if rule is not None:
            counts[rule] = counts.get(rule, 0) + 1
    if not counts:
        return None
    rule = max(counts, key=lambda r: counts[r])
    rules = ", ".join(f"[{r}] {n}" for r, n in sorted(counts.items(), key=lambda x: -x[1]))
    return (f"{sum(counts.values())} of {sites} sites refused by their site policy ({rules}); "
            f"fix: {FIXES.get(rule, 'see the sites own logs')}")


class PolicyRefused(PrivacyError):
    """A proposed release breaks the site's policy; ``rule`` names the rule (a
    :class:`SitePolicy` field name such as ``"unit"``, ``"budget"`` or
    ``"exact-release"``)."""

    def __init__(self, rule: str, message: str, *, private: bool = False) -> None:
        super().__init__(f"refused by site policy [{rule}]: {message}")
        self.rule = rule
        self.public = (f"refused by site policy [{rule}]: the site's own plan for this "
                       "proposal breaks the rule (details in the site's log)"
                       if private else str(self))
        """What the site tells the coordinator: without the numbers when they come from
        the site's private plan (``unit="patient-idp"``: its rate groups depend on its
        patients' records and budgets)."""


@dataclass(frozen=True)
class Proposal:
    """One release a coordinator asks the site to take part in, as the site sees it.

    ``noise_multiplier`` is the Gaussian-equivalent central noise multiplier (noise stddev
    over the unit's sensitivity) that any ``calibration_threshold`` summed sites carry;
    ``secagg_threshold`` is the fewest sites the secure sum can be decoded from; ``unit``:
    the privacy unit the release is computed over (one unit's data is clipped together).
    """

    kind: str
    mode: str
    mechanism: str | None
    noise_multiplier: float
    sample_rate: float
    steps: int
    clip_norm: float | None
    calibration_threshold: int | None
    secagg_threshold: int
    event: Event | None
    label: str = ""
    unit: str = "patient"
    groups: tuple[tuple[str, float, Event], ...] = ()
    """``unit="patient-idp"``: ``(group key, target epsilon, event)`` per rate group of the
    site's plan (each group's patients' cost; ``event`` is then None)."""
    patients: str = ""
    """``unit="patient-idp"``: which patient is in which group
    (:meth:`dp.idp.PatientGroups.digest`)."""
    requested_noise_multiplier: float | None = None
    """Set when ``noise_multiplier`` is the site's own share only (the coordinator alone
    named the roster, :func:`fl.site.core.lone_share`): the multiplier the round asked for,
    which refusals quote beside the share."""

    @classmethod
    def site_idp(cls, plan: Any, *, steps: int, secagg_threshold: int, label: str = "",
                 patients: str = "") -> Proposal:
        """Site mode under ``--unit patient-idp``: ``steps`` steps of the *site's own*
        :class:`dp.idp.IdpPlan` (its rate groups from its own table, grouped as
        ``patients`` says); every group is charged its own event
        (:meth:`dp.idp.IdpPlan.group_events`)."""
        events = plan.group_events(steps) if steps >= 1 else []
        groups = tuple((g.key, g.target_epsilon, e)
                       for g, e in zip(plan.groups, events, strict=True))
        return cls("train", MODE_SITE, GAUSSIAN, plan.noise_multiplier,
                   max(g.sample_rate for g in plan.groups), steps,
                   max(g.clip_norm for g in plan.groups), None, secagg_threshold, None, label,
                   "patient-idp", groups, patients)

    @classmethod
    def site_dp(cls, *, noise_multiplier: float, sample_rate: float, steps: int,
                clip_norm: float, secagg_threshold: int, count_stddev: float | None = None,
                label: str = "", unit: str = "patient") -> Proposal:
        """Site mode: ``steps`` DP-SGD steps at the site (optionally adaptive clipping)."""
        event = None
        z = noise_multiplier
        if z > 0 and 0 < sample_rate <= 1 and steps >= 1:
            event = GaussianRound(z, sample_rate, steps, count_stddev)
            z = event.effective_noise_multiplier
        return cls("train", MODE_SITE, GAUSSIAN, z, sample_rate, steps, clip_norm, None,
                   secagg_threshold, event, label, unit)

    @classmethod
    def distributed(cls, params: Any, *, sample_rate: float, secagg_threshold: int,
                    label: str = "", kind: str = "train", unit: str = "patient",
                    count_stddev: float | None = None) -> Proposal:
        """Distributed mode: one noisy secure sum of ``params`` (:class:`EncodingParams`);
        ``kind="scaler"``: the noised feature statistics (fl/site/private_scaler.py);
        ``count_stddev``: the round also releases the adaptive-clipping count in the same
        sum (charged jointly with the update, :func:`dp.distributed.round_rdp`)."""
        from dp.adaptive_clip import QuantileClipper
        from dp.audit import distributed_event
        from dp.distributed import effective_noise_multiplier

        z = effective_noise_multiplier(params) if params.noise_stddev > 0 else 0.0
        clipper = None if count_stddev is None else QuantileClipper(
            clip_norm=params.clip_norm, count_stddev=count_stddev,
            threshold=params.threshold, bits=params.bits)
        event = (distributed_event(params, sample_rate, clipper=clipper)
                 if 0 < sample_rate <= 1 else None)
        return cls(kind, MODE_DISTRIBUTED, params.mechanism, z, sample_rate, 1,
                   params.clip_norm, params.threshold, secagg_threshold, event, label, unit)

    @classmethod
    def exact(cls, kind: str, *, secagg_threshold: int, label: str = "") -> Proposal:
        """An exact (un-noised) secure sum: a ``--dp none`` round, or feature statistics."""
        return cls(kind, MODE_NONE, None, 0.0, 1.0, 1, None, None, secagg_threshold, None, label)


@dataclass(frozen=True)
class SitePolicy:
    """What this site agrees to release, set by its operator.

    ``modes`` lists the privacy modes the site takes part in. ``"none"`` (an exact sum: a
    ``--dp none`` round, exact feature statistics) is an explicit opt-in of the operator
    (``--dp none`` on the site role, or a policy file listing it): the default policy
    releases nothing exact.
    ``unit``: the privacy unit the operator's budget is about (``patient``, the package's
    default, or ``record``); a release computed over another unit is refused, since with
    ``record`` one patient's k records add up to k times the sensitivity.
    ``min_noise_multiplier``: the Gaussian-equivalent noise multiplier floor;
    ``min_threshold``: the fewest sites the noise is calibrated to and the secure sum can be
    decoded from; ``max_sample_rate``, ``max_steps`` (DP-SGD steps per release),
    ``max_clip_norm``, ``max_releases`` (releases the ledger will ever record);
    ``epsilon``/``delta``: this site's budget per patient (``epsilon=None``: no cap, still
    accounted and reported); ``round_epsilon``: the most one release may cost at ``delta``
    (``None``: no cap per release).

    **Defaults are a guarantee** (docs/privacy.md section 1, "A site nobody configured"):
    ``SitePolicy()`` takes part in DP releases only, each with a noise multiplier of at least
    :data:`DEFAULT_MIN_NOISE_MULTIPLIER`, costing at most :data:`DEFAULT_ROUND_EPSILON`, and
    at most :data:`DEFAULT_EPSILON` in total at ``delta`` 1e-5 per patient. A policy an
    app or job supplies only tightens the operator's (:meth:`tighten`).
    ``min_dropout_rate``, ``min_corrupt_rate``: the dropout and corrupt-party rates this site
    assumes at least, whatever a coordinator states; the secure-aggregation graph and
    threshold it accepts are checked against them (Bell et al. 2020 for SecAgg+, the corrupt
    parties on the complete graph; :meth:`fl.site.core.SiteCore.check_protocol`).
    """

    modes: tuple[str, ...] = (MODE_SITE, MODE_DISTRIBUTED)
    mechanisms: tuple[str, ...] = field(default_factory=all_mechanisms)
    min_noise_multiplier: float = DEFAULT_MIN_NOISE_MULTIPLIER
    min_threshold: int = 2
    max_sample_rate: float = 1.0
    max_steps: int | None = None
    max_clip_norm: float | None = None
    max_releases: int | None = None
    epsilon: float | None = DEFAULT_EPSILON
    delta: float = 1e-5
    unit: str = "patient"
    round_epsilon: float | None = DEFAULT_ROUND_EPSILON
    min_dropout_rate: float = 0.1
    min_corrupt_rate: float = 0.1

    def __post_init__(self) -> None:
        problems = []
        if not self.modes or set(self.modes) - set(MODES):
            problems.append(f"modes must be among {MODES}, got {self.modes}")
        if self.unit not in UNITS:
            problems.append(f"unit must be one of {UNITS}, got {self.unit!r}")
        if not self.mechanisms or set(self.mechanisms) - set(all_mechanisms()):
            problems.append(f"mechanisms must be among {all_mechanisms()}, got {self.mechanisms}")
        if not (self.min_noise_multiplier >= 0 and math.isfinite(self.min_noise_multiplier)):
            problems.append(f"min_noise_multiplier must be >= 0, got "
                            f"{self.min_noise_multiplier}")
        if self.min_threshold < 1:
            problems.append(f"min_threshold must be >= 1, got {self.min_threshold}")
        if not 0 < self.max_sample_rate <= 1:
            problems.append(f"max_sample_rate must be in (0, 1], got {self.max_sample_rate}")
        for name in ("max_steps", "max_releases"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name} must be >= 1, got {value}")
        if self.max_clip_norm is not None and not self.max_clip_norm > 0:
            problems.append(f"max_clip_norm must be > 0, got {self.max_clip_norm}")
        for name in ("epsilon", "round_epsilon"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0
                                          and math.isfinite(value)):
                problems.append(f"{name} must be a positive number (or null: no cap), got "
                                f"{value!r}")
        if not 0 < self.delta < 1:
            problems.append(f"delta must be in (0, 1), e.g. 1e-5, got {self.delta}")
        for name in ("min_dropout_rate", "min_corrupt_rate"):
            rate = getattr(self, name)
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) \
                    or not 0 <= rate < 1:
                problems.append(f"{name} must be a fraction in [0, 1), got {rate!r}")
        if problems:
            raise PrivacyConfigError("site policy: " + "; ".join(problems))

    @property
    def requires_dp(self) -> bool:
        return MODE_NONE not in self.modes

    def describe(self) -> str:
        """The policy in one readable line (what a site logs at start-up)."""
        modes = ", ".join(self.modes)
        exact = ("exact sums allowed (operator's opt-in)" if MODE_NONE in self.modes
                 else "exact sums refused")
        total = ("no total cap" if self.epsilon is None
                 else f"at most {self.epsilon:g} in total")
        per = ("no cap per release" if self.round_epsilon is None
               else f"at most {self.round_epsilon:g} per release")
        ceilings = [f"{name} <= {value:g}" for name, value in (
            ("sample rate", self.max_sample_rate if self.max_sample_rate < 1 else None),
            ("steps", self.max_steps), ("clip", self.max_clip_norm),
            ("releases", self.max_releases)) if value is not None]
        return (f"privacy policy: modes {modes} ({exact}); noise multiplier >= "
                f"{self.min_noise_multiplier:g}; epsilon per {self.unit} {per}, {total} "
                f"(delta {self.delta:g}); threshold >= {self.min_threshold}; assumes dropout "
                f">= {self.min_dropout_rate:g}, corrupt >= {self.min_corrupt_rate:g}"
                + (f"; {', '.join(ceilings)}" if ceilings else ""))

    def tighten(self, other: SitePolicy | None) -> SitePolicy:
        """This (the operator's) policy as ``other`` (an app's or job's) may narrow it, never
        widen it: modes and mechanisms intersected (``other`` cannot turn exact sums on),
        the larger of every floor, the smaller of every ceiling and budget. ``other``'s unit
        must be this one's. Raises :class:`PolicyRefused` when nothing is left to take part
        in (rule ``modes``: the app asks for a mode the operator did not allow)."""
        if other is None or other == self:
            return self
        if not isinstance(other, SitePolicy):
            raise PrivacyConfigError(f"a policy must be a dp.policy.SitePolicy, got "
                                     f"{type(other).__name__}")
        modes = tuple(m for m in self.modes if m in other.modes)
        mechanisms = tuple(m for m in self.mechanisms if m in other.mechanisms)
        if not modes or not mechanisms:
            wanted = sorted(set(other.modes) - set(self.modes))
            raise PolicyRefused("exact-release" if MODE_NONE in wanted else "modes",
                                f"the app's policy asks for modes {list(other.modes)}; this "
                                f"site's operator allows {list(self.modes)} and an app may "
                                "only tighten it"
                                + (f" (exact sums need the operator's opt-in: {OPT_IN})"
                                   if MODE_NONE in wanted else ""))
        if other.unit != self.unit:
            raise PolicyRefused("unit", f"the app's policy is per {other.unit}; this site's "
                                f"operator set {self.unit}")

        def low(a: Any, b: Any) -> Any:  # the smaller ceiling; None is no ceiling
            return b if a is None else a if b is None else min(a, b)

        return SitePolicy(
            modes=modes, mechanisms=mechanisms, unit=self.unit,
            min_noise_multiplier=max(self.min_noise_multiplier, other.min_noise_multiplier),
            min_threshold=max(self.min_threshold, other.min_threshold),
            max_sample_rate=min(self.max_sample_rate, other.max_sample_rate),
            max_steps=low(self.max_steps, other.max_steps),
            max_clip_norm=low(self.max_clip_norm, other.max_clip_norm),
            max_releases=low(self.max_releases, other.max_releases),
            epsilon=low(self.epsilon, other.epsilon), delta=min(self.delta, other.delta),
            round_epsilon=low(self.round_epsilon, other.round_epsilon),
            min_dropout_rate=max(self.min_dropout_rate, other.min_dropout_rate),
            min_corrupt_rate=max(self.min_corrupt_rate, other.min_corrupt_rate))

    # -- files --------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["modes"], data["mechanisms"] = list(self.modes), list(self.mechanisms)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SitePolicy:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise PrivacyConfigError(f"site policy: unknown keys {unknown}; known: "
                                     f"{sorted(names)}")
        values = dict(data)
        for key in ("modes", "mechanisms"):
            if key in values:
                values[key] = tuple(str(v) for v in values[key])
        try:
            return cls(**values)
        except TypeError as exc:
            raise PrivacyConfigError(f"site policy: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> SitePolicy:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise PrivacyConfigError(f"site policy file {path}: {exc}") from None
        if not isinstance(data, dict):
            raise PrivacyConfigError(f"site policy file {path}: expected a JSON object")
        return cls.from_json(data)

    # -- the rules ------------------------------------------------------------------------
    def check(self, p: Proposal) -> None:
        """Raise :class:`PolicyRefused` naming the first rule ``p`` breaks (the budget and
        ``max_releases`` are the ledger's:
        :meth:`dp.ledger.Ledger.charge`)."""
        # Noised feature statistics are a distributed release in any DP mode of training.
        noised_statistics = p.kind == "scaler" and p.mode != MODE_NONE and self.requires_dp
        if p.mode not in self.modes and not noised_statistics:
            if p.mode == MODE_NONE:
                raise PolicyRefused("exact-release", f"this site requires differential "
                                    f"privacy ({'/'.join(self.modes)}) and does not release "
                                    f"an exact {p.kind} sum; its operator opts in with "
                                    f"{OPT_IN}")
            raise PolicyRefused("modes", f"mode {p.mode!r} is not among this site's "
                                f"{list(self.modes)}")
        if p.secagg_threshold < self.min_threshold:
            raise PolicyRefused("min_threshold", f"the secure sum could be decoded from "
                                f"{p.secagg_threshold} sites; this site needs at least "
                                f"{self.min_threshold}")
        if p.mode == MODE_NONE:
            return
        if p.unit != self.unit:
            raise PolicyRefused("unit", f"the release is computed per {p.unit}; this site's "
                                f"budget is per {self.unit} (its operator's --unit)")
        if p.mechanism not in self.mechanisms:
            raise PolicyRefused("mechanisms", f"mechanism {p.mechanism!r} is not among "
                                f"this site's {list(self.mechanisms)}")
        if (p.event is None and not p.groups) or not p.noise_multiplier > 0:
            raise PolicyRefused("min_noise_multiplier", "the proposed round adds no noise "
                                "(or has no valid privacy bound)")
        private = p.unit == "patient-idp"  # noise, rates and clip from the site's own plan
        if p.noise_multiplier < self.min_noise_multiplier:
            share = "" if p.requested_noise_multiplier is None else (
                f" (this site's own share of the round's noise multiplier "
                f"{p.requested_noise_multiplier:.4g}: without an authenticated roster the "
                "coordinator could fill the round with sites that add no noise, so a site "
                "counts only its own share; an authenticated roster (enrolled signing "
                "keys: --peer-keys, or NVFlare's security='malicious' with verify_keys) "
                "counts the others')")
            raise PolicyRefused("min_noise_multiplier", f"noise multiplier "
                                f"{p.noise_multiplier:.4g}{share} < this site's floor "
                                f"{self.min_noise_multiplier:g}", private=private)
        if p.calibration_threshold is not None:
            if p.calibration_threshold < self.min_threshold:
                raise PolicyRefused("min_threshold", f"the noise is calibrated to "
                                    f"{p.calibration_threshold} sites; this site needs at "
                                    f"least {self.min_threshold}")
            if p.secagg_threshold < p.calibration_threshold:
                raise PolicyRefused("min_threshold", f"the sum could be decoded from "
                                    f"{p.secagg_threshold} sites but the noise is calibrated "
                                    f"to {p.calibration_threshold}: fewer survivors would "
                                    "carry less noise than accounted")
        if p.kind == "train":  # the ceilings on training rounds
            self._check_ceilings(p, private)
        self._check_release_epsilon(p, private)

    def _check_ceilings(self, p: Proposal, private: bool) -> None:
        if p.sample_rate > self.max_sample_rate:
            raise PolicyRefused("max_sample_rate", f"sample rate {p.sample_rate:g} > this "
                                f"site's ceiling {self.max_sample_rate:g}", private=private)
        if self.max_steps is not None and p.steps > self.max_steps:
            raise PolicyRefused("max_steps", f"{p.steps} steps per round > this site's "
                                f"ceiling {self.max_steps}")
        if (self.max_clip_norm is not None and p.clip_norm is not None
                and p.clip_norm > self.max_clip_norm):
            raise PolicyRefused("max_clip_norm", f"clip norm {p.clip_norm:g} > this site's "
                                f"ceiling {self.max_clip_norm:g}", private=private)

    def _check_release_epsilon(self, p: Proposal, private: bool) -> None:
        """``round_epsilon``: the release alone (every rate group's event alone) costs at
        most this much at the policy's delta."""
        if self.round_epsilon is None:
            return
        from dp.accounting import rdp_to_epsilon

        events = [p.event] if p.event is not None else [e for _, _, e in p.groups]
        cost = max(rdp_to_epsilon(e.rdp(), self.delta) for e in events)
        if not cost <= self.round_epsilon:
            raise PolicyRefused("round_epsilon", f"this release alone costs epsilon "
                                f"{cost:.4g} > this site's cap per release "
                                f"{self.round_epsilon:g} (raise the noise multiplier, lower "
                                "the sample rate or the steps)", private=private)
