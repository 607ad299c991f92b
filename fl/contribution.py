"""What a site contributes to one round, per privacy mode, and how the sum is decoded.

Written once and used by every role: the simulated coordinator (:mod:`fl.coordinator`)
computes its sites' inputs with :func:`site_input`, and so does a hospital's own process in
the multi-machine mode (:mod:`fl.remote`); both coordinators decode with :func:`decoder`.
What a round asks of a site is one public :class:`RoundTask` (the multi-machine coordinator
sends it in the round's blob, :meth:`RoundTask.to_wire` / :meth:`RoundTask.from_wire`), so
the privacy arithmetic cannot drift between the two modes.

Per mode, what a site computes and encodes and how the sum is decoded is the mode's object
(:mod:`fl.modes`: :meth:`~fl.modes.PrivacyMode.update`, ``encode``, ``decode``); this module
adds SCAFFOLD's control variates (a strategy of mode ``none``) and distributed DP's clip
count (adaptive clipping), which travel in the same sum.

The feature scaler's secure sum (:func:`scaler_input`, :func:`scaler_from_sum`) lives here
for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any, TypedDict

import numpy as np
import numpy.typing as npt
import torch

from dp import UNITS, EncodingParams, QuantileClipper
from fl.codec import DistributedCodec, FixedPointCodec, decode_weighted, encode_weighted
from fl.modes import (
    PrivacyMode,
    SumEncoding,
    Trainer,
    encoding_fields,
    local_seed,
    mode_names,
    privacy_mode,
    read_encoding,
)
from fl.plan.privacy import DistributedPlan, Plan, SiteDpPlan
from fl.settings import STRATEGIES, TrainSettings
from fl.site.training import Scaler
from fl.vector import ParameterLayout
from secagg import MAX_BITS, MIN_BITS
from transport import fields

__all__ = ["Contribution", "RoundTask", "TaskError", "Trainer", "decoder", "local_seed",
           "round_task", "scaler_from_sum", "scaler_input", "secagg_bound", "site_input"]

from .errors import FLError

F64 = npt.NDArray[np.float64]
U64 = npt.NDArray[np.uint64]
SCALER_FRAC_BITS = 12
Decoder = Callable[[U64, int], tuple[F64, float]]


class TaskError(FLError, ValueError):
    """A round task field is missing or out of range: the site refuses the round."""


_int = partial(fields.integer, error=TaskError, what="task field")
_float = partial(fields.number, error=TaskError, what="task field")
_str = partial(fields.text, error=TaskError, what="task field")


@dataclass(frozen=True)
class RoundTask:
    """Everything public a round asks of a site (the same object in every role of
    ``secagg train``; the Flower and NVFlare runtimes' round is a
    :class:`fl.round_setup.RoundSetup`, in the same privacy-mode vocabulary)."""

    mode: str
    """The round's privacy mode: a registered :class:`fl.modes.PrivacyMode`'s name (the
    built-in ones are :data:`dp.policy.MODES`)."""
    round: int
    cohort: int
    """Sites in the cohort: the fixed-point headroom of the sum."""
    seed: int
    unit: str = "patient"
    lr: float = 0.1
    local_epochs: int = 1
    batch_size: int = 32
    fedprox_mu: float = 0.0
    noise_multiplier: float = 0.0
    clip_norm: float = 1.0
    sample_rate: float = 1.0
    steps: int = 1
    params: EncodingParams | None = None
    """Distributed DP: the round's integer encoding (its public rotation included)."""
    max_units: int | None = None
    """Distributed DP: the public bound on a site's sampled units the modulus was sized for."""
    target_quantile: float | None = None
    count_stddev: float | None = None
    """Site DP with private adaptive clipping (Andrew et al. 2021): the clip's target
    quantile and the noise of the clip count (accounted jointly, dp.budget.GaussianRound)."""
    expected_batch: float | None = None
    """Site DP: the operator's declared expected units per DP-SGD step, the public figure
    the noised sum is divided by (None: the sum); never a site's own count."""
    strategy: str = "fedavg"
    """``scaffold``: the site also returns its control variate's delta (fl/strategies.py)."""
    local_steps: int | None = None
    """Mode ``none``: local minibatch updates instead of ``local_epochs`` passes."""
    plan_steps: int | None = None
    """``unit="patient-idp"``: the run's planned DP-SGD steps (rounds x steps), which each
    site plans its own rate groups for (fl/site/idp.py); the site's ledger enforces the targets
    whatever this says."""
    max_weight: float | None = None
    weights: tuple[tuple[int, float], ...] | None = None
    """Distributed DP with heterogeneity-aware site weights (:mod:`dp.site_weights`): each
    site's weight, computed from the DP releases only, at most ``max_weight``; the encoding's
    clip is ``max_weight`` times the rows' clip (:class:`fl.codec.DistributedCodec`)."""
    norm_bound: float | None = None
    """Input validation (``--norm-bound``, mode ``none`` with FedAvg or FedProx): each site
    proves in zero knowledge that its row ``[n x, n]`` has L2 norm at most this bound, its
    weight non-negative (docs/protocol.md 10, 10.7); :func:`secagg_bound` is its integer
    form."""

    @property
    def bits(self) -> int:
        return self.params.bits if self.params is not None else 64

    @property
    def clip_count(self) -> bool:
        """Distributed DP with adaptive clipping: the clip count travels in the same sum,
        one coordinate after the update's encoding."""
        return self.params is not None and self.count_stddev is not None

    @property
    def privacy(self) -> PrivacyMode:
        """The round's privacy mode (:mod:`fl.modes`)."""
        return privacy_mode(self.mode, TaskError)

    def encoding(self, model_dim: int) -> SumEncoding:
        """How this round's rows become the integers a site masks (a model of
        ``model_dim`` parameters): 64-bit fixed point with headroom for the cohort, or the
        noised mode's integer encoding, one row per sampled unit."""
        return SumEncoding(width=model_dim, sites=self.cohort, params=self.params,
                           max_weight=self.max_weight or 1.0, per_unit=True,
                           norm_bound=self.norm_bound)

    def encoded_dim(self, model_dim: int) -> int:
        if self.params is None:  # SCAFFOLD: [delta_y, delta_c, n] (site_input)
            return (2 if self.strategy == "scaffold" else 1) * model_dim + 1
        return self.params.encoded_dim + int(self.clip_count)

    def codec(self) -> DistributedCodec:
        """A distributed round's codec (the encoding and the site weights' bound)."""
        assert self.params is not None
        return DistributedCodec(self.params, max_weight=self.max_weight or 1.0)

    def clipper(self) -> QuantileClipper:
        """A distributed round's adaptive-clipping count, on the codec's update clip."""
        assert self.params is not None and self.count_stddev is not None
        return QuantileClipper(clip_norm=self.codec().update_clip,
                               target_quantile=self.target_quantile or 0.5,
                               count_stddev=self.count_stddev,
                               threshold=self.params.threshold, bits=self.params.bits)

    def weight_of(self, site_id: int) -> float:
        """This site's weight (1 without site weights); a site the task does not weigh,
        or a weight above ``max_weight``, is refused."""
        if self.weights is None:
            return 1.0
        weight = dict(self.weights).get(site_id)
        if weight is None:
            raise TaskError(f"the round's site weights name no weight for site {site_id}")
        if not 0 < weight <= (self.max_weight or 1.0):
            raise TaskError(f"the round gives site {site_id} weight {weight:g}, above the "
                            f"max_weight {self.max_weight or 1.0:g} its noise is calibrated "
                            "to: refused")
        return weight

    def to_wire(self) -> dict[str, Any]:
        body = {k: v for k, v in asdict(self).items() if v is not None}
        body["bits"] = self.bits  # the secagg modulus the site's client is configured with
        if self.params is not None:
            body["params"] = encoding_fields(self.params, with_dim=True)
        return body

    @classmethod
    def from_wire(cls, body: Mapping[str, Any], model_dim: int) -> RoundTask:
        """Validate every field (a hostile coordinator makes a site refuse, never crash)."""
        privacy = privacy_mode(_str(body, "mode", mode_names()), TaskError)
        mode = privacy.name
        params = None
        max_units = None
        if privacy.noised:
            params = read_encoding(body.get("params"), model_dim + 1, error=TaskError,
                                   what="task field", with_dim=True)
            max_units = _int(body, "max_units", 1, 1 << 40)
        weighting = _weights(body) if privacy.noised else {}
        if _int(body, "bits", MIN_BITS, MAX_BITS) != (64 if params is None else params.bits):
            raise TaskError("task field 'bits' differs from the encoding's modulus")
        unit = _str(body, "unit", UNITS)
        plan_steps = None
        if unit == "patient-idp":
            if not privacy.idp:
                raise TaskError("unit patient-idp is a site-mode unit (docs/patient_privacy.md)")
            plan_steps = _int(body, "plan_steps", 1, 1 << 24)
        return cls(
            mode=mode, round=_int(body, "round", 0, 1 << 31),
            cohort=_int(body, "cohort", 2, 1 << 16),
            seed=_int(body, "seed", -(1 << 62), 1 << 62), unit=unit,
            lr=_float(body, "lr", low_open=True),
            local_epochs=_int(body, "local_epochs", 1, 10_000),
            batch_size=_int(body, "batch_size", 1, 1 << 24),
            fedprox_mu=_float(body, "fedprox_mu"),
            noise_multiplier=_float(body, "noise_multiplier"),
            clip_norm=_float(body, "clip_norm", low_open=True),
            sample_rate=_float(body, "sample_rate", 0, 1, low_open=True),
            steps=_int(body, "steps", 1, 1 << 20), params=params, max_units=max_units,
            plan_steps=plan_steps,
            expected_batch=(_float(body, "expected_batch", 0, 1 << 40, low_open=True)
                            if body.get("expected_batch") is not None else None),
            strategy=_str(body, "strategy", STRATEGIES) if "strategy" in body else "fedavg",
            local_steps=(_int(body, "local_steps", 1, 1 << 24)
                         if body.get("local_steps") is not None else None),
            norm_bound=_norm_bound(body, privacy),
            **_adaptive(body), **weighting)


