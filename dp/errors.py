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


TORCH_EXTRA_INSTALL = (
    "pip install -e '.[torch]' -c constraints.txt --extra-index-url "
    "https://download.pytorch.org/whl/cpu (in a clone of the secagg repository: secagg is "
    "not on PyPI; PyTorch's CPU index gives torch's CPU build, constraints.txt only pins "
    "the versions)")
"""The one install hint for the ``torch`` extra (torch and opacus), quoted by every command
that needs it."""


class MissingExtra(PrivacyError, ImportError):
    """A part of :mod:`dp` needs the optional ``torch`` extra (torch, opacus)."""


def require_opacus() -> None:
    """Raise :class:`MissingExtra` with an install hint when opacus cannot be imported."""
    try:
        import opacus  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only on a core install
        raise MissingExtra(
            f"this needs opacus and torch: install the extra with {TORCH_EXTRA_INSTALL}"
        ) from exc
