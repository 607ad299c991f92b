"""Input validation inside secure aggregation (docs/protocol.md section 10), sans-IO.

A client proves in zero knowledge that the vector it masks has L2 norm at most the round's
``norm_bound`` (``norm.prove``); the server checks each proof (``norm.verify``) before the
masked input may count, and after unmasking checks that the included clients' commitments
open to the sum (``norm.check_sum``), which catches a client that proved one vector and
masked another. Needs the ``validation`` extra (py-arkworks-bls12381).
"""

from .group import ValidationUnavailable, available
from .norm import (
    InvalidProof,
    NormStatement,
    blinding,
    check_parameters,
    check_sum,
    commitment,
    proof_size,
    prove,
    verify,
)

__all__ = [
    "InvalidProof",
    "NormStatement",
    "ValidationUnavailable",
    "available",
    "blinding",
    "check_parameters",
    "check_sum",
    "commitment",
    "proof_size",
    "prove",
    "verify",
]
