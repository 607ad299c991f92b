"""The stage schedule as data (docs/protocol.md tables 3.2a/3.2b): in each stage, the message
a client sends and the server message that closes it, in either mode."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..stage import Stage, round_stages
from .classes import (
    AdvertiseKeys,
    Ciphertexts,
    ConsistencySignature,
    InputProof,
    KeyList,
    MaskedInput,
    ShareKeys,
    SurvivorList,
    UnmaskingShares,
    UnmaskRequest,
)


@dataclass(frozen=True)
class StageStep:
    """One stage of the round schedule: the message each client sends in it and the server
    message that closes it (semi-honest and malicious mode; ``None``: the round ends)."""

    stage: Stage
    client: type
    answer: type | None
    malicious_answer: type | None
    validation: type | None = None
    """The message a client sends before ``client`` in a round with ``norm_bound``."""

    def answer_in(self, malicious: bool) -> type | None:
        return self.malicious_answer if malicious else self.answer


SCHEDULE: Mapping[Stage, StageStep] = MappingProxyType({step.stage: step for step in (
    StageStep(Stage.ADVERTISE_KEYS, AdvertiseKeys, KeyList, KeyList),
    StageStep(Stage.SHARE_KEYS, ShareKeys, Ciphertexts, Ciphertexts),
    StageStep(Stage.MASKED_INPUT, MaskedInput, UnmaskRequest, SurvivorList, InputProof),
    StageStep(Stage.CONSISTENCY_CHECK, ConsistencySignature, None, UnmaskRequest),
    StageStep(Stage.UNMASKING, UnmaskingShares, None, None),
)})
"""The stage schedule as data (docs/protocol.md tables 3.2a/3.2b): the client's state
machine (``secagg.client.CLIENT_ACCEPTS``), ``stage_opened_by`` and the Flower records all
read it."""


def stage_opened_by(server_message: type) -> Stage:
    """The stage whose client message ``server_message`` asks for (a ``KeyList`` opens
    share_keys, ...): the stage after the one it closes in the schedule (each server
    message opens the same stage in both modes)."""
    for malicious in (False, True):
        for here, after in itertools.pairwise(round_stages(malicious)):
            if SCHEDULE[here].answer_in(malicious) is server_message:
                return after
    raise ValueError(f"{server_message.__name__} opens no stage")
