"""The privacy-mode interface (:class:`PrivacyMode`, by default the exact weighted sum), what
it reads of a round and a site, and the shared part of both round descriptions
(:class:`SumEncoding`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from dp import EncodingParams, Proposal
from fl.codec import (
    DistributedCodec,
    FixedPointCodec,
    UInt,
    decode_weighted,
    encode_weighted,
)
from fl.errors import FLError
from fl.input_bound import capped_weight, fixed_bound

if TYPE_CHECKING:
    import torch

    from fl.vector import ParameterLayout

F64 = npt.NDArray[np.float64]
U64 = npt.NDArray[np.uint64]


class ModeError(FLError, ValueError):
    """A privacy mode is unknown, or a round's rows do not fit its mode."""


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

    def encode(self, enc: SumEncoding, rows: F64, weight: float) -> UInt:
        """A fixed-point mode's row ``[w x, w]`` (``w`` lowered to input validation's bound
        when there is one)."""
        codec = self.codec(enc)
        assert isinstance(codec, FixedPointCodec)
        row = np.asarray(rows, dtype=np.float64).reshape(-1)
        if enc.norm_bound is not None:
            weight = capped_weight(weight, row, enc.norm_bound)
        return encode_weighted(codec, row, weight)  # in the sum's natural width

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
