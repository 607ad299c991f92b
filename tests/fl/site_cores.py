"""Site cores for tests that start site roles in-process: every site runs with one
(``SiteOptions.guard`` is mandatory), over a fresh ledger under ``$XDG_STATE_HOME`` (the
autouse fixture of tests/fl/conftest.py points it at a temporary folder)."""

from __future__ import annotations

import os
from typing import Any

from dp.policy import SitePolicy
from fl.site.core import SiteCore, open_site_core, state_directory

EXACT = SitePolicy(modes=("none",))
"""An operator's opt-in to exact sums only (the roles' arithmetic, checked in the clear)."""
UNCAPPED = SitePolicy(modes=("site", "distributed"), min_noise_multiplier=0.0, epsilon=None,
                      round_epsilon=None)
"""An operator who takes part in DP rounds with no floor and no cap: for tests of the
coordinator's own accounting, not of a site's policy."""
ANY = SitePolicy(modes=("none", "site", "distributed"), min_noise_multiplier=0.0,
                 epsilon=None, round_epsilon=None)
"""An operator who takes part in every mode with no floor and no cap: for tests that
compare what a site computes with the simulation's, not of a site's policy."""


def site_core(policy: SitePolicy = EXACT, **kwargs: Any) -> SiteCore:
    """A site core over a new ledger (closed when the test process ends)."""
    path = state_directory() / f"ledger-test-{os.urandom(8).hex()}.json"
    return open_site_core(policy=policy, ledger_path=str(path), **kwargs)
