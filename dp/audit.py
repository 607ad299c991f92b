"""The audit trail: every release as Google dp-accounting ``DpEvent``s, so an auditor can
recompute epsilon with an independent library (docs/privacy.md section 4).

:func:`event_json` describes a :mod:`dp.budget` event in the shape of dp-accounting's events
(``{"class_name": "PoissonSampledDpEvent", "sampling_probability": q, "event": {...}}``),
as plain JSON so a run's report carries it without dp-accounting installed;
:func:`to_dp_event` rebuilds the ``DpEvent`` and :func:`recompute_epsilon` composes a run's
events with dp-accounting's own RDP or PLD accountant.

* Site mode (sampled Gaussian, Opacus): ``SelfComposed(PoissonSampled(q, Gaussian(z)),
  steps)``; with adaptive clipping the inner event is ``Composed([Gaussian(z_u),
  Gaussian(2 sigma_b)])`` (both queries on the same sample). dp-accounting composes these
  exactly.
* Distributed integer mechanisms (:mod:`dp.mechanisms`): per step the sum is zCDP with the
  mechanism's own ``(rho, xi)`` (:meth:`~dp.mechanisms.base.IntegerMechanism.zcdp`: for the
  discrete Gaussian ``rho = r2^2 / 2``, ``xi = tau d``, the first form of KLS 2021 Prop. 14;
  for Skellam ``rho = D2^2 / (2V)``, ``xi = 3 D1 / (2V)``, Agarwal et al. 2021 Thm. 3.5),
  exported as ``ZCDpEvent`` inside ``PoissonSampledDpEvent``. dp-accounting 0.6 composes a
  ``ZCDpEvent`` but refuses to subsample one (it amplifies only Gaussians), so for ``q < 1``
  these rounds are recomputed here with Zhu & Wang's bound, and an auditor checks them
  with :mod:`dp.accounting`.
* Patient-idp (a rate group's steps, in a ``--role all`` report or a site role's ledger):
  ``SelfComposed(MixtureOfGaussians(z, m, Binomial(k, q)), steps)``
  (:func:`dp.accounting.group_gaussian_event`); dp-accounting's PLD composes it.

:func:`recompute_epsilon` with ``accountant="auto"`` recomputes any of these: dp-accounting's
PLD where it can (a Poisson-sampled adaptive-clipping step is first rewritten as the one
Gaussian it is: two Gaussian queries on the same sample, noise multipliers ``z_u`` and
``2 sigma_b``, are exactly one Gaussian of noise multiplier ``(z_u^-2 + (2 sigma_b)^-2)^-1/2``),
then its RDP accountant (zCDP composes there at q = 1), and otherwise (Poisson-subsampled
zCDP) this module's Zhu-Wang routine, which is checked against a numerical integration of
the subsampled Gaussian's Renyi divergence (``tests/dp/test_audit_every_mode.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from dp.accounting import ORDERS, PLD_INTERVAL, group_gaussian_event, integer_rdp, rdp_to_epsilon
from dp.adaptive_clip import COUNT_MECHANISM
from dp.budget import Event, GaussianRound, RdpRound
from dp.errors import MissingExtra, PrivacyConfigError
from dp.mechanisms import IntegerMechanism, registered


def distributed_event(params: Any, sample_rate: float, steps: int = 1,
                      clipper: Any = None) -> RdpRound:
    """The budget event of ``steps`` rounds of ``params`` (an :class:`EncodingParams`),
    with the mechanism described for the export."""
    from dp.distributed import round_rdp

    spec = {"sample_rate": sample_rate, "steps": float(steps),
            "l2": params.rounded_l2_bound, "l1": params.rounded_l1_bound,
            "sigma": params.scale * params.noise_stddev,
            "threshold": float(params.threshold), "dim": float(params.encoded_dim)}
    if clipper is not None:
        spec["count_sigma"] = math.sqrt(clipper.per_site_variance)
    rdp = round_rdp(params, sample_rate, steps, clipper=clipper)
    return RdpRound.from_array(rdp, params.mechanism, spec)


def _zcdp(mech: IntegerMechanism, l2: float, l1: float, sigma: float, n: int, dim: int
          ) -> dict[str, Any]:
    rho, xi = mech.zcdp(l2, l1, sigma, n, dim)
    return {"class_name": "ZCDpEvent", "rho": rho, "xi": xi}


def event_json(event: Event) -> dict[str, Any]:
    """``event`` as a dp-accounting ``DpEvent`` in JSON form (see the module docstring)."""
    if isinstance(event, GaussianRound):
        inner: dict[str, Any] = {"class_name": "GaussianDpEvent",
                                 "noise_multiplier": event.noise_multiplier}
        if event.count_stddev is not None:
            inner = {"class_name": "ComposedDpEvent", "events": [inner, {
                "class_name": "GaussianDpEvent", "noise_multiplier": 2 * event.count_stddev}]}
        step = {"class_name": "PoissonSampledDpEvent",
                "sampling_probability": event.sample_rate, "event": inner}
        return {"class_name": "SelfComposedDpEvent", "event": step, "count": event.steps}
    spec = dict(event.spec)
    if event.label == "idp" and {"records", "sample_rate", "noise_multiplier",
                                 "steps"} <= set(spec):
        return group_gaussian_event(float(spec["noise_multiplier"]), float(spec["sample_rate"]),
                                    int(spec["records"]), int(spec["steps"]))
    mech = registered().get(event.label)
    if mech is None or "sigma" not in spec:
        return {"class_name": "UnsupportedDpEvent", "label": event.label}
    n, dim = int(spec["threshold"]), int(spec["dim"])
    inner = _zcdp(mech, spec["l2"], spec["l1"], spec["sigma"], n, dim)
    if "count_sigma" in spec:
        inner = {"class_name": "ComposedDpEvent", "events": [
            inner, _zcdp(COUNT_MECHANISM, 1.0, 1.0, spec["count_sigma"], n, 1)]}
    q = spec["sample_rate"]
    step = inner if q >= 1 else {"class_name": "PoissonSampledDpEvent",
                                 "sampling_probability": q, "event": inner}
    return {"class_name": "SelfComposedDpEvent", "event": step, "count": int(spec["steps"])}


def run_json(events: Sequence[Event]) -> dict[str, Any]:
    """A whole run: the composition of its releases."""
    return {"class_name": "ComposedDpEvent", "events": [event_json(e) for e in events]}


def to_dp_event(data: dict[str, Any]) -> Any:
    """Rebuild the dp-accounting ``DpEvent`` that ``data`` describes."""
    try:
        import dp_accounting
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        raise MissingExtra("the audit needs dp-accounting: pip install dp-accounting") from exc
    try:
        name = data["class_name"]
        if name == "UnsupportedDpEvent":
            return dp_accounting.UnsupportedDpEvent()
        cls = getattr(dp_accounting, name, None) or getattr(dp_accounting.dp_event, name)
        kwargs = {k: v for k, v in data.items() if k != "class_name"}
        if "event" in kwargs:
            kwargs["event"] = to_dp_event(kwargs["event"])
        if "events" in kwargs:
            kwargs["events"] = [to_dp_event(e) for e in kwargs["events"]]
        return cls(**kwargs)
    except (KeyError, TypeError, AttributeError) as exc:
        raise PrivacyConfigError(f"not a DpEvent description: {exc}") from None


def recompute_epsilon(data: dict[str, Any], delta: float, accountant: str = "rdp") -> float:
    """Epsilon of the DpEvent ``data`` by dp-accounting's own accountant (``rdp`` or
    ``pld``; ``"auto"``: the first of PLD, RDP and Zhu-Wang that composes it, see
    :func:`recompute`), independently of this package's accounting; ``"zhu-wang"``: from the event
    description alone, for what dp-accounting cannot compose (a Poisson-subsampled zCDP
    round): each zCDP release's RDP curve ``xi + rho * a``, Gaussians' ``a / (2 z^2)``,
    subsampled with Zhu & Wang's bound at integer orders, composed and converted."""
    if accountant == "zhu-wang":
        return rdp_to_epsilon(_event_rdp(data), delta)
    if accountant == "auto":
        return recompute(data, delta)[0]
    import dp_accounting

    event = to_dp_event(data if accountant == "rdp" else gaussian_equivalent(data))
    if accountant == "rdp":
        acc: Any = dp_accounting.rdp.RdpAccountant(list(ORDERS))
    elif accountant == "pld":
        # a patient's mixture of Gaussians at dp-accounting's default 1e-4 grid takes minutes;
        # the package's own grid (pessimistic: still an upper bound) takes seconds
        mixture = "MixtureOfGaussiansDpEvent" in repr(data)
        acc = (dp_accounting.pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL)
               if mixture else dp_accounting.pld.PLDAccountant())
    else:
        raise PrivacyConfigError(f"accountant must be 'rdp', 'pld' or 'zhu-wang', got "
                                 f"{accountant!r}")
    if not acc.supports(event):
        raise PrivacyConfigError(
            f"dp-accounting's {accountant} accountant cannot compose this run: "
            f"{_unsupported(acc, event, accountant)}")
    return float(acc.compose(event).get_epsilon(delta))


