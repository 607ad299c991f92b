"""secagg: secure aggregation for federations (Bonawitz et al. 2017; SecAgg+, Bell et al.
2020), sans-IO.

Public surface (docs/architecture.md section 4)::

    from secagg import Config, Stage, simulate, ProtocolError, ProtocolAbort

The state machines ``Client`` and ``Server`` are for embedding the protocol in a transport;
``simulate`` drives them in one process. docs/protocol.md is the normative spec.
"""

from .client import Client
from .config import Config, required_bits
from .crypto import SigningKey
from .errors import DecodeError, ProtocolAbort, ProtocolError, SecAggError
from .graph import GraphParameters, secagg_plus_parameters
from .messages import decode, encode
from .server import AggregateResult, Server
from .simulate import SimulationResult, simulate
from .stage import Stage

__all__ = [
    "AggregateResult",
    "Client",
    "Config",
    "DecodeError",
    "GraphParameters",
    "ProtocolAbort",
    "ProtocolError",
    "SecAggError",
    "Server",
    "SigningKey",
    "SimulationResult",
    "Stage",
    "decode",
    "encode",
    "required_bits",
    "secagg_plus_parameters",
    "simulate",
]

__version__ = "0.1.0"
