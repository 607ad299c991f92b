"""Privacy accounting: Opacus for the sampled Gaussian, the papers for the integer mechanisms.

* Sampled Gaussian (site mode, and the central reference): Opacus' ``RDPAccountant``
  (Mironov, Talwar, Zhang 2019) and ``PRVAccountant`` (Gopi, Lee, Wutschitz 2021).
* The integer mechanisms of distributed DP (distributed discrete Gaussian, Skellam): each
  owns its per-step RDP bound (:mod:`dp.mechanisms`); this module subsamples and composes it.
* Poisson subsampling of a general RDP mechanism: Zhu, Wang, ICML 2019, Thm. 6 (upper bound).
* RDP -> (epsilon, delta): Canonne, Kamath, Steinke 2020, Prop. 12 (= Balle et al. 2020,
  Thm. 21), the conversion Opacus uses.

Only this module imports opacus, and only inside the functions that need it, so
``import dp`` works on a core install (torch is an optional extra).
"""

from __future__ import annotations

import functools
import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from dp.errors import MissingExtra, PrivacyConfigError, require_opacus

F64 = npt.NDArray[np.float64]
History = Sequence[tuple[float, float, int]]

#: The RDP orders used throughout (Opacus' defaults plus large orders for tiny epsilons).
ORDERS: tuple[float, ...] = (
    *(1 + x / 10.0 for x in range(1, 100)),
    *range(11, 64),
    64, 80, 96, 128, 192, 256,
)