def _unsupported(acc: Any, event: Any, accountant: str) -> str:
    """Which part of ``event`` the accountant lacks, and what recomputes it instead."""
    for child in [*getattr(event, "events", ()), *filter(None, [getattr(event, "event",
                                                                         None)])]:
        if not acc.supports(child):
            return _unsupported(acc, child, accountant)
    name = type(event).__name__
    inner = type(getattr(event, "event", None)).__name__
    if name == "ZCDpEvent":
        return ("a ZCDpEvent (a distributed discrete Gaussian or Skellam sum: the noised "
                "feature statistics or a distributed round) has no privacy loss distribution "
                "in dp-accounting; recompute the run with 'rdp', which composes zCDP exactly")
    if name == "PoissonSampledDpEvent" and inner != "GaussianDpEvent":
        q = getattr(event, "sampling_probability", None)
        return (f"a PoissonSampledDpEvent of a {inner} (sampling probability {q}): "
                f"dp-accounting's {accountant} accountant subsamples only Gaussians; "
                "recompute a subsampled distributed round with accountant='zhu-wang' (from "
                "the event description), an adaptive-clipping step with 'rdp'")
    return f"a {name}"


def _event_rdp(data: dict[str, Any]) -> Any:
    """RDP at :data:`ORDERS` of the event ``data`` describes (see :func:`recompute_epsilon`,
    ``"zhu-wang"``); a kind it has no curve for raises :class:`PrivacyConfigError`."""
    import numpy as np

    name = data.get("class_name")
    if name == "ComposedDpEvent":
        return sum((_event_rdp(e) for e in data["events"]),
                   np.zeros(len(ORDERS), dtype=np.float64))
    if name == "SelfComposedDpEvent":
        return int(data["count"]) * _event_rdp(data["event"])
    if name == "PoissonSampledDpEvent":
        curve = _rdp_curve(data["event"])
        return integer_rdp(curve, float(data["sampling_probability"]), 1)
    curve = _rdp_curve(data)
    return np.asarray([curve(max(2, math.ceil(a))) for a in ORDERS], dtype=np.float64)


