"""secagg: secure aggregation for federations (Bonawitz et al. 2017; SecAgg+, Bell et al.
2020), sans-IO.

Public surface (docs/architecture.md section 4)::

    from secagg import Config, Stage, simulate, ProtocolError, ProtocolAbort

The state machines ``Client`` and ``Server`` are for embedding the protocol in a transport
(a model-sized masked input streams: ``Client.stream`` gives a ``MaskedStream`` of chunks);
``simulate`` drives them in one process. docs/protocol.md is the normative spec.
"""

from .client import Client
from .config import Config, required_bits
from .crypto import MAX_BITS, MIN_BITS, SigningKey
from .errors import (
    CryptoError,
    DecodeError,
    InputMismatch,
    InputRefused,
    ProtocolAbort,
    ProtocolError,
    SecAggError,
    ShamirError,
    StaleSnapshot,
)
from .graph import SECURITY_MODES, GraphParameters, secagg_plus_parameters
from .masked_stream import MaskedStream
from .messages import decode, encode
from .nonce import RoundNonce
from .server import AggregateResult, Server
from .simulate import LocalRound, SimulationResult, simulate
from .stage import Stage, round_stages

__all__ = [
    "MAX_BITS",
    "MIN_BITS",
    "SECURITY_MODES",
    "AggregateResult",
    "Client",
    "Config",
    "CryptoError",
    "DecodeError",
    "GraphParameters",
    "InputMismatch",
    "InputRefused",
    "LocalRound",
    "MaskedStream",
    "ProtocolAbort",
    "ProtocolError",
    "RoundNonce",
    "SecAggError",
    "Server",
    "ShamirError",
    "SigningKey",
    "SimulationResult",
    "Stage",
    "StaleSnapshot",
    "decode",
    "encode",
    "required_bits",
    "round_stages",
    "secagg_plus_parameters",
    "simulate",
]

__version__ = "0.1.0"