def _check(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> None:
    if not noise_multiplier > 0:
        raise PrivacyConfigError(f"noise multiplier must be > 0, got {noise_multiplier}")
    if not 0 < sample_rate <= 1:
        raise PrivacyConfigError(f"sample rate must be in (0, 1], got {sample_rate}")
    if steps < 0:
        raise PrivacyConfigError(f"steps must be >= 0, got {steps}")
    if not 0 < delta < 1:
        raise PrivacyConfigError(f"delta must be in (0, 1), got {delta}")


# --- accountants, by name (after Opacus' accountants registry) ---------------------------
class Accountant(ABC):
    """How a run's sampled Gaussian steps compose into epsilon: one registered object per
    ``--accountant`` name (``secagg budget`` and ``secagg train`` offer the same names,
    :func:`accountant_names`)."""

    name: ClassVar[str]
    description: ClassVar[str]
    composes_rdp: ClassVar[bool] = False
    """Composes any release by adding RDP curves at :data:`ORDERS` (so integer mechanisms
    and earlier releases too); otherwise only sampled Gaussian steps compose."""

    @abstractmethod
    def epsilon(self, history: History, delta: float) -> float:
        """Epsilon of an Opacus-style ``[(noise_multiplier, sample_rate, steps), ...]``
        (every ``steps >= 1``)."""

    def noise_multiplier(self, epsilon: float, delta: float, sample_rate: float, steps: int
                         ) -> float:
        """The smallest noise multiplier whose ``steps`` fit in ``epsilon`` (bisection)."""
        return _bisect_noise(
            lambda z: self.epsilon([(z, sample_rate, steps)], delta) <= epsilon, epsilon)


class _OpacusAccountant(Accountant):
    def noise_multiplier(self, epsilon: float, delta: float, sample_rate: float, steps: int
                         ) -> float:
        require_opacus()
        from opacus.accountants.utils import get_noise_multiplier

        try:
            with warnings.catch_warnings():
                # Opacus' search probes noise far above the answer, where the best order is
                # the largest of ORDERS; at the answer it is inside them for epsilon above
                # ~0.05 (order 256's conversion term at delta 1e-5 is log(1/delta)/255 =
                # 0.045) (high epsilon puts it at the smallest: rdp_optimal_order says so)
                warnings.filterwarnings("ignore", message="Optimal order is the (largest|"
                                                          "smallest) alpha")
                return float(get_noise_multiplier(
                    target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate,
                    steps=steps, accountant=self.name, epsilon_tolerance=epsilon * 1e-3,
                    **({"alphas": list(ORDERS)} if self.name == "rdp" else {})))
        except ValueError as exc:
            raise PrivacyConfigError(
                f"no noise multiplier up to 1e6 reaches epsilon={epsilon}: raise epsilon or "
                "delta, or lower the sample rate or the rounds"
            ) from exc


class RdpAccountant(_OpacusAccountant):
    name = "rdp"
    description = "Renyi DP (Opacus' analysis, CKS 2020 conversion)"
    composes_rdp = True

    def epsilon(self, history: History, delta: float) -> float:
        require_opacus()  # Opacus' conversion, without its warning about the orders
        return rdp_to_epsilon(sum((gaussian_rdp(z, q, n) for z, q, n in history),
                                  np.zeros(len(ORDERS))), delta)


class PrvAccountant(_OpacusAccountant):
    name = "prv"
    description = "privacy random variables (Opacus' PRVAccountant: tighter)"

    def epsilon(self, history: History, delta: float) -> float:
        require_opacus()
        from opacus.accountants import PRVAccountant

        acc = PRVAccountant()
        acc.history = list(history)
        return float(acc.get_epsilon(delta=delta))


class PldAccountant(Accountant):
    name = "pld"
    description = "privacy loss distribution (dp-accounting's PLDAccountant)"

    def epsilon(self, history: History, delta: float) -> float:
        try:
            import dp_accounting
        except ImportError as exc:  # pragma: no cover - the torch and test extras install it
            raise MissingExtra("PLD accounting needs dp-accounting: pip install "
                               "dp-accounting") from exc
        acc = dp_accounting.pld.PLDAccountant()
        for z, q, n in history:
            step: Any = dp_accounting.GaussianDpEvent(z)
            if q < 1:
                step = dp_accounting.PoissonSampledDpEvent(q, step)
            acc.compose(step, int(n))
        return float(acc.get_epsilon(delta))


_ACCOUNTANTS: dict[str, Accountant] = {}


def register_accountant(acc: Accountant) -> Accountant:
    """Make ``acc`` findable by its name (a taken name raises PrivacyConfigError)."""
    if acc.name in _ACCOUNTANTS and _ACCOUNTANTS[acc.name] is not acc:
        raise PrivacyConfigError(f"an accountant named {acc.name!r} is already registered")
    _ACCOUNTANTS[acc.name] = acc
    return acc


for _acc in (RdpAccountant(), PrvAccountant(), PldAccountant()):
    register_accountant(_acc)


def accountant_names() -> tuple[str, ...]:
    """The names ``--accountant`` takes, in every command."""
    return tuple(_ACCOUNTANTS)


def get_accountant(name: str) -> Accountant:
    """The accountant called ``name``; an unknown name raises PrivacyConfigError."""
    found = _ACCOUNTANTS.get(name) if isinstance(name, str) else None
    if found is None:
        raise PrivacyConfigError(f"accountant must be one of {accountant_names()}, got "
                                 f"{name!r}")
    return found


def check_accountant(accountant: str) -> str:
    return get_accountant(accountant).name


# --- sampled Gaussian, through Opacus ----------------------------------------------------
def gaussian_rdp(
    noise_multiplier: float, sample_rate: float, steps: int, orders: Sequence[float] = ORDERS
) -> F64:
    """RDP of ``steps`` sampled Gaussian steps at ``orders`` (Opacus' analysis)."""
    require_opacus()
    from opacus.accountants.analysis import rdp as opacus_rdp

    return np.asarray(
        opacus_rdp.compute_rdp(
            q=sample_rate, noise_multiplier=noise_multiplier, steps=steps, orders=list(orders)
        ),
        dtype=np.float64,
    )


def gaussian_epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
) -> float:
    """Epsilon of ``steps`` steps of the sampled Gaussian mechanism (Opacus' accountants)."""
    _check(noise_multiplier, sample_rate, steps, delta)
    return epsilon_of_history([(noise_multiplier, sample_rate, steps)], delta, accountant)