def _norm_bound(body: Mapping[str, Any], privacy: PrivacyMode) -> float | None:
    if body.get("norm_bound") is None:
        return None
    if not privacy.validated_rows or body.get("strategy", "fedavg") == "scaffold":
        raise TaskError("task field 'norm_bound' is for mode none with FedAvg or FedProx "
                        "(docs/protocol.md 10)")
    return _float(body, "norm_bound", 0, 1 << 40, low_open=True)


SecaggBound = tuple[int | None, int | None]
"""``secagg.Config``'s ``(norm_bound, weight_index)``; ``(None, None)``: no validation."""


def secagg_bound(body: Mapping[str, Any], dim: int) -> SecaggBound:
    """``secagg.Config``'s ``norm_bound`` and ``weight_index`` for a training task's wire
    map (``RoundTask.to_wire``) and its encoded length ``dim`` (None, None without one): the
    row ``[n x, n]`` in 64-bit fixed point, its weight last (:func:`fl.input_bound.fixed_bound`,
    the one place of that arithmetic). The coordinator and every site call this on the same
    public map, so both sides' ``Config`` (and session id) agree."""
    if body.get("norm_bound") is None:
        return None, None
    privacy = privacy_mode(_str(body, "mode", mode_names()), TaskError)
    bound = _norm_bound(body, privacy)
    try:
        return privacy.bound(SumEncoding(width=dim - 1, sites=1, norm_bound=bound))
    except ValueError as exc:
        raise TaskError(f"norm_bound: {exc}") from None


