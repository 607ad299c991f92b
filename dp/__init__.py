"""Privacy: distributed integer noise, accountants, budgets, patient-level grouping, Opacus glue.

May import ``secagg`` (encoding), never ``fl``. This module is the layer's front door: what
users, the docs and the ``fl`` layer import comes from here (``from dp import SitePolicy,
calibrate``; ``tests/test_layout.py`` fails on an import from ``fl`` past it), and every error
the layer raises is a ``PrivacyError``. Two registries are exported as modules:
``mechanisms`` (the integer mechanisms by name: ``mechanisms.mechanism(name)``,
``mechanisms.names()``) and ``site_weights`` (DP-FedAvg+'s site weights). The names re-exported
eagerly need only numpy and ``cryptography``; ``IdpSgd``, ``SitePrivacyEngine``, ``UnitIndex``
and ``site_unit_gradients`` need the ``torch`` extra and are imported on first use, and the
Opacus-backed accountants import opacus on first use. See docs/privacy.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dp import mechanisms, site_weights
from dp.accounting import (
    ORDERS,
    accountant_names,
    adaptive_clip_update_noise,
    check_delta,
    gaussian_epsilon,
    gaussian_rdp,
    noise_multiplier_for,
    rdp_optimal_order,
    rdp_to_epsilon,
    rounds_for,
)
from dp.adaptive_clip import QuantileClipper
from dp.audit import distributed_event, event_json, run_json
from dp.budget import (
    Event,
    GaussianRound,
    PrivacyBudget,
    RdpRound,
    event_from_json,
    event_to_json,
)
from dp.distributed import (
    BitsChoice,
    NoiseCalibration,
    calibrate,
    choose_bits,
    effective_noise_multiplier,
    noise_for_budget,
)
from dp.encoding import EncodingParams, IntegerEncoder
from dp.errors import (
    TORCH_EXTRA_INSTALL,
    BudgetExceeded,
    LedgerWriteError,
    MissingExtra,
    PrivacyConfigError,
    PrivacyError,
    TooFewSurvivors,
)
from dp.idp import (
    DEFAULT_MAX_RECORDS,
    PLAN_SOURCES,
    GroupLedger,
    IdpClasses,
    IdpPlan,
    PatientGroups,
    group_patients,
    plan_idp,
)
from dp.ledger import Charge, Ledger
from dp.policy import (
    MODE_DISTRIBUTED,
    MODE_NONE,
    MODE_SITE,
    MODES,
    UNITS,
    PolicyRefused,
    Proposal,
    SitePolicy,
    refusal_summary,
)
from dp.randomness import RandomSource
from secagg.lazy import lazy_exports

if TYPE_CHECKING:
    from dp.idp_engine import IdpSgd
    from dp.opacus_glue import SitePrivacyEngine
    from dp.units import UnitIndex, site_unit_gradients

# the names that need the torch extra: imported on first use, so ``import dp`` needs no torch
__getattr__ = lazy_exports(__name__, {
    "IdpSgd": ".idp_engine", "SitePrivacyEngine": ".opacus_glue", "UnitIndex": ".units",
    "site_unit_gradients": ".units"})

__all__ = [
    "DEFAULT_MAX_RECORDS", "MODES", "MODE_DISTRIBUTED", "MODE_NONE", "MODE_SITE", "ORDERS",
    "PLAN_SOURCES", "TORCH_EXTRA_INSTALL", "UNITS",
    "BitsChoice", "BudgetExceeded", "Charge", "EncodingParams", "Event", "GaussianRound",
    "GroupLedger", "IdpClasses", "IdpPlan", "IdpSgd", "IntegerEncoder", "Ledger",
    "LedgerWriteError", "MissingExtra", "NoiseCalibration", "PatientGroups", "PolicyRefused",
    "PrivacyBudget", "PrivacyConfigError", "PrivacyError", "Proposal", "QuantileClipper",
    "RandomSource", "RdpRound", "SitePolicy", "SitePrivacyEngine", "TooFewSurvivors",
    "UnitIndex", "accountant_names", "adaptive_clip_update_noise", "calibrate", "check_delta",
    "choose_bits", "distributed_event", "effective_noise_multiplier", "event_from_json",
    "event_json", "event_to_json", "gaussian_epsilon", "gaussian_rdp", "group_patients",
    "mechanisms", "noise_for_budget", "noise_multiplier_for", "plan_idp", "rdp_optimal_order",
    "rdp_to_epsilon", "refusal_summary", "rounds_for", "run_json", "site_unit_gradients",
    "site_weights",
]
