"""The round setup, now shared by every runtime that sends one: :mod:`fl.round_setup`
(kept here for the Flower adapter's imports)."""

from __future__ import annotations

from fl.round_setup import DpSpec, RoundSetup, SetupError

__all__ = ["DpSpec", "RoundSetup", "SetupError"]
