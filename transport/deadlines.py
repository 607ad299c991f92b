"""The round's deadlines from its cost model: how long each stage of a round of n clients
with vectors of ``dim`` elements may take, defined once for every party (the server driver,
the clients, the ``secagg train`` roles and ``secagg simulate``).

``round_work`` is the model (seconds of computation per stage), ``round_timeouts`` the
deadlines it gives (docs/performance.md "Round deadlines"); both are capped so that a huge
roster never keeps a party waiting for days.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from .drivers import Timeouts

# The round's cost model (docs/performance.md "Round deadlines"). Seconds per unit of work,
# measured on this 2-core machine with ``python benchmarks/bench_simulate_scale.py
# --calibrate`` under a load average of about 5 (other jobs running): the largest of two runs,
# rounded up. The deadlines allow SAFETY times the modelled work, so a slower or busier
# machine still finishes.
PAIR_SECONDS: Mapping[str, Mapping[str, float]] = {
    # one client's computation per neighbour for its message of each stage: X25519
    # agreements, Shamir shares and AEAD encryptions (share_keys; malicious: signature
    # checks too), agreements and key derivation (masked_input), decryption (unmasking;
    # malicious: the consistency signatures are checked there)
    "semi-honest": {"advertise_keys": 0.0, "share_keys": 500e-6, "masked_input": 200e-6,
                    "consistency_check": 0.0, "unmasking": 20e-6},
    "malicious": {"advertise_keys": 0.0, "share_keys": 1100e-6, "masked_input": 250e-6,
                  "consistency_check": 10e-6, "unmasking": 500e-6},
}
ELEMENT_SECONDS = 3.5e-9
"""Expanding one mask element (AES-CTR keystream) and adding it: masked_input costs each
client (neighbours + 1) x dim of these, the server's unmasking its dropped pairs x dim."""
SERVER_PAIR_SECONDS = 15e-6
"""The server and the broker per (client, neighbour) pair and stage: decoding, storing and
routing n x k ciphertexts and keys (in ``secagg simulate`` on the same cores as the sites)."""
LOGIN_SECONDS = 20e-3
"""The broker checks one login (hash of a generated token) and its subscriptions."""
SAFETY = 4.0
"""The deadlines allow SAFETY x the modelled work."""

# Input validation (``norm_bound``, docs/protocol.md 10): seconds per coordinate, from
# ``python benchmarks/bench_validation.py`` (docs/performance.md "Input validation": d = 10^3
# to 10^5 at a load average of 15.7 on this 2-core machine; the largest per-coordinate
# figure above a fixed part, rounded up). A site proves once per round; the server verifies
# the n proofs one after the other in masked_input and checks the sum once when unmasking.
GENERATOR_SECONDS = 3.2e-3
"""Hashing one generator to the curve: d + 274 of them (the weight's included), once per
process (the first round of a process pays it, on the site and on the server)."""
PROVE_SECONDS = (0.5, 4.3e-4)
"""A site's proof: fixed seconds, plus seconds per coordinate."""
VERIFY_SECONDS = (0.5, 2.3e-4)
"""The server's check of one proof: fixed seconds, plus seconds per coordinate."""
SUM_CHECK_SECONDS = 1e-4
"""The server's sum check, per coordinate (one multi-exponentiation of d + 1 points)."""


def validation_work(*, clients: int, dim: int, colocated: int = 1) -> dict[str, float]:
    """Seconds input validation adds to masked_input (each site's proof, ``colocated`` of
    them one after another on a core, and the server's n verifications) and to ``finish``
    (the sum check), generators included: the first round of a process pays them."""
    from secagg.validation.norm import LAMBDA, SLACK

    n, d = max(0, int(clients)), max(0, int(dim))
    setup = (d + 2 * SLACK + LAMBDA + 2) * GENERATOR_SECONDS  # G, Q, S, K, H and G0
    prove = PROVE_SECONDS[0] + PROVE_SECONDS[1] * d
    verify = VERIFY_SECONDS[0] + VERIFY_SECONDS[1] * d
    return {"masked_input": setup + max(1, colocated) * prove + n * verify,
            "finish": d * SUM_CHECK_SECONDS}
MAX_STAGE_SECONDS = 3600.0
"""No stage deadline, re-publish timer or wait for the round start exceeds this (or the
caller's own ``stage``, if larger), whatever the round's size: a site sizes its deadlines
from the roster the coordinator sends (up to 65,535 ids), which must not keep it waiting,
charged, for days."""
MAX_GIVE_UP_SECONDS = 6 * 3600.0
"""A client gives up on a silent round after at most this long (or 3 x ``stage``)."""


def validation_allowance(*, clients: int, dim: int) -> float:
    """Seconds a masked_input deadline adds for input validation: SAFETY x the stage's
    :func:`validation_work` (a runtime with its own stage timeout, such as Flower's, adds
    this; :func:`round_timeouts` does it with ``validated=True``)."""
    return SAFETY * validation_work(clients=clients, dim=dim)["masked_input"]