def round_task(settings: TrainSettings, plan: Plan, round_number: int, cohort: int, *,
               max_units: int | None = None, clip_norm: float | None = None,
               weights: Mapping[int, float] | None = None) -> RoundTask:
    """Round ``round_number``'s task under ``plan`` (the coordinator's side, both modes);
    distributed DP: ``clip_norm`` the adaptive clip's current value, ``weights`` the site
    weights from the DP releases (:mod:`dp.site_weights`)."""
    s = settings
    task = RoundTask(mode=plan.mode, round=round_number, cohort=cohort, seed=s.seed,
                     unit=s.unit, lr=s.lr, local_epochs=s.local_epochs,
                     batch_size=s.batch_size, fedprox_mu=s.fedprox_mu,
                     clip_norm=s.clip_norm, sample_rate=s.sample_rate,
                     strategy=s.strategy, local_steps=s.local_steps,
                     norm_bound=s.norm_bound)
    if isinstance(plan, SiteDpPlan):
        return replace(task, noise_multiplier=plan.noise_multiplier,
                        clip_norm=plan.clip_norm, sample_rate=plan.sample_rate,
                        steps=plan.steps, target_quantile=plan.target_quantile,
                        count_stddev=plan.count_stddev, expected_batch=s.expected_batch,
                        plan_steps=s.rounds * plan.steps if s.unit == "patient-idp" else None)
    if isinstance(plan, DistributedPlan):
        return replace(task, params=plan.codec(s.seed, round_number, clip_norm).params,
                       sample_rate=plan.sample_rate, max_units=max_units,
                       clip_norm=clip_norm or plan.clip_norm,
                       target_quantile=plan.target_quantile, count_stddev=plan.count_stddev,
                       max_weight=None if weights is None else plan.max_weight,
                       weights=None if weights is None else tuple(sorted(weights.items())))
    return task


