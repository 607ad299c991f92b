"""How much slower than an idle machine this host runs right now, for the tests whose parties
take wall-clock timeouts (``--ready-timeout``, ``--stage-timeout``, ``--idle-timeout``).

Those tests prove that every party ends *within its own timeouts*; the timeouts are short so
that a hang cannot pass for a slow run. On a host with a CPU hog on every core (CI machines
are shared) a party's honest work takes several times longer, and a fixed short timeout then
fails an honest run. :func:`slowdown` measures the factor in the same run, and the tests
multiply both the timeouts they give the parties and their own bounds by it: the claim stays
"ends within its timeouts", the timeouts follow the host.

The measure needs no reference machine: a thread that spins for ``probe`` seconds of CPU time
takes ``probe`` seconds of wall time on an idle core and ``k`` times that when ``k`` runnable
threads share it. The load average per core (which counts the test's own parties too) is
taken as a floor, since a burst of idle time during the probe under-states a busy host.
"""

from __future__ import annotations

import os
import time

MAX_SLOWDOWN = 8.0
"""A factor above this is reported as this: the bounds stay finite on any host."""


def slowdown(probe: float = 0.15) -> float:
    """The host's current slowdown, in [1, ``MAX_SLOWDOWN``]."""
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    spins = 0
    while time.thread_time() - cpu0 < probe:
        spins += 1
    measured = (time.perf_counter() - wall0) / max(time.thread_time() - cpu0, 1e-9)
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        per_core = 1.0
    return min(max(measured, per_core, 1.0), MAX_SLOWDOWN)