def round_work(*, clients: int, dim: int, neighbors: int | None = None,
               malicious: bool = False, colocated: int = 1,
               validated: bool = False) -> dict[str, float]:
    """Seconds of computation each stage of one round needs (by stage label), and under
    ``"finish"`` the server's unmasking: the cost model, defined once.

    ``clients`` n and ``neighbors`` k (SecAgg+'s neighbourhood, the client included;
    ``None``: the complete graph, k = n) give n x k pairs: each client computes k
    agreements, shares and encryptions (SecAgg+ scales with n x k, the complete graph with
    n^2) and the server routes n x k ciphertexts; masking costs k x ``dim`` per client
    (k - 1 pairwise masks and its self mask). ``colocated`` is how many clients compute
    one after another on one core (1 when every site has its own machine; n / cores in
    ``secagg simulate``, n when every party runs on one event loop). ``validated``: the
    round has ``norm_bound`` (:func:`validation_work` is added)."""
    n = max(0, int(clients))
    k = n if neighbors is None else min(n, int(neighbors))
    per_pair = PAIR_SECONDS["malicious" if malicious else "semi-honest"]
    share = max(1, colocated)
    work = {label: share * k * per_pair[label] + n * k * SERVER_PAIR_SECONDS
            for label in per_pair}
    work["masked_input"] += share * k * dim * ELEMENT_SECONDS
    # at most half of the pairs have a dropped end, and every survivor's self mask
    work["finish"] = (n * k / 2 + n) * dim * ELEMENT_SECONDS + n * k * SERVER_PAIR_SECONDS
    if validated:
        for label, seconds in validation_work(clients=n, dim=dim, colocated=share).items():
            work[label] += seconds
    return work


def round_timeouts(stage: float = 60.0, *, clients: int = 0, dim: int = 0,
                   neighbors: int | None = None, malicious: bool = False,
                   colocated: int = 1, validated: bool = False) -> Timeouts:
    """The protocol deadlines of every round the package runs (defined once): ``stage``
    seconds per stage for the network, plus SAFETY x the stage's modelled work
    (``round_work``: pass what the caller knows of the round). A client re-publishes an
    unconfirmed message only after the stage's work could have delayed the receipt (its
    event loop may be busy with co-located clients), waits for the round start while the
    broker checks every login, and gives up on a silent round after a few stages' worth
    of time. Sites that drop sign off or leave a last will, so the deadlines only guard
    against a wedged broker or a hung site. Every deadline is capped (MAX_STAGE_SECONDS,
    MAX_GIVE_UP_SECONDS): the model's numbers for a huge roster are no reason to wait days."""
    work = round_work(clients=clients, dim=dim, neighbors=neighbors, malicious=malicious,
                      colocated=colocated, validated=validated)
    finish = SAFETY * work.pop("finish")
    slack = {label: SAFETY * w for label, w in work.items()}
    most = max(slack.values())
    cap = max(MAX_STAGE_SECONDS, stage)
    return Timeouts(stage=min(cap, stage + most),
                    per_stage={label: min(cap, stage + s) for label, s in slack.items()},
                    start=min(cap, max(60.0, stage) + SAFETY * clients * LOGIN_SECONDS),
                    retry=min(cap, 2.0 + most),
                    answer=min(cap, min(10.0, stage) + most + finish),
                    give_up=min(max(MAX_GIVE_UP_SECONDS, 3 * stage),
                                max(120.0, 3 * stage) + 2 * (most + finish)))


LOGICAL_KEEPALIVE = 300
"""The MQTT keepalive (seconds) of a simulation with logical deadlines: the largest the
embedded broker accepts (``BrokerLimits.max_keepalive``), so a worker whose event loop the
host starves for minutes is not disconnected for a missed ping (its last will would look
like a dropout)."""
LOGICAL_LINK_SECONDS = 3600.0
"""How long one connect, publish or reconnect of a simulated party may wait under logical
deadlines (the broker checks thousands of logins one after another on a busy host)."""


def logical_timeouts(timeouts: Timeouts) -> Timeouts:
    """``timeouts`` for a simulation whose only dropouts are the ones it was asked for
    (docs/performance.md "Logical deadlines"): no stage deadline, upload lease or idle
    limit, no wait for the round start and no giving up, so a stage closes only when every
    client still expected has answered or declared its drop (its sign-off, or the last will
    of a killed process); a slow host makes the round slow, never smaller. The re-publish
    timers (``retry``, ``answer``) stay: a duplicate costs a receipt, never a dropout. The
    caller watches for a run that stops making progress (``transport.runner``'s ``stall``)."""
    return dataclasses.replace(timeouts, stage=math.inf, per_stage={}, start=math.inf,
                               give_up=math.inf, upload_idle=None)
