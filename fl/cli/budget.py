"""``secagg budget``: the privacy officer's planner (docs/architecture.md section 4).

Given a noise multiplier, print how many rounds (steps of the sampled Gaussian mechanism)
the budget affords -- the largest R whose epsilon is at most E. Given rounds, print the
smallest noise multiplier that fits. ``--json`` prints exactly one JSON object with
``epsilon``, ``delta``, ``sample_rate``, ``noise_multiplier``, ``rounds``, ``accountant``
and ``mechanism``. Bad input: a message saying what to change on stderr, exit code 2.

It models one mechanism, the Poisson-sampled Gaussian (one step = one round), and says so:
that is ``--dp site`` with one DP-SGD step per round. A training run's own plan -- its mode
(distributed discrete Gaussian included), its steps per round and its threshold -- comes
from ``secagg train ... --plan``, computed by the code the run uses.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from dp import (
    ORDERS,
    PrivacyError,
    accountant_names,
    gaussian_epsilon,
    gaussian_rdp,
    noise_multiplier_for,
    rdp_optimal_order,
    rounds_for,
)
from fl.cli._common import error

MECHANISM = ("Poisson-sampled Gaussian, one step per round (--dp site with one DP-SGD step "
             "per round)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "budget",
        help="plan a privacy budget: rounds for a noise multiplier, or the reverse",
        description=(
            "Given --noise-multiplier, print how many rounds the (epsilon, delta) budget "
            "affords; given --rounds, print the smallest noise multiplier that fits."
        ),
    )
    p.add_argument("--epsilon", type=float, required=True, help="total epsilon per patient")
    p.add_argument("--delta", type=float, required=True, help="delta, below 1/#patients")
    p.add_argument("--sample-rate", type=float, required=True,
                   help="probability a patient is sampled in a round (0 < Q <= 1)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--noise-multiplier", type=float, help="noise stddev / clip norm")
    group.add_argument("--rounds", type=int, help="number of rounds to fit in the budget")
    p.add_argument("--accountant", choices=accountant_names(), default="rdp",
                   help="rdp (Opacus RDP, default), prv (Opacus PRV: tighter) or pld "
                        "(dp-accounting's privacy loss distribution)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(command="budget")
    return p


def _validate(args: argparse.Namespace) -> str | None:
    if not (math.isfinite(args.epsilon) and args.epsilon > 0):
        return f"--epsilon must be a positive number (got {args.epsilon})"
    if not 0 < args.delta < 1:
        return f"--delta must be in (0, 1), e.g. 1e-5 (got {args.delta})"
    if not 0 < args.sample_rate <= 1:
        return f"--sample-rate must be in (0, 1] (got {args.sample_rate})"
    if args.noise_multiplier is not None and not (
        math.isfinite(args.noise_multiplier) and args.noise_multiplier > 0
    ):
        return f"--noise-multiplier must be a positive number (got {args.noise_multiplier})"
    if args.rounds is not None and args.rounds < 1:
        return f"--rounds must be at least 1 (got {args.rounds})"
    return None


def _order_at_the_edge(z: float, q: float, rounds: int, delta: float, accountant: str
                       ) -> str | None:
    """In words, what Opacus' "Optimal order is the smallest alpha" warning means, when the
    RDP accountant's best order is the smallest or largest it tries; else None."""
    if accountant != "rdp" or rounds < 1:
        return None
    order = rdp_optimal_order(gaussian_rdp(z, q, rounds), delta)
    if order not in (ORDERS[0], ORDERS[-1]):
        return None
    where = ("smallest" if order == ORDERS[0] else "largest")
    why = ("so large an epsilon protects little" if order == ORDERS[0]
           else "so small an epsilon needs much noise")
    return (f"note: the RDP accountant's tightest Renyi order here is the {where} it tries "
            f"({order:g}): {why}, and the epsilon above is an upper bound, looser than "
            "it could be")


def run(args: argparse.Namespace) -> int:
    problem = _validate(args)
    if problem:
        return error("budget", problem)

    try:
        if args.noise_multiplier is not None:
            z = float(args.noise_multiplier)
            rounds = rounds_for(args.epsilon, args.delta, args.sample_rate, z, args.accountant)
        else:
            rounds = int(args.rounds)
            z = noise_multiplier_for(args.epsilon, args.delta, args.sample_rate, rounds,
                                     args.accountant)
        spent = gaussian_epsilon(z, args.sample_rate, rounds, args.delta, args.accountant)
    except PrivacyError as exc:
        return error("budget", exc)
    result = {
        "epsilon": args.epsilon, "delta": args.delta, "sample_rate": args.sample_rate,
        "noise_multiplier": z, "rounds": rounds, "accountant": args.accountant,
        "mechanism": MECHANISM,
    }
    if args.json:
        print(json.dumps(result))
    elif args.noise_multiplier is not None:
        print(f"noise multiplier {z:g} at sample rate {args.sample_rate:g}: the budget "
              f"(epsilon={args.epsilon:g}, delta={args.delta:g}) affords {rounds} rounds "
              f"(epsilon spent {spent:.4g}, {args.accountant} accountant)")
    else:
        print(f"{rounds} rounds at sample rate {args.sample_rate:g} within "
              f"(epsilon={args.epsilon:g}, delta={args.delta:g}) need noise multiplier "
              f">= {z:.4f} (epsilon spent {spent:.4g}, {args.accountant} accountant)")
    if not args.json:
        print(f"({MECHANISM}; for a training run's own plan, any --dp mode, use "
              "`secagg train ... --plan`)")
        edge = _order_at_the_edge(z, args.sample_rate, rounds, args.delta, args.accountant)
        if edge:
            print(edge)
    if rounds == 0:
        print("secagg budget: not even one round fits; raise --noise-multiplier or --epsilon, "
              "or lower --sample-rate", file=sys.stderr)
    return 0
