"""Privacy: distributed integer noise, accountants, budgets, patient-level grouping, Opacus glue.

May import ``secagg`` (encoding), never ``fl``. The modules re-exported here need only numpy
and ``cryptography``; ``dp.units`` and ``dp.opacus_glue`` need the ``torch`` extra, and the
Opacus-backed accountants import opacus on first use. See docs/privacy.md.
"""

from dp.budget import GaussianRound, PrivacyBudget, RdpRound
from dp.distributed import BitsChoice, NoiseCalibration, calibrate, choose_bits, noise_for_budget
from dp.encoding import EncodingParams, IntegerEncoder
from dp.errors import (
    BudgetExceeded,
    LedgerWriteError,
    MissingExtra,
    PrivacyConfigError,
    PrivacyError,
    TooFewSurvivors,
)
from dp.ledger import Charge, Ledger
from dp.policy import PolicyRefused, Proposal, SitePolicy

__all__ = [
    "BitsChoice", "BudgetExceeded", "Charge", "EncodingParams", "GaussianRound",
    "IntegerEncoder", "Ledger", "LedgerWriteError", "MissingExtra", "NoiseCalibration",
    "PolicyRefused", "PrivacyBudget", "PrivacyConfigError", "PrivacyError", "Proposal",
    "RdpRound", "SitePolicy", "TooFewSurvivors", "calibrate", "choose_bits",
    "noise_for_budget",
]