@dataclass(frozen=True)
class Contribution:
    """A site's secure-aggregation input and the count it carries (for reports)."""

    vector: U64
    count: int
    control: F64 | None = None
    """SCAFFOLD: the site's next control variate, adopted if the round's sum includes it."""


def site_input(trainer: Trainer, model: torch.nn.Module, task: RoundTask,
               site_id: int, control: F64 | None = None) -> Contribution:
    """Site ``site_id``'s input for ``task`` at the global ``model`` (left unchanged): its
    privacy mode's rows (:meth:`fl.modes.PrivacyMode.update`), encoded by the mode;
    ``control``: SCAFFOLD's server control variate (``task.strategy == "scaffold"``)."""
    layout = ParameterLayout.of(model)
    if task.strategy == "scaffold":
        return _scaffold_input(trainer, model, layout, task, site_id, control)
    privacy = task.privacy
    update = privacy.update(trainer, model, layout, task, site_id)
    vector = privacy.encode(task.encoding(layout.size), update.rows, update.weight)
    if task.clip_count:  # [||g_p|| <= C] per unit, with its noise share, in the same sum
        rows = update.rows
        norms = np.linalg.norm(rows, axis=1) if len(rows) else np.zeros(0)
        vector = np.concatenate([vector, task.clipper().site_share(norms)])
    return Contribution(vector, update.counted)


def _scaffold_input(trainer: Trainer, model: torch.nn.Module, layout: ParameterLayout,
                    task: RoundTask, site_id: int, control: F64 | None) -> Contribution:
    """SCAFFOLD (mode none): ``[n_k delta_y, n_k delta_c, n_k]`` and the site's next
    control variate."""
    if control is None or not hasattr(trainer, "scaffold_update"):  # a remote site
        raise TaskError("a SCAFFOLD round needs the server's control variate and a site "
                        "that keeps its own (fl.site.Site: the simulated sites and the "
                        "site role)")
    own = getattr(trainer, "control", None)
    own = np.zeros(layout.size) if own is None else own
    delta, new_control = trainer.scaffold_update(
        model, layout, server_control=control, epochs=task.local_epochs, lr=task.lr,
        batch_size=task.batch_size, seed=local_seed(task.seed, task.round, site_id),
        steps=task.local_steps)
    weight = trainer.num_records
    codec = FixedPointCodec(2 * layout.size + 1, bits=64, max_summands=task.cohort)
    values = np.concatenate([delta, new_control - own])  # [delta_y, delta_c], weighted
    return Contribution(encode_weighted(codec, values, weight), weight, new_control)


