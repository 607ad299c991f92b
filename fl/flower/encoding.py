"""A Flower train reply <-> the ``uint64`` vector a node hands secure aggregation.

Both sides call these functions, so node and server cannot disagree on the layout:

* ``fixed``: :class:`fl.codec.FixedPointCodec` over ``[w * arrays, w * metrics, w]`` with
  ``w`` the reply's weight (``num-examples``): the server learns only
  ``sum w * arrays``, ``sum w * metrics`` and ``sum w``, i.e. the weighted averages FedAvg
  computes, with the sample counts summed securely too.
* ``ddp``: :class:`fl.codec.DistributedCodec` over one row ``[delta clipped, gamma]`` per
  node, ``delta`` = reply arrays minus the arrays the server sent, with the node's share of
  integer noise (:mod:`dp.encoding`, :mod:`dp.distributed`): the sum decodes to the noisy sum
  of clipped updates and a noisy count of nodes (client-level distributed DP).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from dp.encoding import EncodingParams
from fl.codec import (
    DistributedCodec,
    FixedPointCodec,
    decode_weighted,
    encode_weighted,
    noisy_mean,
)
from fl.flower.setup import RoundSetup, SetupError
from fl.vector import ArrayLayout, ArraySpec, LayoutError

from ..errors import FLError

F64 = npt.NDArray[np.float64]
U64 = npt.NDArray[np.uint64]


class ReplyError(FLError, ValueError):
    """The user's train reply does not match the round's layout; the message says how."""


def layout_of(arrays: Any) -> tuple[ArraySpec, ...]:
    """The layout of a Flower ``ArrayRecord`` (key order kept), as :mod:`fl.vector` has it."""
    return ArrayLayout.of({name: array.numpy() for name, array in arrays.items()}).specs


def flatten(arrays: Any, specs: tuple[ArraySpec, ...]) -> F64:
    """The arrays of an ``ArrayRecord`` in layout order as one float64 vector
    (:meth:`fl.vector.ArrayLayout.flatten`; a mismatch is a :class:`ReplyError`)."""
    try:
        return ArrayLayout(specs).flatten({name: array.numpy()
                                           for name, array in arrays.items()})
    except LayoutError as exc:
        raise ReplyError(str(exc)) from None


def unflatten(vector: F64, specs: tuple[ArraySpec, ...]) -> dict[str, npt.NDArray[Any]]:
    """Layout-ordered arrays (each cast back to its dtype) from a flat vector."""
    return ArrayLayout(specs).unflatten(vector)


def _fixed(setup: RoundSetup) -> FixedPointCodec:
    dim = setup.model_dim + len(setup.metrics) + 1
    try:
        return FixedPointCodec(dim, bits=setup.bits, frac_bits=setup.frac_bits,
                               max_summands=setup.num_clients)
    except ValueError as exc:
        raise SetupError(f"fixed-point parameters: {exc}") from None


def validate_fixed(setup: RoundSetup) -> None:
    """Refuse (:class:`SetupError`) fixed-point parameters that cannot hold the round."""
    _fixed(setup)


def dp_params(setup: RoundSetup) -> EncodingParams:
    spec = setup.dp
    if spec is None:
        raise SetupError("a distributed-DP round carries no DP parameters")
    try:
        return EncodingParams(dim=setup.model_dim + 1, clip_norm=spec.clip_norm,
                              scale=spec.scale, bits=spec.bits, noise_stddev=spec.noise_stddev,
                              rotation_seed=spec.rotation_seed,
                              mechanism=spec.mechanism,  # type: ignore[arg-type]
                              beta=spec.beta, threshold=spec.threshold)
    except ValueError as exc:
        raise SetupError(f"distributed-DP parameters: {exc}") from None


def encoded_dim(setup: RoundSetup) -> int:
    """The length of the secagg vector of this round."""
    if setup.encoding == "ddp":
        return dp_params(setup).encoded_dim
    return setup.model_dim + len(setup.metrics) + 1


def encode_reply(setup: RoundSetup, arrays: F64, metrics: dict[str, float], weight: float,
                 sent: F64 | None) -> U64:
    """A node's secagg input. ``sent`` is the flattened arrays the server sent (ddp only)."""
    if setup.encoding == "ddp":
        if sent is None or sent.shape != arrays.shape:
            raise ReplyError("a distributed-DP round needs the arrays the server sent, in "
                             "the reply's layout")
        codec = DistributedCodec(dp_params(setup))
        return codec.encode((arrays - sent)[None, :], noise=True)
    if not (np.isfinite(weight) and weight > 0):
        raise ReplyError(f"the weight {setup.weight_key!r} must be a positive number, got "
                         f"{weight!r}")
    values = [metrics[name] for name in setup.metrics]
    try:
        return encode_weighted(_fixed(setup), np.concatenate(
            [arrays, np.asarray(values, dtype=np.float64)]), weight)
    except ValueError as exc:
        raise ReplyError(str(exc)) from None


def decode_sum(setup: RoundSetup, total: U64, included: int, sent: F64
               ) -> tuple[F64, dict[str, float], float]:
    """The aggregate arrays (flat), averaged metrics and the summed weight of a round.

    ``fixed``: the weighted averages and ``sum w``. ``ddp``: ``sent`` plus the noisy sum
    of clipped updates over the noisy node count (floored at one), and that count."""
    if setup.encoding == "ddp":
        mean, count = noisy_mean(DistributedCodec(dp_params(setup)), total, included)
        return sent + mean, {}, max(count, 1.0)
    try:
        averages, weight = decode_weighted(_fixed(setup), total)
    except ValueError as exc:
        raise ReplyError(str(exc)) from None
    d = setup.model_dim
    metrics = {name: float(averages[d + i]) for i, name in enumerate(setup.metrics)}
    return averages[:d], metrics, weight
