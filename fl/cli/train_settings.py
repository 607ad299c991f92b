"""The settings of a ``secagg train`` run, made from its parsed options
(:mod:`fl.cli.train_options`): the dataset presets filled in, the checks across options,
the federation's :class:`fl.settings.TrainSettings` and a site's :class:`dp.SitePolicy`.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from dp import SitePolicy
from fl.cli._common import parse_sites
from fl.settings import TrainSettings, dataset_defaults

SITE_POLICY_FLAGS = ("policy", "ledger", "min_noise_multiplier", "min_threshold",
                     "max_sample_rate", "max_steps", "max_releases", "round_epsilon")


PRESET_OPTIONS = ("lr", "server_lr", "batch_size", "fedprox_mu", "model", "scaling",
                  "local_steps", "strategy", "sample_rate", "clip_norm")
"""Options a dataset preset fills when not given (``--dataset tcga-brca``: FLamby's; with
``--dp distributed`` the DP protocol docs/results.md measures)."""


def preset_options(args: argparse.Namespace) -> dict[str, Any]:
    """The values of :data:`PRESET_OPTIONS`: given, else the dataset's, else the default."""
    d = TrainSettings()
    preset = dataset_defaults(args.dataset if args.csv is None else "", args.strategy,
                              args.dp or "none")
    out = {name: getattr(args, name) if getattr(args, name) is not None
           else preset.get(name, getattr(d, name)) for name in PRESET_OPTIONS}
    if args.site_weights is not None and args.role != "all":
        raise ValueError("--site-weights runs with --role all for now (the sites' histogram "
                         "releases have no wire message between the roles yet)")
    if preset and args.sites is None:
        args.sites = str(preset["sites"])
    if preset and args.rounds is None:
        args.rounds = preset["rounds"]
    return out


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    options = preset_options(args)
    ids = parse_sites(args.sites, args.role)
    rounds = args.rounds
    if rounds is None:
        if args.role != "site":
            raise ValueError(f"--role {args.role} needs --rounds")
        rounds = 1  # a site follows the coordinator's rounds
    site_flags = [f"--{name.replace('_', '-')}" for name in SITE_POLICY_FLAGS
                  if getattr(args, name, None) is not None]
    if site_flags and args.role != "site":
        raise ValueError(f"{', '.join(site_flags)}: a site's own policy (--role site); the "
                         "coordinator cannot set it")
    if getattr(args, "peer_keys", None) is not None and args.role == "all":
        raise ValueError("--peer-keys is for --role coordinator and site (with --role all "
                         "this process simulates every site)")
    return TrainSettings(
        sites=max(2, len(ids)), rounds=rounds, dataset=args.dataset, csv=args.csv,
        patient_column=args.patient_column, label_column=args.label_column,
        # A site's --dp/--epsilon/--delta are its policy (site_policy_from_args).
        dp=(args.dp or "none") if args.role != "site" else "none",
        epsilon=args.epsilon if args.role != "site" else None,
        delta=args.delta, drop_rate=args.drop_rate, max_attempts=args.max_attempts,
        unit=args.unit if args.role != "site" else "patient",  # a site's: its policy
        broker=args.broker, seed=args.seed, local_epochs=args.local_epochs,
        alpha=args.alpha, **options,
        noise_multiplier=args.noise_multiplier if args.role != "site" else None,
        cohort=args.cohort,
        checkpoint=args.checkpoint, resume=args.resume, accountant=args.accountant,
        max_units=args.max_units, adaptive_clip=args.adaptive_clip, scaler_file=args.scaler,
        expected_batch=args.expected_batch,
        norm_bound=args.norm_bound if args.role != "site" else None,
        clip_count_stddev=args.clip_count_stddev, site_weights=args.site_weights,
        min_site_weight=args.min_site_weight, max_site_weight=args.max_site_weight,
        weights_epsilon=args.weights_epsilon,
        budget_column=args.budget_column if args.role != "site" else None,
        budget_classes=args.budget_classes if args.role != "site" else None,
        max_records_per_patient=(args.max_records_per_patient if args.role != "site"
                                 else None),
        feature_bounds=args.feature_bounds, scaler_epsilon=args.scaler_epsilon,
        security="malicious" if args.role == "coordinator" and args.peer_keys else
        "semi-honest")


def site_policy_from_args(args: argparse.Namespace) -> SitePolicy:
    """The site operator's :class:`dp.policy.SitePolicy`: ``--policy`` then the flags.
    Exact releases need the operator's opt-in (``--dp none`` or a policy file listing mode
    none); the privacy unit is ``--unit`` (default patient)."""
    policy = SitePolicy.load(args.policy) if args.policy else SitePolicy()
    changes: dict[str, Any] = {}
    if args.dp is not None:
        changes["modes"] = (args.dp,)
    if args.epsilon is not None:
        changes["epsilon"] = args.epsilon
    if args.delta != TrainSettings().delta or not args.policy:
        changes["delta"] = args.delta
    if args.unit != TrainSettings().unit or not args.policy:
        changes["unit"] = args.unit  # the unit the operator's budget is about
    for flag in SITE_POLICY_FLAGS[2:]:
        if getattr(args, flag) is not None:
            changes[flag] = getattr(args, flag)
    return replace(policy, **changes)