def decoder(task: RoundTask, model_dim: int) -> Decoder:
    """``(sum, number of included sites) -> (averaged update, count)`` for ``task``: its
    privacy mode's decode (:meth:`fl.modes.PrivacyMode.decode`)."""
    if task.strategy == "scaffold":  # [delta_y, delta_c]
        fixed = FixedPointCodec(2 * model_dim + 1, bits=64, max_summands=task.cohort)
        return lambda total, included: decode_weighted(fixed, total)
    return partial(task.privacy.decode, task.encoding(model_dim))


# -- the feature scaler's secure sum -------------------------------------------------------
def scaler_codec(num_features: int, sites: int) -> FixedPointCodec:
    return FixedPointCodec(2 * num_features + 1, bits=64, frac_bits=SCALER_FRAC_BITS,
                           max_summands=sites)


def scaler_input(feature_sums: F64, sites: int) -> U64:
    """A site's ``[sum x, sum x^2, n]`` (:meth:`fl.site.training.Site.feature_sums`), encoded."""
    return scaler_codec((len(feature_sums) - 1) // 2, sites).encode(feature_sums)


def scaler_from_sum(total: U64, num_features: int, sites: int) -> Scaler:
    """Federation-wide mean and std from the secure sum of the sites' feature sums."""
    sums = scaler_codec(num_features, sites).decode(total)
    f = num_features
    n = max(sums[-1], 1.0)
    mean = sums[:f] / n
    var = np.maximum(sums[f:2 * f] / n - mean**2, 0.0)
    return Scaler(mean, np.where(var > 1e-12, np.sqrt(var), 1.0))


# -- task field validation ----------------------------------------------------------------
def adapt_clip(clipper: QuantileClipper, total: U64, included: int, units: float) -> float:
    """Adaptive clipping's step from a distributed round's sum: the noised count is its last
    coordinate (:meth:`RoundTask.encoded_dim`), ``units`` the round's noised unit count
    (post-processing of releases). Returns the next clip."""
    return clipper.update(np.asarray(total, dtype=np.uint64)[-1:], included, units=units)


def _weights(body: Mapping[str, Any]) -> dict[str, Any]:
    """Site weights: ``max_weight`` and ``[[site, weight], ...]``, both or neither; every
    weight in (0, max_weight]."""
    if body.get("weights") is None and body.get("max_weight") is None:
        return {}
    top = _float(body, "max_weight", 0, 1e6, low_open=True)
    raw = body.get("weights")
    if not isinstance(raw, (list, tuple)) or not 1 <= len(raw) <= 1 << 16:
        raise TaskError("task field 'weights' must be a list of [site, weight] pairs")
    pairs = []
    for item in raw:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise TaskError("task field 'weights' must be a list of [site, weight] pairs")
        named = {"site": item[0], "weight": item[1]}
        weight = _float(named, "weight", 0, top, low_open=True)
        pairs.append((_int(named, "site", 1, 1 << 16), weight))
    if len({site for site, _ in pairs}) != len(pairs):
        raise TaskError("task field 'weights' names a site twice")
    return {"max_weight": top, "weights": tuple(sorted(pairs))}


class _Adaptive(TypedDict, total=False):
    target_quantile: float
    count_stddev: float


def _adaptive(body: Mapping[str, Any]) -> _Adaptive:
    """Adaptive clipping's two fields: both or neither."""
    if body.get("target_quantile") is None and body.get("count_stddev") is None:
        return {}
    quantile = _float(body, "target_quantile", 0, 1, low_open=True)
    if quantile >= 1:
        raise TaskError("task field 'target_quantile' must be below 1")
    return {"target_quantile": quantile,
            "count_stddev": _float(body, "count_stddev", low_open=True)}
