"""Privacy modes as objects: one class per mode, one registry from its wire name.

A round's privacy mode decides four things, and each :class:`PrivacyMode` owns all four,
for every runtime:

* **encode** (:meth:`PrivacyMode.encode`): a site's rows and weight -> the integers it
  masks; before that, what a site computes (:meth:`PrivacyMode.update`: the site role's
  training, ``secagg train``) or sends from its trained arrays (:meth:`PrivacyMode.reply`:
  the Flower and NVFlare runtimes, :mod:`fl.round_setup`);
* **decode** (:meth:`PrivacyMode.decode`): the sum -> the mean and its count, divided by the
  number of sites in the sum when each site adds one row (the runtimes' round setup), by
  the noisy unit count when each sampled unit adds one (the site role's distributed DP);
* **proposal** (:meth:`PrivacyMode.proposal`): what the site's policy and ledger are asked
  to admit (:func:`fl.site.core.site_proposal`, the site session's gate);
* **event** (:meth:`PrivacyMode.lone`, :meth:`PrivacyMode.released`): the DP event the
  site's ledger charges (its own noise share only when the roster is the server's word;
  the replace-one sensitivity of a runtime's one clipped row).

The registry maps the wire value (``mode`` in both :class:`fl.contribution.RoundTask` and
:class:`fl.round_setup.RoundSetup`) to the object: :func:`privacy_mode`. The three built-in
modes are :data:`dp.policy.MODES`; a new mode is one subclass and :func:`register`
(tests/fl/test_modes.py registers one from a test).

The shared part of both round descriptions, the encoding, is :class:`SumEncoding`, and its
distributed-DP parameters go to and from the wire through :func:`encoding_fields` and
:func:`read_encoding` only.

Nothing here imports torch, a runtime or the coordinator (the site imports this module).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, cast

import numpy as np
import numpy.typing as npt

from dp import (
    MODE_DISTRIBUTED,
    MODE_NONE,
    MODE_SITE,
    EncodingParams,
    PolicyRefused,
    PrivacyConfigError,
    Proposal,
    mechanisms,
)
from fl.codec import (
    DistributedCodec,
    FixedPointCodec,
    decode_weighted,
    encode_weighted,
    noisy_mean,
)
from fl.errors import FLError
from fl.input_bound import capped_weight, dp_bound, fixed_bound
from secagg import MAX_BITS, MIN_BITS
from transport import fields

if TYPE_CHECKING:
    import torch

    from fl.vector import ParameterLayout

F64 = npt.NDArray[np.float64]
U64 = npt.NDArray[np.uint64]


class ModeError(FLError, ValueError):
    """A privacy mode is unknown, or a round's rows do not fit its mode."""


# -- the shared part of a round description: the encoding ---------------------------------

ENCODING_KEYS = ("clip_norm", "scale", "bits", "noise_stddev", "rotation_seed", "mechanism",
                 "beta", "threshold")
"""The distributed-DP encoding's wire fields, in their wire order (the dimension is the
round's model size plus one count column, implied by the description)."""


@dataclass(frozen=True)
class DpSpec:
    """The public parameters of :class:`dp.encoding.EncodingParams` for one round, without
    the dimension (the runtimes' setup implies it: the model size plus one count column)."""

    clip_norm: float
    scale: float
    bits: int
    noise_stddev: float
    rotation_seed: int
    mechanism: str
    beta: float
    threshold: int

    @classmethod
    def of(cls, params: EncodingParams) -> DpSpec:
        return cls(**encoding_fields(params))

    def params(self, dim: int) -> EncodingParams:
        """The encoding of ``dim`` coordinates (``ValueError`` when out of range)."""
        return EncodingParams(dim=dim, **encoding_fields(self))