def _rdp_curve(data: dict[str, Any]) -> Any:
    """``order -> RDP`` of an unsubsampled release (zCDP, Gaussian, or their composition)."""
    name = data.get("class_name")
    if name == "ZCDpEvent":
        rho, xi = float(data["rho"]), float(data["xi"])
        return lambda a: xi + rho * a
    if name == "GaussianDpEvent":
        z = float(data["noise_multiplier"])
        return lambda a: a / (2 * z * z)
    if name == "ComposedDpEvent":
        parts = [_rdp_curve(e) for e in data["events"]]
        return lambda a: sum(p(a) for p in parts)
    raise PrivacyConfigError(f"no RDP curve for a {name} inside a subsampled event")


def gaussian_equivalent(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with every composition of Gaussians on one sample (adaptive clipping's update
    and clip count) replaced by the single Gaussian it equals: noise multipliers z_i on the
    same data are one Gaussian of ``(sum z_i^-2)^-1/2`` (the privacy loss of independent
    Gaussian queries adds as one of their stacked sensitivity). Exact, so PLD composes it."""
    name = data.get("class_name")
    if name == "ComposedDpEvent":
        parts = [gaussian_equivalent(e) for e in data["events"]]
        if parts and all(p.get("class_name") == "GaussianDpEvent" for p in parts):
            inverse = sum(float(p["noise_multiplier"]) ** -2 for p in parts)
            return {"class_name": "GaussianDpEvent", "noise_multiplier": inverse ** -0.5}
        return {**data, "events": parts}
    if "event" in data:
        return {**data, "event": gaussian_equivalent(data["event"])}
    return data


def recompute(data: dict[str, Any], delta: float) -> tuple[float, str]:
    """``(epsilon, accountant)``: the event recomputed by dp-accounting's PLD if it composes
    it (after :func:`gaussian_equivalent`), else its RDP accountant, else the Zhu-Wang
    routine from the event description (a Poisson-subsampled zCDP release)."""
    import dp_accounting

    event = to_dp_event(gaussian_equivalent(data))
    if dp_accounting.pld.PLDAccountant().supports(event):
        return recompute_epsilon(data, delta, "pld"), "pld"
    if dp_accounting.rdp.RdpAccountant(list(ORDERS)).supports(to_dp_event(data)):
        return recompute_epsilon(data, delta, "rdp"), "rdp"
    return recompute_epsilon(data, delta, "zhu-wang"), "zhu-wang"
