"""asyncio drivers that move secagg messages: MQTT (aiomqtt), in-memory, embedded broker.

Imports ``secagg`` only. This module is the layer's front door: what users, the docs and
the ``fl`` layer import comes from here (``from transport import MqttNetwork, Topics,
serve_client``; ``tests/test_layout.py`` fails on an import from ``fl`` past it), and every
error the layer raises is a ``TransportError``. The control-plane field checks are exported
as the module ``fields``. Every other name is imported on first use, so importing the layer
(or one of its parts: the embedded broker, a worker) loads only what it uses.

* ``rounds``: a whole round (``run_round``) and one party's side (``serve_client``,
  ``serve_server``) over any ``Network``;
* ``mqtt`` / ``memory``: the networks (an MQTT broker via aiomqtt, or in one process);
* ``topics``: the topic layout and the broker ACL it needs;
* ``drivers``, ``client_driver``, ``server_driver``: deadlines, framing, re-publishing;
* ``broker``: the embedded MQTT broker; ``mosquitto``: a generated Mosquitto;
  ``launch``: starting either as a process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import fields
from .errors import TransportError

if TYPE_CHECKING:
    from .broker.cli import main as broker_main
    from .client_driver import ClientDriver
    from .control import ControlError, Offline, encode_control
    from .credentials import write_federation
    from .deadlines import round_timeouts, validation_allowance
    from .drivers import StageProgress, Timeouts, TimeoutsError, client_will, publish_framed
    from .framing import DEFAULT_MAX_PAYLOAD, HEADER_BYTES, FrameError, Reassembler, frame
    from .heap import keep_large_buffers
    from .launch import broker_for, running_broker
    from .link import Delivery, Event, Link, LinkError, LinkLost, Network, Reconnected, Will
    from .memory import MemoryNetwork
    from .mosquitto import MosquittoBroker, MosquittoError, mosquitto_available
    from .mqtt import BrokerSettings, MqttNetwork, TlsSettings, parse_broker_url, probe
    from .rounds import RoundReport, new_round_name, run_round, serve_client, serve_server
    from .runner import SimulationSpec, run_simulation
    from .server_driver import ServerDriver
    from .topics import SERVER_USER, Topics, acl_table, check_round_name, site_name
    from .workers import InputSource, input_ids

# Every name but the errors and ``fields`` is imported on first use: a process that needs
# one part of the layer (the embedded broker's ``python -m transport.broker``, a
# ``secagg simulate`` worker) does not import the rest (numpy, secagg, paho, the server's
# driver): issue 32 measured 0.44-0.68 CPU s of imports in the broker's process before,
# 0.19-0.26 now.
_LAZY = {
    "ClientDriver": ".client_driver", "ControlError": ".control", "Offline": ".control",
    "encode_control": ".control", "write_federation": ".credentials",
    "round_timeouts": ".deadlines", "validation_allowance": ".deadlines",
    "StageProgress": ".drivers", "Timeouts": ".drivers", "TimeoutsError": ".drivers",
    "client_will": ".drivers", "publish_framed": ".drivers",
    "DEFAULT_MAX_PAYLOAD": ".framing", "HEADER_BYTES": ".framing", "FrameError": ".framing",
    "Reassembler": ".framing", "frame": ".framing", "keep_large_buffers": ".heap",
    "broker_for": ".launch", "running_broker": ".launch", "Delivery": ".link",
    "Event": ".link", "Link": ".link", "LinkError": ".link", "LinkLost": ".link",
    "Network": ".link", "Reconnected": ".link", "Will": ".link", "MemoryNetwork": ".memory",
    "MosquittoBroker": ".mosquitto", "MosquittoError": ".mosquitto",
    "mosquitto_available": ".mosquitto", "BrokerSettings": ".mqtt", "MqttNetwork": ".mqtt",
    "TlsSettings": ".mqtt", "parse_broker_url": ".mqtt", "probe": ".mqtt",
    "RoundReport": ".rounds", "new_round_name": ".rounds", "run_round": ".rounds",
    "serve_client": ".rounds", "serve_server": ".rounds", "SimulationSpec": ".runner",
    "run_simulation": ".runner", "ServerDriver": ".server_driver", "SERVER_USER": ".topics",
    "Topics": ".topics", "acl_table": ".topics", "check_round_name": ".topics",
    "site_name": ".topics", "InputSource": ".workers", "input_ids": ".workers",
    "broker_main": ".broker.cli:main",
}


def __getattr__(name: str) -> Any:
    # the lazy-export helper itself on first use: ``secagg`` (numpy) is not imported by a
    # process that needs none of it (the embedded broker's)
    from secagg.lazy import lazy_exports

    return lazy_exports(__name__, _LAZY)(name)


__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "HEADER_BYTES",
    "SERVER_USER",
    "BrokerSettings",
    "ClientDriver",
    "ControlError",
    "Delivery",
    "Event",
    "FrameError",
    "InputSource",
    "Link",
    "LinkError",
    "LinkLost",
    "MemoryNetwork",
    "MosquittoBroker",
    "MosquittoError",
    "MqttNetwork",
    "Network",
    "Offline",
    "Reassembler",
    "Reconnected",
    "RoundReport",
    "ServerDriver",
    "SimulationSpec",
    "StageProgress",
    "Timeouts",
    "TimeoutsError",
    "TlsSettings",
    "Topics",
    "TransportError",
    "Will",
    "acl_table",
    "broker_for",
    "broker_main",
    "check_round_name",
    "client_will",
    "encode_control",
    "fields",
    "frame",
    "input_ids",
    "keep_large_buffers",
    "mosquitto_available",
    "new_round_name",
    "parse_broker_url",
    "probe",
    "publish_framed",
    "round_timeouts",
    "run_round",
    "run_simulation",
    "running_broker",
    "serve_client",
    "serve_server",
    "site_name",
    "validation_allowance",
    "write_federation",
]