def encoding_fields(params: EncodingParams | DpSpec, *, with_dim: bool = False) -> dict[str, Any]:
    """``params`` as every round description writes them (:data:`ENCODING_KEYS` in order;
    ``with_dim``: its dimension first, as the site role's tasks carry it)."""
    values = asdict(params)
    return {key: values[key] for key in (("dim",) if with_dim else ()) + ENCODING_KEYS}


def read_encoding(raw: object, dim: int, *, error: type[ValueError], what: str,
                  with_dim: bool = False) -> EncodingParams:
    """A round's distributed-DP encoding of ``dim`` coordinates from its wire fields
    (:func:`encoding_fields`' map; ``with_dim``: its ``dim`` must be ``dim``), every field
    checked; ``error`` (the description's own error type) says which is wrong. The one
    reader of :class:`dp.EncodingParams` from the wire (the site role's task, the runtimes'
    setup, the noised feature statistics)."""
    if not isinstance(raw, Mapping):
        raise error(f"the distributed-DP encoding must be a map of {ENCODING_KEYS}")
    number = partial(fields.number, raw, error=error, what=what)
    integer = partial(fields.integer, raw, error=error, what=what)
    try:
        return EncodingParams(
            dim=integer("dim", dim, dim) if with_dim else dim,
            clip_norm=number("clip_norm", low_open=True),
            scale=number("scale", low_open=True),
            bits=integer("bits", MIN_BITS, MAX_BITS),
            noise_stddev=number("noise_stddev"),
            rotation_seed=integer("rotation_seed", 0, (1 << 63) - 1),
            mechanism=fields.text(raw, "mechanism", mechanisms.names(), error=error,
                                  what=what),
            beta=number("beta", 0.0, 0.999999),
            threshold=integer("threshold", 1, fields.MAX_ROSTER))
    except PrivacyConfigError as exc:
        raise error(f"invalid distributed-DP parameters: {exc}") from None


@dataclass(frozen=True)
class SumEncoding:
    """How a round's rows become the integers a site masks, in either description.

    ``width``: float values per row before its weight (count) column; ``sites``: the most
    summands (the fixed point's headroom); ``bits``/``frac_bits``: the fixed point's;
    ``params``: a noised mode's integer encoding; ``max_weight``: its site weights' bound;
    ``per_unit``: each sampled unit adds one row of its gradient (the site role) rather than
    each site one row of its update; ``norm_bound``: input validation's L2 bound."""

    width: int
    sites: int
    bits: int = 64
    frac_bits: int = 24
    params: EncodingParams | None = None
    max_weight: float = 1.0
    per_unit: bool = False
    norm_bound: float | None = None


class Rows(NamedTuple):
    """What a site encodes: its rows (one, or one per sampled unit), its weight and the
    count it reports."""

    rows: F64
    weight: float
    counted: int


# -- what the modes read of a round and of a site ------------------------------------------

class Trainer(Protocol):
    """What a site needs to contribute: :class:`fl.site.training.Site` and
    :class:`fl.api.PrivateSite`."""

    @property
    def num_records(self) -> int: ...

    def fedavg_update(self, model: torch.nn.Module, layout: ParameterLayout, *, epochs: int,
                      lr: float, batch_size: int, mu: float = 0.0, seed: int = 0) -> F64: ...

    def site_dp_update(self, model: torch.nn.Module, layout: ParameterLayout, *,
                       noise_multiplier: float, clip_norm: float, sample_rate: float,
                       steps: int, lr: float, unit: str = "patient",
                       expected_batch: float | None = None) -> F64: ...

    def unit_gradients(self, model: torch.nn.Module, *, sample_rate: float,
                       unit: str = "patient") -> F64: ...


