"""asyncio drivers that move secagg messages: MQTT (aiomqtt), in-memory, embedded broker.

Imports ``secagg`` only. This module is the layer's front door: what users and the docs
import comes from here (``from transport import MqttNetwork, Topics, serve_client``), and
every error the layer raises is a ``TransportError``.

* ``rounds``: a whole round (``run_round``) and one party's side (``serve_client``,
  ``serve_server``) over any ``Network``;
* ``mqtt`` / ``memory``: the networks (an MQTT broker via aiomqtt, or in one process);
* ``topics``: the topic layout and the broker ACL it needs;
* ``drivers``, ``client_driver``, ``server_driver``: deadlines, framing, re-publishing;
* ``broker``: the embedded MQTT broker; ``mosquitto``: a generated Mosquitto;
  ``launch``: starting either as a process.
"""

from .drivers import StageProgress, Timeouts, TimeoutsError
from .errors import TransportError
from .framing import FrameError
from .launch import broker_for, running_broker
from .link import Link, LinkError, LinkLost, Network, Will
from .memory import MemoryNetwork
from .mosquitto import MosquittoBroker, MosquittoError, mosquitto_available
from .mqtt import BrokerSettings, MqttNetwork, TlsSettings, parse_broker_url
from .rounds import RoundReport, new_round_name, run_round, serve_client, serve_server
from .topics import Topics, acl_table

__all__ = [
    "BrokerSettings",
    "FrameError",
    "Link",
    "LinkError",
    "LinkLost",
    "MemoryNetwork",
    "MosquittoBroker",
    "MosquittoError",
    "MqttNetwork",
    "Network",
    "RoundReport",
    "StageProgress",
    "Timeouts",
    "TimeoutsError",
    "TlsSettings",
    "Topics",
    "TransportError",
    "Will",
    "acl_table",
    "broker_for",
    "mosquitto_available",
    "new_round_name",
    "parse_broker_url",
    "run_round",
    "running_broker",
    "serve_client",
    "serve_server",
]
