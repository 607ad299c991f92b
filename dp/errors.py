"""Typed errors of the privacy layer. Every message says what to change."""

from __future__ import annotations


class PrivacyError(Exception):
    """Base class of every error raised by :mod:`dp`."""


class PrivacyConfigError(PrivacyError, ValueError):
    """A privacy parameter is out of range or inconsistent; the message names the fix."""


class LedgerWriteError(PrivacyError, ValueError):
    """The privacy ledger could not be written (a full disk, a read-only file system): the
    release was not charged, so it must not happen; the message names the file."""


class BudgetExceeded(PrivacyError):
    """Running the requested round would spend more than the fixed (epsilon, delta) budget.

    Attributes carry the numbers so a coordinator can report them.
    """

    def __init__(self, message: str, *, epsilon_limit: float, epsilon_after: float) -> None:
        super().__init__(message)
        self.epsilon_limit = epsilon_limit
        self.epsilon_after = epsilon_after


class TooFewSurvivors(PrivacyError):
    """Fewer sites were summed than the noise was calibrated for: the noise is below target."""


class MissingExtra(PrivacyError, ImportError):
    """A part of :mod:`dp` needs the optional ``torch`` extra (torch, opacus)."""


def require_opacus() -> None:
    """Raise :class:`MissingExtra` with an install hint when opacus cannot be imported."""
    try:
        import opacus  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only on a core install
        raise MissingExtra(
            "this needs opacus and torch: install the extra with `pip install secagg[torch]`"
        ) from exc
