"""The five stages of a round (Bonawitz et al. 2017, rounds 0 to 4).

The order is the protocol order; ``Stage.CONSISTENCY_CHECK`` only happens in
``security="malicious"`` mode.
"""

from __future__ import annotations

import enum
from typing import Protocol


class _HasMalicious(Protocol):
    @property
    def malicious(self) -> bool: ...


class Stage(enum.IntEnum):
    """A stage of one secure aggregation round. See docs/protocol.md section 3."""

    ADVERTISE_KEYS = 0
    SHARE_KEYS = 1
    MASKED_INPUT = 2
    CONSISTENCY_CHECK = 3
    UNMASKING = 4

    @property
    def label(self) -> str:
        """The wire name of the stage, e.g. ``"share_keys"``."""
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Stage:
        """``"share_keys"``, ``"SHARE_KEYS"`` or ``"share-keys"`` -> ``Stage.SHARE_KEYS``."""
        key = text.strip().upper().replace("-", "_")
        try:
            return cls[key]
        except KeyError:
            names = ", ".join(s.label for s in cls)
            raise ValueError(f"unknown stage {text!r}: use one of {names}") from None


def round_stages(malicious: bool | _HasMalicious) -> tuple[Stage, ...]:
    """The stages of one round, in order: the one definition of the round schedule that
    ``simulate``, the transport drivers and ``fl`` use. Takes a ``Config`` (or its
    ``malicious`` flag): ``CONSISTENCY_CHECK`` is in the schedule only in malicious mode."""
    flag = malicious if isinstance(malicious, bool) else malicious.malicious
    if flag:
        return tuple(Stage)
    return tuple(s for s in Stage if s is not Stage.CONSISTENCY_CHECK)
