"""The distributed-DP encoding on the wire: the one reader (:func:`read_encoding`) and the
one writer (:func:`encoding_fields`) of a round's :class:`dp.EncodingParams`, for the site
role's task, the runtimes' setup and the noised feature statistics."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from dp import EncodingParams, PrivacyConfigError, mechanisms
from secagg import MAX_BITS, MIN_BITS
from transport import fields

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