class Task(Protocol):
    """What a mode reads of the site role's task (:class:`fl.contribution.RoundTask`)."""

    @property
    def round(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def unit(self) -> str: ...
    @property
    def lr(self) -> float: ...
    @property
    def local_epochs(self) -> int: ...
    @property
    def local_steps(self) -> int | None: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def fedprox_mu(self) -> float: ...
    @property
    def noise_multiplier(self) -> float: ...
    @property
    def clip_norm(self) -> float: ...
    @property
    def sample_rate(self) -> float: ...
    @property
    def steps(self) -> int: ...
    @property
    def max_units(self) -> int | None: ...
    @property
    def expected_batch(self) -> float | None: ...
    @property
    def target_quantile(self) -> float | None: ...
    @property
    def count_stddev(self) -> float | None: ...
    def weight_of(self, site_id: int) -> float: ...


class Release(Protocol):
    """What a round's task tells a site's policy, whoever sent it: a
    :class:`fl.contribution.RoundTask`, a :class:`fl.site.core.SecureSum` or a
    :class:`fl.site.private_scaler.ScalerPlan`. ``unit``, ``kind`` and ``count_stddev`` are
    read when present (default ``patient``, ``train``, None)."""

    @property
    def mode(self) -> str: ...

    @property
    def sample_rate(self) -> float: ...

    @property
    def params(self) -> EncodingParams | None: ...


class SiteDpRelease(Release, Protocol):
    """A site-mode task (``mode == "site"``): DP-SGD at the site."""

    @property
    def steps(self) -> int: ...

    @property
    def noise_multiplier(self) -> float: ...

    @property
    def clip_norm(self) -> float: ...


class Grouping(Protocol):
    @property
    def plan(self) -> Any: ...
    @property
    def groups(self) -> Any: ...


def local_seed(seed: int, round_number: int, site_id: int) -> int:
    """The seed of site ``site_id``'s shuffles in round ``round_number`` (public)."""
    return (seed * 1_000_003 + round_number * 1009 + site_id) % (1 << 62)


def cap_units(rows: F64, max_units: int | None) -> F64:
    """At most ``max_units`` of a round's sampled units (the federation's bound, so the sum
    cannot wrap): a larger sample keeps a uniformly random ``max_units`` of its rows (secret
    coins), never a refusal -- whether a site takes part must not depend on how many of its
    patients were sampled (docs/privacy.md section 1, "After the privacy gate")."""
    if max_units is None or len(rows) <= max_units:
        return rows
    keep = np.random.default_rng(int.from_bytes(os.urandom(16), "big")).choice(
        len(rows), size=max_units, replace=False)
    return rows[np.sort(keep)]


def own_share(params: EncodingParams) -> EncodingParams:
    """``params`` as a site counts them when the coordinator alone picks the roster: its own
    noise share only (calibration threshold 1; :meth:`PrivacyMode.lone`)."""
    return replace(params, threshold=1)


def counted_count_stddev(count_stddev: float, threshold: int, counted: int) -> float:
    """The central stddev of a round's clip-count noise (adaptive clipping) calibrated to
    ``threshold`` equal shares, as counted when only ``counted`` of them are certain (1: the
    site's own share)."""
    return count_stddev / math.sqrt(threshold / counted)


# -- the modes ------------------------------------------------------------------------------

class PrivacyMode:
    """One privacy mode (module docstring). Class attributes say what a round description in
    this mode carries: ``noised`` (a distributed-DP integer encoding, :class:`SumEncoding`'s
    ``params``; metrics cannot ride along), ``in_setup`` (the runtimes' round setup runs it),
    ``relative`` (a runtime's reply is encoded as its arrays minus the arrays sent),
    ``idp`` (the unit ``patient-idp`` is this mode's), ``validated_rows`` (input validation
    of a plain weighted row, the site role's ``norm_bound``)."""

    name: ClassVar[str]
    noised: ClassVar[bool] = False
    in_setup: ClassVar[bool] = True
    relative: ClassVar[bool] = False
    idp: ClassVar[bool] = False
    validated_rows: ClassVar[bool] = False

    # encode and decode -------------------------------------------------------------------
    def codec(self, enc: SumEncoding) -> FixedPointCodec | DistributedCodec:
        """The codec of ``enc`` (``ValueError`` when it cannot hold the round)."""
        return FixedPointCodec(enc.width + 1, bits=enc.bits, frac_bits=enc.frac_bits,
                               max_summands=enc.sites)

    def encoded_dim(self, enc: SumEncoding) -> int:
        return self.codec(enc).encoded_dim

    def encode(self, enc: SumEncoding, rows: F64, weight: float) -> U64:
        """A fixed-point mode's row ``[w x, w]`` (``w`` lowered to input validation's bound
        when there is one)."""
        codec = self.codec(enc)
        assert isinstance(codec, FixedPointCodec)
        row = np.asarray(rows, dtype=np.float64).reshape(-1)
        if enc.norm_bound is not None:
            weight = capped_weight(weight, row, enc.norm_bound)
        return np.asarray(encode_weighted(codec, row, weight), dtype=np.uint64)

    def decode(self, enc: SumEncoding, total: U64, included: int) -> tuple[F64, float]:
        """The weighted mean of the summed rows and the summed weight."""
        codec = self.codec(enc)
        assert isinstance(codec, FixedPointCodec)
        return decode_weighted(codec, total)

    def bound(self, enc: SumEncoding) -> tuple[int | None, int | None]:
        """``secagg.Config``'s ``(norm_bound, weight_index)`` for ``enc`` (None, None
        without input validation): the fixed-point row's integer bound, its weight (last)
        proved non-negative (docs/protocol.md 10.7)."""
        if enc.norm_bound is None:
            return None, None
        return fixed_bound(enc.norm_bound, enc.frac_bits, enc.width + 1), enc.width

    # what a site computes ---------------------------------------------------------------
    def update(self, trainer: Trainer, model: torch.nn.Module, layout: ParameterLayout,
               task: Task, site_id: int) -> Rows:
        """The site role's rows for ``task`` (plain FedAvg/FedProx training, weighted by
        the site's record count)."""
        steps = {} if task.local_steps is None else {"steps": task.local_steps}
        delta = trainer.fedavg_update(model, layout, epochs=task.local_epochs, lr=task.lr,
                                      batch_size=task.batch_size, mu=task.fedprox_mu,
                                      seed=local_seed(task.seed, task.round, site_id), **steps)
        return Rows(delta, trainer.num_records, trainer.num_records)

    def reply(self, arrays: F64, metrics: F64, weight: float, sent: F64 | None) -> Rows:
        """A runtime's trained reply as this mode encodes it (the arrays, then the averaged
        metrics, weighted by the reply's positive weight)."""
        if not (np.isfinite(weight) and weight > 0):
            raise ModeError(f"the reply's weight must be a positive number, got {weight!r}")
        row = np.concatenate([arrays, metrics]) if metrics.size else arrays
        return Rows(row, weight, 1)

    # what the site's ledger is asked --------------------------------------------------
    def proposal(self, task: Release, *, secagg_threshold: int, label: str,
                 idp: Grouping | None) -> Proposal:
        """An exact sum."""
        return Proposal.exact(getattr(task, "kind", "train"),
                              secagg_threshold=secagg_threshold, label=label)

    def lone(self, task: Release, proposal: Proposal) -> Proposal:
        """``proposal`` as a site counts it when the roster is the server's word (a noised
        mode: its own noise share only); unchanged for a mode without shared noise."""
        return proposal

    def released(self, params: EncodingParams | None) -> EncodingParams | None:
        """The encoding a runtime's round (one clipped row per node) is charged at; None
        for an exact sum."""
        return None


class NoDp(PrivacyMode):
    """``none``: the exact weighted FedAvg sum ``[n_k delta_k, n_k]`` (fixed point)."""

    name = MODE_NONE
    validated_rows = True


class SiteDp(PrivacyMode):
    """``site``: the update is DP-SGD-private at the site (Opacus) and summed uniformly
    ``[delta_k, 1]``: an exact record count is not private, so the count coordinate carries
    only the number of sites. The runtimes' setup cannot ask it (per-patient training is
    the site role's)."""

    name = MODE_SITE
    in_setup = False
    idp = True

    def update(self, trainer: Trainer, model: torch.nn.Module, layout: ParameterLayout,
               task: Task, site_id: int) -> Rows:
        adaptive = ({} if task.count_stddev is None else {
            "target_quantile": task.target_quantile, "count_stddev": task.count_stddev})
        delta = trainer.site_dp_update(
            model, layout, noise_multiplier=task.noise_multiplier, clip_norm=task.clip_norm,
            sample_rate=task.sample_rate, steps=task.steps, lr=task.lr, unit=task.unit,
            expected_batch=task.expected_batch, **adaptive,
            **({"round_number": task.round} if task.unit == "patient-idp" else {}))
        return Rows(delta, 1.0, 1)  # uniform: a site's count is not protected

    def proposal(self, task: Release, *, secagg_threshold: int, label: str,
                 idp: Grouping | None) -> Proposal:
        """DP-SGD at the site; under ``patient-idp`` the site's *own* plan's rate groups,
        each charged its own cost (refused without one)."""
        task = cast(SiteDpRelease, task)
        unit = getattr(task, "unit", "patient")
        if unit == "patient-idp":
            if idp is None:
                raise PolicyRefused("unit", "the round is computed per patient by individual "
                                    "sampling rates (patient-idp); this site is not "
                                    "configured for it (its operator's --unit)")
            return Proposal.site_idp(idp.plan, steps=task.steps,
                                     secagg_threshold=secagg_threshold, label=label,
                                     patients=idp.groups.digest())
        return Proposal.site_dp(noise_multiplier=task.noise_multiplier,
                                sample_rate=task.sample_rate, steps=task.steps,
                                clip_norm=task.clip_norm, secagg_threshold=secagg_threshold,
                                count_stddev=getattr(task, "count_stddev", None),
                                label=label, unit=unit)


class DistributedDp(PrivacyMode):
    """``distributed``: clipped rows ``[g clipped, gamma]`` through the integer encoder with
    the site's noise share (:class:`fl.codec.DistributedCodec`): per sampled unit in the
    site role, one row of the update (arrays minus those sent) per node in the runtimes."""

    name = MODE_DISTRIBUTED
    noised = True
    relative = True

    def codec(self, enc: SumEncoding) -> DistributedCodec:
        if enc.params is None:
            raise ModeError("a distributed-DP round carries its encoding parameters")
        return DistributedCodec(enc.params, max_weight=enc.max_weight)

    def encode(self, enc: SumEncoding, rows: F64, weight: float) -> U64:
        return self.codec(enc).encode(rows, weight=weight)

    def decode(self, enc: SumEncoding, total: U64, included: int) -> tuple[F64, float]:
        """Per unit (the site role): minus the noisy mean gradient over the noisy unit count
        (floored at one); per node (the runtimes): the noisy sum over ``included``, the
        number of nodes in the sum (public to the server: dividing by the noisy count, near
        zero when few nodes carry much noise, would only add error). With the noisy count."""
        codec = self.codec(enc)
        update = np.asarray(total)[:codec.encoded_dim]  # a clip count may follow it
        if enc.per_unit:
            mean_gradient, count = noisy_mean(codec, update, included)
            return -mean_gradient, count
        sums, count = codec.decode(update, included)
        return sums / max(included, 1), count

    def bound(self, enc: SumEncoding) -> tuple[int | None, int | None]:
        """The clip plus the noise share (a rotated row has no plain weight coordinate)."""
        if enc.norm_bound is None:
            return None, None
        return dp_bound(self.codec(enc).params), None

    def update(self, trainer: Trainer, model: torch.nn.Module, layout: ParameterLayout,
               task: Task, site_id: int) -> Rows:
        weight = task.weight_of(site_id)  # refused before the data is touched
        rows = cap_units(trainer.unit_gradients(model, sample_rate=task.sample_rate,
                                                unit=task.unit), task.max_units)
        return Rows(rows, weight, len(rows))

    def reply(self, arrays: F64, metrics: F64, weight: float, sent: F64 | None) -> Rows:
        if sent is None or sent.shape != arrays.shape:
            raise ModeError("a distributed-DP round needs the arrays the server sent, in "
                            "the reply's layout")
        return Rows((arrays - sent)[None, :], 1.0, 1)

    def proposal(self, task: Release, *, secagg_threshold: int, label: str,
                 idp: Grouping | None) -> Proposal:
        """One noisy secure sum (a round, or the noised feature statistics, kind scaler)."""
        return Proposal.distributed(_params(task), sample_rate=task.sample_rate,
                                    secagg_threshold=secagg_threshold, label=label,
                                    kind=getattr(task, "kind", "train"),
                                    unit=getattr(task, "unit", "patient"),
                                    count_stddev=getattr(task, "count_stddev", None))

    def lone(self, task: Release, proposal: Proposal) -> Proposal:
        """The coordinator may fill the round with sites it simulates (zero noise), so only
        this site's own share of the noise is certain: the event and noise multiplier of
        calibration threshold 1 (the policy's other rules still see the proposed
        thresholds)."""
        count = getattr(task, "count_stddev", None)
        params = _params(task)
        alone = Proposal.distributed(own_share(params), sample_rate=task.sample_rate,
                                     secagg_threshold=proposal.secagg_threshold,
                                     label=proposal.label,
                                     count_stddev=None if count is None else
                                     counted_count_stddev(count, params.threshold, 1))
        return replace(proposal, noise_multiplier=alone.noise_multiplier, event=alone.event,
                       requested_noise_multiplier=proposal.noise_multiplier)

    def released(self, params: EncodingParams | None) -> EncodingParams | None:
        """A node's whole update is one clipped row: one patient (or record) can move it
        anywhere in the clip ball, so it is charged at the replace-one sensitivity (twice
        the row's bound), not the add/remove one of the site role's per-unit rows."""
        if params is None:
            raise ModeError("a distributed-DP round carries its encoding parameters")
        return params.replace_one()


def _params(task: Release) -> EncodingParams:
    """A noised task's encoding (a task without one is malformed)."""
    if task.params is None:
        raise PrivacyConfigError("a distributed task carries its encoding (params)")
    return task.params


# -- the registry ---------------------------------------------------------------------------

_REGISTRY: dict[str, PrivacyMode] = {}


def register(mode: PrivacyMode) -> PrivacyMode:
    """Make ``mode`` known by its ``name`` to both round descriptions (a name taken by
    another mode is a ``ValueError``)."""
    known = _REGISTRY.get(mode.name)
    if known is not None and known is not mode:
        raise ValueError(f"privacy mode {mode.name!r} is already registered")
    _REGISTRY[mode.name] = mode
    return mode


def unregister(name: str) -> None:
    """Forget a mode :func:`register` added (a built-in mode stays)."""
    if name in BUILT_IN:
        raise ValueError(f"privacy mode {name!r} is built in")
    _REGISTRY.pop(name, None)


def mode_names(*, in_setup: bool = False) -> tuple[str, ...]:
    """The registered modes' wire names (``in_setup``: those a runtime's setup runs)."""
    return tuple(name for name, mode in _REGISTRY.items() if mode.in_setup or not in_setup)


def privacy_mode(name: str, error: Callable[[str], Exception] = ModeError) -> PrivacyMode:
    """The mode registered as ``name``; ``error(message)`` is raised for an unknown one."""
    mode = _REGISTRY.get(name)
    if mode is None:
        raise error(f"privacy mode {name!r}: use one of {mode_names()}")
    return mode


BUILT_IN = tuple(register(mode).name for mode in (NoDp(), SiteDp(), DistributedDp()))
"""The built-in modes, :data:`dp.policy.MODES` in its order."""