def epsilon_of_history(
    history: Sequence[tuple[float, float, int]], delta: float, accountant: str = "rdp"
) -> float:
    """Epsilon of an Opacus-style history ``[(noise_multiplier, sample_rate, steps), ...]``
    by the accountant named ``accountant``."""
    acc = get_accountant(accountant)
    history = [h for h in history if h[2] > 0]
    if not history:
        return 0.0
    return acc.epsilon(history, delta)


def noise_multiplier_for(
    epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "rdp",
    prior_rdp: F64 | None = None,
) -> float:
    """The smallest noise multiplier (to 0.1% of epsilon) whose ``steps`` fit in ``epsilon``;
    with ``prior_rdp`` (releases already made, RDP at :data:`ORDERS`), the smallest whose
    steps fit together with them (RDP accountant only)."""
    _check(1.0, sample_rate, steps, delta)
    if steps < 1:
        raise PrivacyConfigError(f"rounds must be >= 1, got {steps}")
    if not epsilon > 0:
        raise PrivacyConfigError(f"epsilon must be > 0, got {epsilon}")
    acc = get_accountant(accountant)
    if prior_rdp is not None:
        if not acc.composes_rdp:
            raise PrivacyConfigError("earlier releases compose with the rdp accountant only")
        prior = np.asarray(prior_rdp, dtype=np.float64)

        def fits(z: float) -> bool:
            return rdp_to_epsilon(prior + gaussian_rdp(z, sample_rate, steps), delta) <= epsilon

        return _bisect_noise(fits, epsilon)
    return acc.noise_multiplier(epsilon, delta, sample_rate, steps)


def _bisect_noise(fits: Callable[[float], bool], epsilon: float) -> float:
    """The smallest noise multiplier in (0, 1e6] with ``fits`` (relative precision 1e-4)."""
    hi = 1.0
    while not fits(hi):
        hi *= 2
        if hi > 1e6:
            raise PrivacyConfigError(f"no noise multiplier up to 1e6 reaches epsilon={epsilon}"
                                     " after the earlier releases: raise epsilon or delta")
    lo = hi / 2
    while fits(lo) and lo > 1e-6:
        hi, lo = lo, lo / 2
    while hi / lo > 1.0001:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def rounds_for(
    epsilon: float,
    delta: float,
    sample_rate: float,
    noise_multiplier: float,
    accountant: str = "rdp",
    max_rounds: int = 10**7,
) -> int:
    """The largest number of steps whose epsilon is at most ``epsilon`` (0 if none fits)."""
    _check(noise_multiplier, sample_rate, 0, delta)
    if not epsilon > 0:
        raise PrivacyConfigError(f"epsilon must be > 0, got {epsilon}")

    if get_accountant(accountant).composes_rdp:
        per_step = gaussian_rdp(noise_multiplier, sample_rate, 1)  # RDP composes linearly

        def fits(r: int) -> bool:
            return rdp_to_epsilon(per_step * r, delta) <= epsilon
    else:

        def fits(r: int) -> bool:
            return gaussian_epsilon(noise_multiplier, sample_rate, r, delta, accountant) <= epsilon

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= max_rounds and fits(hi):
        lo, hi = hi, hi * 2
    if hi > max_rounds:
        return max_rounds if fits(max_rounds) else _bisect(fits, lo, max_rounds)
    return _bisect(fits, lo, hi)


