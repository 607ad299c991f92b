"""A Flower train reply <-> the ``uint64`` vector a node hands secure aggregation.

Both sides call these functions, so node and server cannot disagree on the layout:

* mode ``none`` (an exact sum): :class:`fl.codec.FixedPointCodec` over
  ``[w * arrays, w * metrics, w]`` with ``w`` the reply's weight (``num-examples``): the
  server learns only ``sum w * arrays``, ``sum w * metrics`` and ``sum w``, i.e. the
  weighted averages FedAvg computes, with the sample counts summed securely too.
* mode ``distributed``: :class:`fl.codec.DistributedCodec` over one row
  ``[delta clipped, gamma]`` per node, ``delta`` = reply arrays minus the arrays the server
  sent, with the node's share of integer noise (:mod:`dp.encoding`, :mod:`dp.distributed`):
  the sum decodes to the noisy sum of clipped updates and a noisy count of nodes
  (client-level distributed DP).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from fl.round_reply import ReplyError, decode_sum, encode_reply
from fl.round_setup import dp_params, encoded_dim, validate_fixed
from fl.vector import ArrayLayout, ArraySpec, LayoutError

F64 = npt.NDArray[np.float64]
U64 = npt.NDArray[np.uint64]

__all__ = ["F64", "U64", "ReplyError", "decode_sum", "dp_params", "encode_reply",
           "encoded_dim", "flatten", "layout_of", "unflatten", "validate_fixed"]


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
