"""The server side of a round setup (:class:`fl.round_setup.RoundSetup`), for the runtimes
that send one (:mod:`fl.flower.server`, :mod:`fl.nvflare.server`): client-level distributed
DP as a server asks for it (:class:`DistributedDP`) and its plan (:func:`round_plan`,
:func:`with_distributed_dp`), the protocol graph and a fixed-point round's setup
(:func:`protocol_graph`, :func:`fixed_setup`), and input validation
(:func:`check_norm_bound`, :func:`with_norm_bound`)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from dp import MODE_DISTRIBUTED, MODE_NONE, mechanisms
from fl.input_bound import bits_for
from fl.modes import DpSpec
from fl.plan.privacy import DistributedPlan, distributed_plan
from fl.round_reply import charged_params
from fl.round_setup import RoundSetup, SetupError, encoded_dim
from fl.vector import ArraySpec
from secagg import Config, RoundNonce, secagg_plus_parameters


@dataclass(frozen=True)
class DistributedDP:
    """Client-level distributed DP: each node clips its update (reply minus the arrays
    sent) to ``clip_norm`` and adds its share of integer noise. Give ``epsilon`` (with
    ``delta``, the node ``sample_rate`` and the planned ``rounds``) to have the noise fit
    the budget and the budget enforced, or a central ``noise_multiplier``. The budget is
    planned and spent as each node's ledger charges the rounds (:func:`round_plan`), at
    sample rate 1: a node cannot verify it was sampled, so ``sample_rate`` stays 1.0."""

    clip_norm: float
    epsilon: float | None = None
    delta: float = 1e-5
    sample_rate: float = 1.0
    rounds: int = 1
    noise_multiplier: float | None = None
    granularity_bits: int = 12
    adaptive_clip: float | None = None
    site_weights: float | None = None
    """DP-FedAvg+'s private adaptive clip and site weights: not carried by this round setup
    yet (``secagg train`` runs them); asking for them is refused, never ignored."""
    mechanism: str = "dgauss"
    """The integer noise, by its name in :mod:`dp.mechanisms` (``"dgauss"``, ``"skellam"``)."""

    def __post_init__(self) -> None:
        if self.mechanism not in mechanisms.names():
            raise SetupError(f"mechanism {self.mechanism!r}: use one of {mechanisms.names()} "
                             "(dp.mechanisms)")
        if self.sample_rate != 1.0:
            raise SetupError(f"sample_rate={self.sample_rate!r}: a node charges every round it "
                             "joins at sample rate 1 (the server picks the roster; a node "
                             "cannot verify it was sampled), so the plan is at 1 too: leave "
                             "sample_rate at 1.0")
        if self.adaptive_clip is not None or self.site_weights is not None:
            raise SetupError("adaptive_clip/site_weights: the Flower and NVFlare round setup "
                             "does not carry DP-FedAvg+'s clip count or site weights yet; run "
                             "them with secagg train --dp distributed")


def protocol_graph(n: int, *, neighbors: int | str | None, threshold: int | None,
                   dropout_rate: float, corrupt_rate: float, security: str
                   ) -> tuple[int | None, int | None]:
    """The (k, t) a server asks of ``n`` sites: ``neighbors="auto"``: SecAgg+'s for the
    rates (``secagg.secagg_plus_parameters``; k None: the complete graph when no sparse one
    is safe); an int k with ``threshold``; None: the complete graph with ``threshold``
    (None: the protocol's floor, which ``secagg.Config`` fills in)."""
    if neighbors == "auto":
        graph = secagg_plus_parameters(n, dropout_rate, corrupt_rate, security)
        return graph.neighbors, graph.threshold
    return (neighbors, threshold) if isinstance(neighbors, int) else (None, threshold)


def fixed_setup(*, run_id: int, server_round: int, roster: Sequence[int],
                arrays: tuple[ArraySpec, ...], metrics: tuple[str, ...], weight_key: str,
                neighbors: int | str | None, threshold: int | None, dropout_rate: float,
                corrupt_rate: float, security: str, bits: int, frac_bits: int,
                verify_keys: Mapping[Any, bytes], members: Sequence[Any] | None = None
                ) -> RoundSetup:
    """A fixed-point round's setup with a fresh nonce and the graph of
    :func:`protocol_graph`. Malicious mode: ``verify_keys`` maps each of ``members``
    (default the roster) to its enrolled key; a member without one is a ``ValueError``."""
    n = len(roster)
    k, t = protocol_graph(n, neighbors=neighbors, threshold=threshold,
                          dropout_rate=dropout_rate, corrupt_rate=corrupt_rate,
                          security=security)
    nonce = RoundNonce()  # its value goes out in the setup; the round's Server takes it
    # Config fills in the protocol's threshold floor for t = 0; the rates check SecAgg+'s k
    probe = Config(num_clients=n, threshold=t or 0, neighbors=k, security=security,
                   dropout_rate=None if k is None else dropout_rate,
                   corrupt_rate=None if k is None else corrupt_rate)
    keys: tuple[bytes, ...] = ()
    if security == "malicious":
        who = list(roster if members is None else members)
        unknown = [m for m in who if m not in verify_keys]
        if unknown:
            raise ValueError(f"no enrolled verify key for {unknown[:10]}")
        keys = tuple(verify_keys[m] for m in who)
    return RoundSetup(
        run_id=run_id, server_round=server_round, nonce=nonce.value, round_nonce=nonce,
        roster=tuple(roster),
        threshold=probe.threshold, neighbors=probe.neighbors, bits=bits, security=security,
        arrays=arrays, metrics=metrics, weight_key=weight_key, mode=MODE_NONE,
        frac_bits=frac_bits, dropout_rate=dropout_rate, corrupt_rate=corrupt_rate,
        verify_keys=keys)


def round_plan(privacy: DistributedDP, setup: RoundSetup,
               cache: dict[tuple[int, int, int, str], DistributedPlan]) -> DistributedPlan:
    """The distributed-DP plan of ``setup``'s round (``fl.plan.privacy.distributed_plan``),
    cached per (model size, sites, threshold, security mode) in ``cache``. With an
    ``epsilon`` the per-node noise is the least whose ``rounds`` rounds fit it *as each node's
    ledger charges them* (:func:`charged_params`: the replace-one sensitivity of its one row,
    at sample rate 1, and in a semi-honest round its own noise share only), so a default
    node accepts the plan and the epsilon the server reports is the one every ledger
    records; a ``noise_multiplier`` is the central one any ``threshold`` survivors carry."""
    key = (setup.model_dim, setup.num_clients, setup.threshold, setup.security)
    if key not in cache:
        cache[key] = distributed_plan(
            model_dim=setup.model_dim, epsilon=privacy.epsilon, delta=privacy.delta,
            sample_rate=privacy.sample_rate, rounds=privacy.rounds,
            clip_norm=privacy.clip_norm, num_sites=setup.num_clients,
            threshold=setup.threshold, max_units_per_site=1,
            noise_multiplier=privacy.noise_multiplier,
            granularity_bits=privacy.granularity_bits,
            charged=partial(charged_params, security=setup.security),
            mechanism=privacy.mechanism)
    return cache[key]


def with_distributed_dp(setup: RoundSetup, plan: DistributedPlan, domain: bytes
                        ) -> RoundSetup:
    """``setup`` switched to the distributed-DP encoding of ``plan`` (no metrics: they
    would carry no noise); the rotation seed is drawn from the round's nonce."""
    p = plan.params
    rotation = int.from_bytes(hashlib.sha256(domain + setup.nonce).digest()[:8], "big") >> 1
    dp = replace(DpSpec.of(p), rotation_seed=rotation)
    return replace(setup, mode=MODE_DISTRIBUTED, frac_bits=0, dp=dp, bits=p.bits,
                   metrics=())


def check_norm_bound(norm_bound: float | str | None, privacy: DistributedDP | None) -> None:
    """A server's ``norm_bound`` argument (input validation, docs/protocol.md 10.6): None
    (off), a positive number (fixed point: the L2 bound on each site's row ``[w x, w m,
    w]``) or ``"clip"`` (distributed DP: the clip); ``ValueError`` saying which otherwise."""
    if norm_bound is None:
        return
    if privacy is not None:
        if norm_bound != "clip":
            raise ValueError(f"norm_bound={norm_bound!r} with distributed DP: the bound a "
                             "site proves is the DP clip, pass norm_bound='clip'")
        return
    if isinstance(norm_bound, bool) or not isinstance(norm_bound, (int, float)) or not (
            0 < norm_bound < math.inf):
        raise ValueError(f"norm_bound={norm_bound!r}: give the L2 bound on each site's row "
                         "[w * arrays, w * metrics, w] as a positive number ('clip' is for "
                         "distributed DP)")


def with_norm_bound(setup: RoundSetup, norm_bound: float | str) -> RoundSetup:
    """``setup`` with input validation (:func:`check_norm_bound`'s ``norm_bound``). Under
    distributed DP the sum's bits are raised if the bounded contributions of the roster
    could wrap (``secagg.validation.check_parameters``; a wider modulus changes no privacy
    parameter). ``ValueError`` (a :class:`SetupError`) naming the fix when the bound cannot
    be proved at these parameters."""
    if setup.dp is not None:
        bounded = replace(setup, norm_bound=setup.dp.clip_norm)
        bound = bounded.input_bound
        assert bound is not None
        bits = max(setup.bits, bits_for(setup.num_clients, bound))
        if bits > 64:
            raise SetupError(f"input validation at the DP clip needs {bits} bits for "
                             f"{setup.num_clients} sites (> 64): lower granularity_bits")
        bounded = replace(bounded, bits=bits, dp=replace(setup.dp, bits=bits))
    else:
        bounded = replace(setup, norm_bound=float(norm_bound))
    bounded.config(encoded_dim(bounded))  # the proof's own limits (SetupError: the fix)
    return bounded