def _bisect(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest r in [lo, hi) with fits(r), given fits(lo) and not fits(hi)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# --- RDP -> (epsilon, delta) -------------------------------------------------------------
def _conversion(rdp: F64, delta: float, orders: Sequence[float]) -> tuple[F64, F64]:
    """CKS 2020 Prop. 12 at every order: ``(orders, eps)``, a non-finite eps as inf."""
    a = np.asarray(orders, dtype=np.float64)
    r = np.asarray(rdp, dtype=np.float64)
    eps = r + np.log1p(-1.0 / a) - (math.log(delta) + np.log(a)) / (a - 1.0)
    return a, np.where(np.isfinite(eps), eps, np.inf)


def rdp_optimal_order(rdp: F64, delta: float, orders: Sequence[float] = ORDERS) -> float:
    """The Renyi order at which :func:`rdp_to_epsilon`'s conversion is tightest. At the
    smallest or the largest of ``orders`` the true optimum lies outside them, so the epsilon
    is an upper bound looser than it could be (Opacus warns "Optimal order is the smallest
    alpha"; the commands say it in words)."""
    a, eps = _conversion(rdp, delta, orders)
    return float(a[int(np.argmin(eps))])


def rdp_to_epsilon(rdp: F64, delta: float, orders: Sequence[float] = ORDERS) -> float:
    """CKS 2020 Prop. 12: ``eps = rdp + log1p(-1/a) - (log delta + log a) / (a - 1)``."""
    eps = _conversion(rdp, delta, orders)[1].min()
    return float(max(0.0, eps)) if math.isfinite(eps) else math.inf


# --- subsampling and composition of integer mechanisms (dp.mechanisms) ------------------
def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def subsampled_rdp(eps: Callable[[int], float], q: float, alpha: int) -> float:
    """Zhu & Wang 2019, Thm. 6: RDP of order ``alpha`` after Poisson subsampling at rate ``q``.

    ``log((1-q)^(a-1) (a q - q + 1) + C(a,2) q^2 (1-q)^(a-2) e^eps(2)
    + 3 sum_{l=3}^a C(a,l) (1-q)^(a-l) q^l e^((l-1) eps(l))) / (a - 1)``, capped by ``eps(a)``.
    Every term is taken in log space, so ``q`` close to 1 (where ``(1-q)^(a-1)`` underflows)
    is exact, and ``q = 1`` is the unsubsampled mechanism.
    """
    if not 0 < q <= 1:
        raise PrivacyConfigError(f"sample rate must be in (0, 1], got {q}")
    if q >= 1:
        return eps(alpha)
    log1mq = math.log1p(-q)
    terms = [(alpha - 1) * log1mq + math.log(alpha * q - q + 1)]
    terms.append(_log_comb(alpha, 2) + 2 * math.log(q) + (alpha - 2) * log1mq + eps(2))
    for k in range(3, alpha + 1):
        terms.append(math.log(3) + _log_comb(alpha, k) + (alpha - k) * log1mq
                     + k * math.log(q) + (k - 1) * eps(k))
    m = max(terms)
    if not math.isfinite(m):
        return eps(alpha)
    value = (m + math.log(sum(math.exp(t - m) for t in terms))) / (alpha - 1)
    return min(value, eps(alpha))


def joint_rdp_fn(*fns: Callable[[int], float]) -> Callable[[int], float]:
    """Per-step RDP of several queries answered on the *same* sample (e.g. an update and
    its adaptive-clipping count, Andrew et al. 2021): compose the unsubsampled mechanisms
    (their RDP adds, Mironov 2017 Prop. 1), then subsample the composition once. Adding two
    separately subsampled curves would assume independent samples and is not a bound."""

    def eps(a: int) -> float:
        return sum(f(a) for f in fns)

    return eps


def adaptive_clip_noise_multiplier(update_noise_multiplier: float, count_stddev: float
                                   ) -> float:
    """Andrew et al. 2021, Thm. 1: an update with noise multiplier ``z_u`` and the centred
    unclipped count (each unit contributes ``b - 1/2``, sensitivity 1/2) with noise
    ``count_stddev`` on the same sample form one Gaussian mechanism with noise multiplier
    ``(z_u^-2 + (2 count_stddev)^-2)^-1/2``."""
    if not update_noise_multiplier > 0 or not count_stddev > 0:
        raise PrivacyConfigError("noise multiplier and count stddev must be > 0")
    return float((update_noise_multiplier**-2 + (2 * count_stddev) ** -2) ** -0.5)


def adaptive_clip_update_noise(effective_noise_multiplier: float, count_stddev: float
                               ) -> float:
    """The update's noise multiplier that, with the count, gives ``effective`` (the inverse
    of :func:`adaptive_clip_noise_multiplier`); needs ``effective < 2 count_stddev``."""
    z, s = effective_noise_multiplier, count_stddev
    if not z > 0 or not s > 0:
        raise PrivacyConfigError("noise multiplier and count stddev must be > 0")
    if not z < 2 * s:
        raise PrivacyConfigError(
            f"the clip count's noise {s:g} is too small for noise multiplier {z:g}: need "
            f"count stddev > {z / 2:g} (Andrew et al. 2021, Thm. 1); raise it")
    return float((z**-2 - (2 * s) ** -2) ** -0.5)


def check_delta(delta: float, num_units: int) -> str | None:
    """A warning text when ``delta >= 1 / num_units`` (then "release one unit's data at
    random" satisfies the guarantee: delta must be well below 1/#patients), else None."""
    if num_units >= 1 and delta >= 1.0 / num_units:
        return (f"delta={delta:g} is not below 1/{num_units} (the number of patients): "
                f"a mechanism that publishes one patient's records outright would meet it; "
                f"use delta < {1.0 / num_units:.1g}, e.g. {0.1 / num_units:.1g}")
    return None


def integer_rdp(
    eps: Callable[[int], float], sample_rate: float, steps: int, orders: Sequence[float] = ORDERS
) -> F64:
    """RDP of ``steps`` subsampled steps at ``orders``; a fractional order uses the next
    integer (RDP is non-decreasing in the order, so that is an upper bound)."""
    cache: dict[int, float] = {}
    out = []
    for a in orders:
        k = max(2, math.ceil(a))
        if k not in cache:
            cache[k] = subsampled_rdp(eps, sample_rate, k)
        out.append(cache[k] * steps)
    return np.asarray(out, dtype=np.float64)


# --- a group of records, each Poisson-sampled (patient-level accounting of record sampling) --
def group_gaussian_rdp(
    noise_multiplier: float, sample_rate: float, group_size: int, steps: int = 1,
    orders: Sequence[float] = ORDERS, max_order: int = 128,
) -> F64:
    """RDP of ``steps`` sampled Gaussian steps for a *group* of ``group_size`` records (one
    patient's), each record Poisson-sampled independently at ``sample_rate``, clipped to C,
    noise ``noise_multiplier * C`` (docs/patient_privacy.md section 2).

    The patient's sampled sum is a mixture of Gaussians: m ~ Binomial(k, q) records sampled,
    mean of norm at most m C. By Choquette-Choo, Ganesh, Steinke, Thakurta 2023 (Cor. 4.7)
    the vector mixture is dominated by the scalar mixture P = sum_m b_m N(m, z^2) against
    Q = N(0, z^2). Both directions are computed at integer orders ``a <= max_order``:
    D_a(P||Q) exactly, as ``log sum_M c_M exp(M^2 / (2 z^2)) / (a-1)`` with ``c_M`` the
    coefficients of ``(sum_m b_m exp(-m^2/(2 z^2)) y^m)^a`` (for k = 1 this is Mironov,
    Talwar, Zhang 2019's integer-order formula); D_a(Q||P) by trapezoidal integration in
    log space. A fractional order takes the next integer's value (RDP is non-decreasing in
    the order); orders above ``max_order`` are ``inf`` (unused by the conversion).
    """
    _check(noise_multiplier, sample_rate, steps, 0.5)
    if group_size < 1:
        raise PrivacyConfigError(f"group size must be >= 1, got {group_size}")
    if max_order < 2:
        raise PrivacyConfigError(f"max_order must be >= 2, got {max_order}")
    curve = _group_rdp_integer(float(noise_multiplier), float(sample_rate), int(group_size),
                               int(max_order))
    out = [curve[max(2, math.ceil(a))] * steps if math.ceil(a) <= max_order else math.inf
           for a in orders]
    return np.asarray(out, dtype=np.float64)


@functools.lru_cache(maxsize=4096)
def _group_rdp_integer(z: float, q: float, k: int, max_order: int) -> tuple[float, ...]:
    """Per-step RDP at integer orders 0..max_order (entries 0 and 1 unused)."""
    m = np.arange(k + 1, dtype=np.float64)
    if q >= 1:
        log_b = np.where(m == k, 0.0, -np.inf)
    else:
        log_b = (np.array([_log_comb(k, int(i)) for i in m]) + m * math.log(q)
                 + (k - m) * math.log1p(-q))
    # D_a(P || Q): exact polynomial expansion, all integer orders in one pass.
    base = log_b - m * m / (2 * z * z)
    poly = base.copy()
    forward: dict[int, float] = {}
    for a in range(2, max_order + 1):
        grown = np.full(len(poly) + k, -np.inf)
        for j in range(k + 1):
            grown[j:j + len(poly)] = np.logaddexp(grown[j:j + len(poly)], poly + base[j])
        poly = grown
        big_m = np.arange(len(poly), dtype=np.float64)
        forward[a] = _logsumexp(poly + big_m * big_m / (2 * z * z)) / (a - 1)
    # D_a(Q || P) = log E_Q[(P/Q)^(1-a)] / (a-1), on a grid in units of the noise stddev.
    # The grid ends at u = 40: L = P/Q is increasing in u, so every point past 0 has
    # L^(1-a) <= L(0)^(1-a) <= that of every point in [-1, 0]; the points past 40 weigh at
    # most Phi(-40) / Q([-1, 0]) < 1e-340 of the sum, which is 0 in float64 (the grid once
    # ran to 40 + k/z: the same epsilon, 2-3x the time at k = 96).
    width = 1.0 / math.sqrt(1.0 + (max_order - 1) * k * k / (4 * z * z))
    du = min(0.05, width / 4)
    u = np.arange(-40.0, 40.0 + du, du)
    log_l = np.full(len(u), -np.inf)
    for j in range(k + 1):
        log_l = np.logaddexp(log_l, log_b[j] + (2 * j * z * u - j * j) / (2 * z * z))
    log_q = -u * u / 2 - 0.5 * math.log(2 * math.pi) + math.log(du)
    reverse = {a: _logsumexp(log_q + (1 - a) * log_l) / (a - 1) for a in range(2, max_order + 1)}
    return (math.inf, math.inf,
            *(max(0.0, forward[a], reverse[a]) for a in range(2, max_order + 1)))


def _logsumexp(x: F64) -> float:
    top = float(np.max(x))
    if not math.isfinite(top):
        return top
    return top + math.log(float(np.sum(np.exp(x - top))))


# --- the same group by its privacy loss distribution (dp-accounting's PLD) -------------------
#: Privacy-loss discretization of the group PLD. dp-accounting rounds pessimistically, so
#: any interval gives an upper bound; at 1e-2 a 1,500-step epsilon is within ~5 % of the
#: 1e-4 figure (docs/patient_privacy.md) at ~1/50 of the time.
PLD_INTERVAL = 1e-2
#: Binomial tail mass below which the records-sampled mixture lumps the tail into one
#: component at the full group size (still an upper bound; keeps the loss range small).
_TAIL_MASS = 1e-30


def group_mixture(sample_rate: float, group_size: int) -> tuple[list[float], list[float]]:
    """``(sensitivities, probabilities)`` of one step for a patient whose ``group_size``
    records are each Poisson-sampled at ``sample_rate``: m ~ Binomial(k, q) records sampled,
    sensitivity m (in clip norms). The tail past the last m with mass above 1e-30 is one
    component at sensitivity k (a larger sensitivity than any it replaces: an upper bound)."""
    if not 0 < sample_rate <= 1:
        raise PrivacyConfigError(f"sample rate must be in (0, 1], got {sample_rate}")
    if group_size < 1:
        raise PrivacyConfigError(f"group size must be >= 1, got {group_size}")
    k, q = int(group_size), float(sample_rate)
    if q >= 1:
        return [float(k)], [1.0]
    log_b = np.array([_log_comb(k, m) + m * math.log(q) + (k - m) * math.log1p(-q)
                      for m in range(k + 1)])
    b = np.exp(log_b)
    tail = np.cumsum(b[::-1])[::-1]  # tail[m] = P(M >= m)
    last = k
    for m in range(1, k + 1):
        if tail[m] < _TAIL_MASS:
            last = m - 1
            break
    sens = [float(m) for m in range(last + 1)]
    probs = [float(p) for p in b[:last + 1]]
    if last < k:
        sens.append(float(k))
        probs.append(float(tail[last + 1]))
    return sens, probs


def group_gaussian_event(noise_multiplier: float, sample_rate: float, group_size: int,
                         steps: int) -> dict[str, Any]:
    """``steps`` steps for one patient of ``group_size`` Poisson-sampled records, as a
    dp-accounting ``DpEvent`` in JSON form (:mod:`dp.audit` rebuilds it):
    ``SelfComposed(MixtureOfGaussians(z, m, Binomial(k, q)), steps)`` (Choquette-Choo et al.
    2023: the scalar mixture dominates the patient's vector mixture)."""
    _check(noise_multiplier, sample_rate, steps, 0.5)
    if sample_rate >= 1:  # every record always sampled: a Gaussian of sensitivity k
        return {"class_name": "SelfComposedDpEvent", "count": int(steps),
                "event": {"class_name": "GaussianDpEvent",
                          "noise_multiplier": float(noise_multiplier) / group_size}}
    sens, probs = group_mixture(sample_rate, group_size)
    return {"class_name": "SelfComposedDpEvent", "count": int(steps),
            "event": {"class_name": "MixtureOfGaussiansDpEvent",
                      "standard_deviation": float(noise_multiplier),
                      "sensitivities": sens, "sampling_probs": probs}}


def group_gaussian_pld_epsilon(noise_multiplier: float, sample_rate: float, group_size: int,
                               steps: int, delta: float) -> float:
    """Patient-level epsilon of :func:`group_gaussian_event` by dp-accounting's PLD
    (both adjacencies, pessimistic discretization at :data:`PLD_INTERVAL`)."""
    _check(noise_multiplier, sample_rate, steps, delta)
    if steps < 1:
        return 0.0
    one = _group_pld(float(noise_multiplier), float(sample_rate), int(group_size))
    return float(one.self_compose(int(steps)).get_epsilon_for_delta(delta))


@functools.lru_cache(maxsize=512)
def _group_pld(z: float, q: float, k: int) -> Any:
    """One step's PLD (the costly part; composing it over steps is cheap)."""
    try:
        from dp_accounting.pld import privacy_loss_distribution as pld
    except ImportError as exc:  # pragma: no cover - the torch and test extras install it
        raise MissingExtra("PLD accounting needs dp-accounting: pip install dp-accounting"
                           ) from exc
    if q >= 1:
        return pld.from_gaussian_mechanism(z, sensitivity=float(k),
                                           value_discretization_interval=PLD_INTERVAL)
    sens, probs = group_mixture(q, k)
    return pld.from_mixture_gaussian_mechanism(
        standard_deviation=z, sensitivities=sens, sampling_probs=probs,
        value_discretization_interval=PLD_INTERVAL, log_mass_truncation_bound=-30)
