"""The protocol's messages and their wire format (docs/protocol.md section 6), by idea:

- ``classes.py``: the messages as typed, immutable dataclasses (and a masked input as
  chunks, ``split_masked_input``; the peers digest it carries, ``peers_digest``);
- ``schedule.py``: the stage schedule as data (``SCHEDULE``, ``stage_opened_by``), which
  the client's state machine, the server and the Flower records read;
- ``kinds.py``: the wire table, each ``MessageKind`` with its class, side and fields
  (``MESSAGE_KINDS``), and how each kind of field is written and read;
- ``codec.py``: ``encode`` and ``decode``, the envelope around a row of that table, in the
  canonical msgpack of ``secagg/wire.py``.

Everything is imported from here (``from secagg.messages import MaskedInput, decode``);
the modules import one another directly.
"""

from .classes import (
    AdvertiseKeys,
    Ciphertexts,
    ClientMessage,
    ConsistencySignature,
    InputProof,
    KeyEntry,
    KeyList,
    MaskedChunk,
    MaskedInput,
    Message,
    ServerMessage,
    ShareKeys,
    SurvivorList,
    UnmaskingShares,
    UnmaskRequest,
    peers_digest,
    split_masked_input,
)
from .codec import (
    MAGIC,
    SESSION_BYTES,
    client_message_limit,
    decode,
    decode_server_message,
    encode,
)
from .kinds import (
    CIPHERTEXT_BYTES,
    CLIENT_KINDS,
    MESSAGE_KINDS,
    SERVER_KINDS,
    SHARE_PLAINTEXT_BYTES,
    KindSpec,
    MessageKind,
    kind_of,
)
from .schedule import SCHEDULE, StageStep, stage_opened_by

__all__ = [
    "CIPHERTEXT_BYTES",
    "CLIENT_KINDS",
    "MAGIC",
    "MESSAGE_KINDS",
    "SCHEDULE",
    "SERVER_KINDS",
    "SESSION_BYTES",
    "SHARE_PLAINTEXT_BYTES",
    "AdvertiseKeys",
    "Ciphertexts",
    "ClientMessage",
    "ConsistencySignature",
    "InputProof",
    "KeyEntry",
    "KeyList",
    "KindSpec",
    "MaskedChunk",
    "MaskedInput",
    "Message",
    "MessageKind",
    "ServerMessage",
    "ShareKeys",
    "StageStep",
    "SurvivorList",
    "UnmaskRequest",
    "UnmaskingShares",
    "client_message_limit",
    "decode",
    "decode_server_message",
    "encode",
    "kind_of",
    "peers_digest",
    "split_masked_input",
    "stage_opened_by",
]
