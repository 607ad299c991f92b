"""The checks a client's input passes before it is masked: its shape, dtype and range
(``check_input``) and, when the round has a ``norm_bound``, its L2 norm and non-negative
weight (docs/protocol.md 10). Used by ``secagg.client.Client`` and by transports that
check every input before a round starts."""

from __future__ import annotations

import numpy as np

from .config import Config
from .crypto import dtype_for_bits


def check_input(vector: object, config: Config, who: str = "input") -> np.ndarray:
    """A validated copy of a client's input as the protocol's working dtype (within the
    round's ``norm_bound``, when it has one)."""
    arr = np.asarray(vector)
    if arr.ndim != 1 or arr.shape[0] != config.dim:
        raise ValueError(f"{who} has shape {arr.shape}; it must be a vector of length "
                         f"dim={config.dim}")
    if arr.dtype.kind not in "ui":
        raise ValueError(f"{who} has dtype {arr.dtype}; use unsigned integers "
                         f"(uint64) with values below 2**bits")
    if arr.size and ((arr.dtype.kind == "i" and int(arr.min()) < 0)
                     or int(arr.max()) >= config.modulus):
        raise ValueError(f"{who} has values outside [0, 2**{config.bits}); reduce them "
                         f"mod 2**bits or raise bits")
    out = arr.astype(dtype_for_bits(config.bits), copy=True)
    if config.norm_bound is not None:
        _check_norm(out, config, who)
    return out


def _check_norm(vector: np.ndarray, config: Config, who: str) -> None:
    """An honest client's input must be within the round's norm bound: clipping is the
    caller's job (the bound is public, docs/protocol.md 10)."""
    from .validation import available
    from .validation.group import ValidationUnavailable
    from .validation.norm import centered

    if not available():
        raise ValidationUnavailable("norm_bound needs the group library: pip install "
                                    "'secagg[validation]' (py-arkworks-bls12381)")
    bound = config.norm_bound
    assert bound is not None
    norm2 = sum(v * v for v in centered(vector, config.bits))
    if norm2 > bound * bound:
        raise ValueError(f"{who} has L2 norm sqrt({norm2}) > norm_bound={bound} (as centred "
                         f"integers mod 2**{config.bits}): clip it to the bound")
    k = config.weight_index
    if k is not None and centered(vector[k:k + 1], config.bits)[0] < 0:
        raise ValueError(f"{who} has a negative weight in coordinate {k} (as a centred "
                         f"integer mod 2**{config.bits}): a weight must be non-negative")
