"""``secagg train``: federated training across hospitals (docs/architecture.md section 4).

``--role all`` (the default) simulates every site in this process. ``--role coordinator``
and ``--role site`` run the same training across machines: one coordinator process, and one
process per hospital holding only its own data (:mod:`fl.remote`), all meeting at an MQTT
broker (``--broker mqtt(s)://user@host:port``) with an identity each.

Every round is one secure aggregation over the chosen broker (the embedded MQTT broker by
default: nothing to install). Progress goes to stderr, the per-round JSON report to
``--report`` (``round``, ``accuracy``, ``loss``, ``epsilon``, ``delta``, ``included``, plus
``dropped``, ``aggregate_correct``, ...). Training stops before the round that would exceed
the privacy budget and says so. ``--checkpoint DIR`` saves after every round; ``--resume``
continues from it. Torch is imported inside :func:`run` only, so ``secagg simulate`` and
``secagg budget`` work on a core install.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from dp import MODES as DP_MODES
from dp import TORCH_EXTRA_INSTALL, UNITS, PrivacyError, SitePolicy, accountant_names
from fl.cli._common import (
    Stopped,
    UsageError,
    emit_json,
    nonnegative_int,
    parse_sites,
    progress_log,
    setup_logging,
    stop_signals,
)
from fl.data import DATASETS
from fl.settings import (
    MODELS,
    SCALING,
    STRATEGIES,
    TrainSettings,
    dataset_defaults,
)
from transport import SERVER_USER, LinkLost, MqttNetwork, parse_broker_url, probe, site_name

ROLES = ("all", "coordinator", "site")


def _epsilons(text: str) -> tuple[float, ...]:
    """``--budget-classes``: comma-separated positive epsilons."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers, e.g. 1,3") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every class a positive epsilon")
    return values


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "train", help="federated training across simulated hospitals with secure aggregation",
        description="Train one model across simulated hospital sites: every round the sites' "
                    "updates (and sample counts) are summed by secure aggregation over MQTT, "
                    "optionally with differential privacy.")
    d = TrainSettings()
    # Options by who reads them: a site operator reads "every role" and "site" only.
    r = p.add_argument_group("every role: the data, the model and the privacy mode")
    c = p.add_argument_group("coordinator (--role all or coordinator): rounds, local "
                             "training, privacy plan")
    m = p.add_argument_group("coordinator across machines (--role coordinator)")
    t = p.add_argument_group("site (--role site)")
    n = p.add_argument_group("connection (--role coordinator and site)")
    o = p.add_argument_group("results")
    o.add_argument("--save-model", metavar="PATH.pt",
                   help="write the final model's torch state_dict here (load it with "
                        "model.load_state_dict(torch.load(PATH))) and its layout, labels and "
                        "feature scaler to PATH.json")
    r.add_argument("--role", choices=ROLES, default="all",
                   help="all: coordinator and simulated sites in this process (default); "
                        "coordinator / site: one party of a federation across machines")
    r.add_argument("--sites", metavar="S|ID,ID,..",
                   help="number of sites (ids 1..S) or their ids; required for --role all "
                        "and coordinator, and for a site of a bundled --dataset (its shard)")
    c.add_argument("--rounds", type=int, metavar="R", help="training rounds (not for sites)")
    t.add_argument("--site-id", type=int, metavar="N", help="--role site: this site's id "
                   "(it connects as MQTT user site-N)")
    t.add_argument("--signing-key", metavar="site-N.key",
                   help="site: this site's identity key (secagg keygen); with --peer-keys")
    n.add_argument("--peer-keys", metavar="DIR",
                   help="coordinator/site: the federation's public keys, one site-<id>.pub "
                        "per site, from the operators (out of band): rounds run "
                        "authenticated (secagg malicious mode) and a site refuses a round "
                        "naming a site it has no key for (docs/privacy.md)")
    n.add_argument("--federation", default="fl", metavar="NAME",
                   help="coordinator/site: the federation's topic name (default fl); lets "
                        "several federations share a broker")
    m.add_argument("--eval-csv", metavar="PATH",
                   help="coordinator with --csv sites: held-out table to evaluate on")
    m.add_argument("--labels", metavar="A,B,..",
                   help="coordinator with --csv sites: the federation's label values (sites "
                        "do not announce theirs); a --csv site: pin that public list (it "
                        "takes part only in rounds announcing exactly it)")
    n.add_argument("--password-file", metavar="PATH",
                   help="coordinator/site: MQTT password (else $SECAGG_BROKER_PASSWORD or "
                        "the URL's)")
    m.add_argument("--join-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="coordinator: how long to wait for every site before starting "
                        "(default 600)")
    m.add_argument("--ready-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="coordinator: how long a round waits for the sites' local training "
                        "(default 300)")
    n.add_argument("--connect-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="give up reaching the broker after this long, at the start and "
                        "after a lost connection (default 30)")
    n.add_argument("--stage-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="coordinator/site: secure-aggregation stage deadline (default 60)")
    t.add_argument("--idle-timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="site: exit after this long without word from the coordinator")
    c.add_argument("--max-units", type=int, metavar="N",
                   help="--dp distributed: public bound on the patients (records) a site "
                        "sums in a round; the modulus is sized for it (default 100000)")
    n.add_argument("--insecure-verify", action="store_true",
                   help="TESTING ONLY, defeats secure aggregation: sites also send their "
                        "input in the clear so the coordinator can verify each aggregate "
                        "(a site sends it only when it is started with this flag too, and "
                        "refuses it unless it runs --dp none)")
    r.add_argument("--dataset", choices=DATASETS, default=d.dataset,
                   help="breast-cancer (scikit-learn's bundled clinical set, one record per "
                        "patient), ehr (synthetic longitudinal EHR, several visits per "
                        "patient), digits (scikit-learn's 8x8 images, for --model cnn) or "
                        "tcga-brca (FLamby's Fed-TCGA-BRCA survival set: its 6 centers are "
                        "the sites, Cox model, C-index, FLamby's protocol by default); "
                        f"default {d.dataset}")
    r.add_argument("--csv", metavar="PATH", help="train on your own table instead")
    r.add_argument("--patient-column", metavar="COL", help="patient id column of --csv")
    r.add_argument("--label-column", metavar="COL", help="label column of --csv")
    r.add_argument("--dp", choices=DP_MODES, default=None,
                   help="privacy mode (default none); a site takes part only in rounds of "
                        "this mode when given, and without it in DP rounds only (--dp none "
                        "is a site operator's opt-in to exact releases)")
    r.add_argument("--epsilon", type=float, metavar="E",
                   help="total privacy budget per patient (a site: its own budget)")
    r.add_argument("--delta", type=float, default=d.delta, metavar="D",
                   help=f"delta (default {d.delta:g})")
    r.add_argument("--unit", choices=UNITS, default=d.unit,
                   help="privacy unit (default patient; a site refuses DP rounds computed "
                        "per another unit); patient-idp: patient-level DP by "
                        "individual per-record sampling rates (--dp site; a site plans its "
                        "own rate groups; docs/patient_privacy.md)")
    r.add_argument("--budget-column", metavar="COL",
                   help="--unit patient-idp with --csv (--role all or site): column with "
                        "each patient's own epsilon (at most --epsilon); read by the site, "
                        "never sent")
    r.add_argument("--budget-classes", type=_epsilons, metavar="E1,E2,...",
                   help="--budget-column: the declared target classes (public); a patient's "
                        "budget is rounded down to one, below them all it is never sampled")
    r.add_argument("--max-records-per-patient", type=int, metavar="K",
                   help="--unit patient-idp (--role all or site): keep each patient's first K "
                        "records and never sample the rest (the cut-off of Kaiser et al.); "
                        "the declared record classes are 1..K, planned whatever the table "
                        "holds (default 8); the records dropped are counted in the report "
                        "and on the terminal")
    c.add_argument("--drop-rate", type=float, default=d.drop_rate, metavar="P",
                   help="probability a site drops out of a round, at a random stage")
    c.add_argument("--max-attempts", type=int, default=d.max_attempts, metavar="N",
                   help="attempts at each round before the run fails (a round aborts when "
                        "too many sites drop out; each attempt is a fresh secure round)")
    r.add_argument("--broker", default=d.broker, metavar="embedded|memory|mosquitto|mqtt://..",
                   help="embedded MQTT broker (default), in-process memory bus, a local "
                        "Mosquitto, or an existing broker's URL")
    o.add_argument("--report", metavar="REPORT.json", help="write the JSON report here")
    o.add_argument("--plot", metavar="PATH.png", help="plot accuracy and epsilon per round")
    r.add_argument("--seed", type=nonnegative_int, default=d.seed, metavar="S",
                   help="seeds data splits, model init, shuffles and the drop schedule "
                        "(never the masks or the DP noise)")
    o.add_argument("--checkpoint", metavar="DIR", help="save a checkpoint after every round")
    o.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    c.add_argument("--local-epochs", type=int, default=d.local_epochs, metavar="E",
                   help=f"local passes over a site's data per round (default {d.local_epochs})")
    c.add_argument("--fedprox-mu", type=float, default=None, metavar="MU",
                   help="FedProx proximal weight (default 0: FedAvg)")
    c.add_argument("--lr", type=float, default=None, metavar="LR",
                   help=f"local learning rate (default {d.lr})")
    c.add_argument("--server-lr", type=float, default=None, metavar="LR",
                   help=f"step applied to the averaged update (default {d.server_lr})")
    c.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help=f"local minibatch size (default {d.batch_size})")
    r.add_argument("--model", choices=MODELS, default=None,
                   help="logreg or mlp for tables, cnn for square images such as --dataset "
                        f"digits, cox for survival (default {d.model}; tcga-brca: cox)")
    c.add_argument("--alpha", type=float, default=d.alpha,
                   help=f"Dirichlet non-IID concentration (default {d.alpha})")
    c.add_argument("--clip-norm", type=float, default=None, metavar="C",
                   help=f"DP: per-patient L2 clip norm (default {d.clip_norm}; tcga-brca "
                        "with --dp distributed: 1.0)")
    c.add_argument("--sample-rate", type=float, default=None,
                   help=f"DP: patient sampling rate per step (default {d.sample_rate}; "
                        "tcga-brca with --dp distributed: 0.5)")
    c.add_argument("--expected-batch", type=float, metavar="B",
                   help="--dp site: the patients a site samples per step on average, as the "
                        "operator declares it (public; the noised sum is divided by it). "
                        "Default: no division (the sum; the learning rate is per patient). "
                        "Never computed from a site's records")
    c.add_argument("--norm-bound", type=float, metavar="B",
                   help="input validation (--dp none; FedAvg, FedProx or a server optimizer): "
                        "each site proves in zero knowledge that its row [n x, n] has L2 norm "
                        "<= B and its weight n >= 0 (a site with a longer row lowers its "
                        "weight); a site whose proof fails is left out and named "
                        "(docs/protocol.md 10; needs the validation extra)")
    c.add_argument("--noise-multiplier", type=float, metavar="Z",
                   help="DP: fix the noise instead of calibrating it to --epsilon/--rounds "
                        "(epsilon is still accounted and reported)")
    r.add_argument("--accountant", choices=accountant_names(), default=d.accountant,
                   help="rdp (default) or prv (tighter; --dp site, the sampled Gaussian); "
                        "--unit patient-idp: rdp or pld (dp-accounting's privacy loss "
                        "distribution of each rate group: tighter for patients with many "
                        "records, slower to plan; --role all only: a site's ledger composes RDP)")
    c.add_argument("--adaptive-clip", type=float, metavar="QUANTILE",
                   help="--dp site or distributed: private adaptive clipping (Andrew et al. "
                        "2021) toward this quantile of patient gradient norms, its noised "
                        "count accounted jointly (distributed: in the same secure sum)")
    c.add_argument("--site-weights", type=float, metavar="LAMBDA",
                   help="--dp distributed, --model discrete-time: DP-FedAvg+'s site weights "
                        "exp(-LAMBDA W1) from each site's noised histogram of observed times "
                        "(charged to --epsilon), each site scaling its update before masking")
    c.add_argument("--min-site-weight", type=float, default=d.min_site_weight,
                   help=f"--site-weights: lower clip of a weight (default {d.min_site_weight})")
    c.add_argument("--max-site-weight", type=float, default=d.max_site_weight,
                   help=f"--site-weights: upper clip; the noise is calibrated to it times the "
                        f"clip (default {d.max_site_weight})")
    c.add_argument("--weights-epsilon", type=float, metavar="EPS",
                   help="--site-weights: the histograms' share of --epsilon (default 25 %%)")
    c.add_argument("--clip-count-stddev", type=float, metavar="S",
                   help="--adaptive-clip: noise stddev of the clip count (default 10 x "
                        "the noise multiplier)")
    c.add_argument("--scaler", metavar="SCALER.json",
                   help="public feature statistics {\"mean\": [..], \"std\": [..]} (e.g. of a "
                        "reference population): scales without releasing anything")
    c.add_argument("--feature-bounds", metavar="BOUNDS.json",
                   help="public per-feature ranges {\"low\": [..], \"high\": [..]}: with --dp "
                        "the feature scaler is a noised secure sum of the features clipped "
                        "to them, charged to the budget (bundled breast-cancer: published)")
    c.add_argument("--scaler-epsilon", type=float, metavar="E",
                   help="--dp: the noised feature statistics' share of --epsilon (default "
                        "10 %%; 0.5 without --epsilon); the rounds get the rest")
    c.add_argument("--plan", action="store_true",
                   help="print the privacy plan (mode, mechanism, noise, threshold, epsilon "
                        "after each round) computed by the code the run uses, and exit")
    o.add_argument("--json", action="store_true",
                   help="print the run's report (with --plan: the plan) as one JSON object on "
                        "stdout; progress stays on stderr")
    site = p.add_argument_group(
        "site privacy policy (--role site; set by the site's operator, never the "
        "coordinator; with --dp the site takes part only in that mode, and --epsilon/--delta "
        "are its own budget)")
    site.add_argument("--policy", metavar="POLICY.json",
                      help="the site's policy file (dp.policy.SitePolicy fields); the flags "
                           "below override it")
    site.add_argument("--ledger", metavar="PATH",
                      help="the site's persistent privacy ledger (default STATE/secagg/"
                           "ledger-site-<id>-<sha256 of the site's data>.json, STATE = "
                           "$XDG_STATE_HOME or ~/.local/state: the same data keeps its "
                           "ledger whatever the broker or federation)")
    site.add_argument("--min-noise-multiplier", type=float, metavar="Z",
                      help="refuse rounds whose noise multiplier is below Z")
    site.add_argument("--min-threshold", type=int, metavar="T",
                      help="refuse rounds decodable from, or calibrated to, fewer than T "
                           "sites (default 2)")
    site.add_argument("--max-sample-rate", type=float, metavar="Q",
                      help="refuse rounds that sample patients at a rate above Q")
    site.add_argument("--max-steps", type=int, metavar="N",
                      help="refuse site-mode rounds of more than N DP-SGD steps")
    site.add_argument("--round-epsilon", type=float, metavar="E",
                      help="refuse a release that alone costs more than epsilon E (default "
                           "4; the total is --epsilon, default 10)")
    site.add_argument("--max-releases", type=int, metavar="N",
                      help="take part in at most N releases in all (the ledger counts them)")
    c.add_argument("--cohort", type=int, metavar="K", help="sites per round (default all)")
    c.add_argument("--scaling", choices=SCALING, default=None,
                   help="feature scaling: secure sum of statistics, none, or auto (default; "
                        "tcga-brca: none, as FLamby)")
    # Strategies and the dataset presets (fl/strategies.py, fl.settings.dataset_defaults).
    c.add_argument("--strategy", choices=STRATEGIES, default=None,
                   help="fedavg (default; tcga-brca with --dp distributed: fedadam), "
                        "fedprox, scaffold (control variates in the same secure sum), or a "
                        "server optimizer on the secure sum: fedadam, fedyogi, fedadagrad "
                        "(Reddi et al. 2021)")
    c.add_argument("--local-steps", type=int, default=None, metavar="K",
                   help="local minibatch updates per round instead of --local-epochs passes "
                        "(tcga-brca: 100, FLamby's protocol)")
    p.set_defaults(command="train")
    return p


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


def site_policy_from_args(args: argparse.Namespace) -> Any:
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


def default_ledger(site_id: int, data: Any) -> str:
    """``$XDG_STATE_HOME/secagg/ledger-site-<id>-<data fingerprint>.json``: one ledger per
    site and data set, outside any working tree. Nothing the coordinator chooses (broker
    address, federation name) is in the name, so no coordinator can start a site on a fresh
    budget; only changed data (another CSV) starts another ledger (docs/privacy.md)."""
    from fl.site.core import state_directory

    return str(state_directory() / f"ledger-site-{site_id}-{data.fingerprint()[:24]}.json")


def print_plan(args: argparse.Namespace, settings: TrainSettings) -> int:
    """``--plan``: the run's privacy plan, from the functions the run itself calls."""
    from fl.federation import privacy_plan, site_charge

    # --role coordinator: at the figure its sites charge (their own noise share only,
    # unless they know each other's keys: fl.federation.site_charge)
    charged = (site_charge(getattr(args, "peer_keys", None) is not None)
               if args.role == "coordinator" else None)
    plan = privacy_plan(settings, charged)  # a DataError or ValueError: exit 2
    if args.json:
        print(json.dumps(plan))
        return 0
    print(f"privacy plan: {plan['description']}")
    print(f"  mode {plan['mode']}, mechanism {plan['mechanism']}, accountant "
          f"{plan['accountant']}, delta {plan['delta']:g}, secagg threshold "
          f"{plan['secagg_threshold']} of {plan['cohort']} sites, feature scaling "
          f"{plan['feature_scaling']}")
    eps = plan["epsilon_after"]
    if plan["mode"] == "none":
        print(f"  {plan['rounds_run']} rounds, no differential privacy")
    else:
        budget = plan["epsilon_budget"]
        print(f"  {plan['rounds_run']} of {plan['rounds_requested']} rounds run"
              + (f" (budget epsilon {budget:g} affords "
                 f"{plan['rounds_affordable'] or 'more than 100000'})" if budget else ""))
        if plan.get("site_weights"):
            print(f"  site weights: {plan['site_weights']}")
        if plan.get("epsilon_before_rounds"):
            before = [what for what, on in (
                ("the noised feature statistics", plan["feature_scaling"].startswith("noised")),
                ("the site weights' histograms", bool(plan.get("site_weights")))) if on]
            print(f"  before round    1: epsilon {plan['epsilon_before_rounds']:.4f} "
                  f"({' and '.join(before)})")
        for r, e in enumerate(eps, 1):
            if r <= 3 or r > len(eps) - 3 or r % max(1, len(eps) // 10) == 0:
                print(f"  after round {r:4d}: epsilon {e:.4f}")
    if plan.get("sources"):
        by: dict[str, list[str]] = {}
        for name, source in plan["sources"].items():
            if name == "noised":
                print(f"  noised releases: {source}")
                continue
            by.setdefault(source.split(" ")[0], []).append(name)
        for kind in ("operator", "public", "noised", "site-local"):
            if by.get(kind):
                print(f"  {kind}{' (declared)' if kind == 'operator' else ''}: "
                      + ", ".join(by[kind]))
    for warning in plan["warnings"]:
        print(f"  warning: {warning}")
    return 0


def broker_settings(args: argparse.Namespace, user: str) -> Any:
    """The ``--broker`` URL of a coordinator or site, with its password from a file or the
    environment (a password in the URL shows in the process list)."""
    if not args.broker.startswith(("mqtt://", "mqtts://")):
        raise ValueError(f"--role {args.role} connects to a broker shared by every party: "
                         "give --broker mqtt(s)://[user[:password]@]host:port")
    settings = parse_broker_url(args.broker)
    password = settings.password
    if args.password_file is not None:
        try:
            password = Path(args.password_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"--password-file: {exc}") from None
    elif password is None and os.environ.get("SECAGG_BROKER_PASSWORD"):
        password = os.environ["SECAGG_BROKER_PASSWORD"]
    username = settings.username
    if username is None and password is not None:
        username = user

    return replace(settings, username=username, password=password,
                   connect_timeout=args.connect_timeout,
                   reconnect_timeout=args.connect_timeout)


def _torch_missing() -> bool:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("opacus") is None:
        print(f"secagg train: this needs torch and opacus: install the extra with "
              f"{TORCH_EXTRA_INSTALL}", file=sys.stderr)
        return True
    return False


VACUOUS_EPSILON = 20.0
"""Above this ``--epsilon`` the guarantee is empty in practice: DP bounds by ``e**epsilon``
how much one patient's records can change the odds of anything the run releases, and
``e**20`` is about 5e8."""


def _warn_vacuous_epsilon(args: argparse.Namespace) -> None:
    epsilon = getattr(args, "epsilon", None)
    if epsilon is not None and epsilon > VACUOUS_EPSILON:
        print(f"secagg train: warning: --epsilon {epsilon:g} protects nothing: differential "
              f"privacy bounds by e^epsilon (here above e^{VACUOUS_EPSILON:g}, about "
              f"{math.exp(VACUOUS_EPSILON):.0e}) how much one patient's records can change "
              "what the run releases, and the noise it buys is negligible; pick epsilon "
              "of a few units (e.g. 1-8), or --dp none for an exact sum said as such",
              file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """``secagg train``. Errors go to the command line's one error path (fl/cli/app.py): a
    ``ValueError`` (bad options, data, checkpoint, policy) exits 2, a runtime failure (a
    round that kept aborting, a lost broker) exits 1, each in one line; SIGINT or SIGTERM
    (also in a process started in the background) stops it with one line and exit
    128 + the signal, as ``secagg simulate``."""
    try:
        with stop_signals():
            return _run(args)
    except Stopped as stopped:
        print(f"secagg train: interrupted by {signal.Signals(stopped.signum).name}",
              file=sys.stderr)
        return 128 + stopped.signum


def _run(args: argparse.Namespace) -> int:
    if _torch_missing():
        return 2
    _warn_vacuous_epsilon(args)
    if args.role != "all" and not (args.plan and args.role == "coordinator"):
        return run_remote(args)
    settings = settings_from_args(args)
    if args.plan:
        return print_plan(args, settings)
    from fl.aggregation import check_broker
    from fl.errors import RunFailed
    from fl.federation import train

    check_broker(settings.broker)
    check_output_paths(args)
    log = progress_log(args, "train")
    setup_logging(args, "train")
    completed: list[dict[str, Any]] = []
    try:
        report = train(settings, log=log, on_failure=completed.append)
    except Exception as exc:
        if not completed or not completed[0]["rounds"]:
            raise  # no round completed: nothing to write, the failure as it is
        _finish_failed(args, settings, completed[0])
        raise RunFailed(exc, completed[0], "continue with --resume" if settings.checkpoint
                        else "") from exc
    return _finish(args, settings, report)


def run_remote(args: argparse.Namespace) -> int:
    """``--role coordinator`` or ``--role site``: one party of a federation across machines."""
    settings, ids = _remote_settings(args)

    user = site_name(args.site_id) if args.role == "site" else SERVER_USER
    broker = broker_settings(args, user)
    network = MqttNetwork(broker)
    tag = f"site {args.site_id}" if args.role == "site" else "coordinator"
    log = progress_log(args, tag)
    setup_logging(args, tag)
    if args.role == "site":  # the site's own configuration is checked before the network
        return _run_site(args, settings, ids, network, log,
                         probe=lambda: _probe_broker(broker, user, args.connect_timeout))
    _probe_broker(broker, user, args.connect_timeout)
    return _run_coordinator(args, settings, ids, network, log)


def _probe_broker(broker: Any, user: str, timeout: float) -> None:
    """Fail in seconds, with the cause, when nothing accepts connections at ``--broker``'s
    address (a wrong host or port), instead of after the connection's retries."""
    try:
        probe(broker, timeout=min(5.0, timeout))
    except LinkLost as exc:
        raise LinkLost(f"{user}: {exc} (check --broker's host and port; is the broker "
                       "running? `secagg broker` runs one)") from None


def _remote_settings(args: argparse.Namespace) -> tuple[TrainSettings, tuple[int, ...]]:
    """The options of a party across machines, checked before anything connects."""
    if args.role == "site" and args.accountant == "pld":
        raise UsageError("a site's ledger composes each rate group's RDP: --role site plans "
                         "with --accountant rdp")
    if args.max_records_per_patient is not None and args.role == "coordinator":
        raise UsageError("--max-records-per-patient is read by each site (--role site with "
                         "--unit patient-idp), never by the coordinator")
    if args.budget_column is not None and (args.role != "site" or args.csv is None
                                           or args.unit != "patient-idp"):
        raise UsageError("--budget-column is read by each site (--role site with --csv and "
                         "--unit patient-idp), never by the coordinator")
    settings = settings_from_args(args)
    ids = parse_sites(args.sites, args.role)
    if args.role == "site":
        if args.site_id is None or not 1 <= args.site_id < 1 << 32:
            raise UsageError("--role site needs --site-id N (it connects as site-N)")
        if settings.csv is None and not ids:
            raise UsageError("a site of a bundled --dataset needs --sites (the number of "
                             "shards) to pick its shard by --site-id and --seed")
        if (args.signing_key is None) != (args.peer_keys is None):
            raise UsageError("--signing-key and --peer-keys go together: this site's key and "
                             "the federation's public keys (secagg keygen)")
    else:
        if args.site_id is not None:
            raise UsageError("--site-id is for --role site")
        if args.signing_key is not None:
            raise UsageError("--signing-key is a site's (--role site); the coordinator needs "
                             "only --peer-keys")
    if args.drop_rate:
        raise UsageError("--drop-rate simulates dropouts in --role all; across machines stop "
                         "or kill a site instead")
    check_output_paths(args)
    if args.eval_csv is not None and settings.csv is None:
        raise UsageError("--eval-csv goes with --csv (sites with their own tables)")
    from fl.remote.messages import FedTopics

    FedTopics(args.federation)
    return settings, ids


def _site_data(args: argparse.Namespace, settings: TrainSettings, ids: tuple[int, ...]
               ) -> Any:
    from fl.remote.inputs import SiteData, demo_site_data

    if settings.csv is None:
        if args.labels is not None:
            raise UsageError("--labels on a site goes with --csv (a bundled dataset's labels "
                             "are fixed)")
        return demo_site_data(settings, args.site_id, ids)
    labels = None if args.labels is None else [v.strip() for v in args.labels.split(",")]
    return SiteData(args.site_id, csv=settings.csv, patient_column=settings.patient_column,
                    label_column=settings.label_column, labels=labels,
                    budget_column=args.budget_column)


def _run_site(args: argparse.Namespace, settings: TrainSettings, ids: tuple[int, ...],
              network: Any, log: Any, probe: Callable[[], None]) -> int:
    """``--role site``: the hospital's own process, wrapped around its site core; ``probe``
    checks the broker once the site's own configuration has been checked."""
    from fl.remote.site import SiteOptions, SiteProcess
    from fl.site.core import open_site_core
    from fl.site.identity import SiteIdentity, fingerprint

    data = _site_data(args, settings, ids)
    identity = None if args.peer_keys is None else SiteIdentity.load(
        args.site_id, args.signing_key, args.peer_keys)
    ledger = args.ledger or default_ledger(args.site_id, data)
    try:
        guard = open_site_core(policy=site_policy_from_args(args), ledger_path=ledger, log=log)
    except (PrivacyError, OSError) as exc:
        raise UsageError(f"site privacy ledger/policy: {exc}") from None
    try:
        log(f"{guard.ledger.policy.describe()}; ledger {ledger} "
            f"({guard.ledger.releases} releases, epsilon {guard.ledger.epsilon:.4g})")
        if guard.ledger.policy.unit == "patient-idp":
            _site_idp(args, data, guard, log)
        options = SiteOptions(federation=args.federation, insecure_verify=args.insecure_verify,
                              require_dp=args.dp, idle_timeout=args.idle_timeout,
                              stage_timeout=args.stage_timeout, guard=guard,
                              identity=identity)
        if identity is not None:
            log(f"federation roster: {len(identity.peers)} site keys from {args.peer_keys}; "
                f"this site's key {fingerprint(identity.signing_key.public)}; rounds run "
                "authenticated (secagg malicious mode)")
        else:
            log("no --peer-keys: the roster is the coordinator's word, so a distributed "
                "round is charged as if this site's noise share were the only noise")
        site = SiteProcess(data, network, options, log)  # refuses e.g. --insecure-verify
        probe()
        return int(asyncio.run(site.run()))
    finally:
        guard.ledger.close()  # release the ledger's lock


def _site_idp(args: argparse.Namespace, data: Any, guard: Any, log: Any) -> None:
    """The site's own patient-idp rate groups, from its own table and budgets."""
    from fl.site.idp import SitePatients

    policy = guard.ledger.policy
    data.idp = SitePatients(args.site_id, data.table(data.schema.labels),
                            epsilon=policy.epsilon, delta=policy.delta,
                            max_records=args.max_records_per_patient,
                            budget_classes=args.budget_classes)
    log(f"patient-idp: {len(data.idp.groups.sizes)} rate groups from this site's table "
        "(records per patient" + (", --budget-column" if args.budget_column else "")
        + "); each is charged on its own")
    if args.max_records_per_patient is not None:
        groups = data.idp.groups
        log(f"--max-records-per-patient {args.max_records_per_patient}: "
            f"{groups.dropped_records} of {len(groups.record_group)} records dropped "
            "(never sampled)")


def _run_coordinator(args: argparse.Namespace, settings: TrainSettings,
                     ids: tuple[int, ...], network: Any, log: Any) -> int:
    """``--role coordinator``: announces the rounds and runs the server side."""
    from fl.errors import RunFailed
    from fl.remote.coordinator import RemoteOptions, train_coordinator
    from fl.site.identity import load_peer_keys

    labels = tuple(v.strip() for v in args.labels.split(",")) if args.labels else None
    peer_keys = None if args.peer_keys is None else load_peer_keys(args.peer_keys)
    options = RemoteOptions(site_ids=ids, federation=args.federation, labels=labels,
                            eval_csv=args.eval_csv, join_timeout=args.join_timeout,
                            ready_timeout=args.ready_timeout, stage_timeout=args.stage_timeout,
                            max_units=args.max_units, insecure_verify=args.insecure_verify,
                            peer_keys=peer_keys)
    try:
        report = train_coordinator(settings, options, network, log=log)
    except RunFailed as exc:  # (the sites were not sent home)
        _finish_failed(args, settings, exc.report)
        raise
    return _finish(args, settings, report)


def _finish_failed(args: argparse.Namespace, settings: TrainSettings,
                   report: dict[str, Any]) -> None:
    """Whatever ended the run, its completed rounds' report and model are written (the
    caller then raises the one-line error: exit 1)."""
    try:
        _finish(args, settings, report)
    except (OSError, ValueError) as unwritten:  # e.g. the same full disk
        print(f"secagg train: the completed rounds' report or model could not be "
              f"written: {unwritten}", file=sys.stderr)


def check_output_paths(args: argparse.Namespace) -> None:
    """Refuse before training when an output could not be written afterwards: a missing or
    read-only folder for ``--report``, ``--plot``, ``--save-model``, and a ``--checkpoint``
    that is a file, read-only or writable by others (:func:`fl.checkpoint.check_directory`)."""
    from fl.checkpoint import check_directory, check_writable

    for option, path in (("--report", args.report), ("--plot", args.plot),
                         ("--save-model", args.save_model)):
        if path is not None:
            if Path(path).is_dir():
                raise ValueError(f"{option} {path} is a directory: name a file")
            check_writable(Path(path).resolve().parent, f"{option} {path}")
    if getattr(args, "checkpoint", None) is not None:
        check_directory(args.checkpoint)


def _save_model(path: str, report: dict[str, Any]) -> None:
    from fl.checkpoint import save_model
    from fl.models import make_model
    from fl.vector import ParameterLayout

    info = report["model_info"]
    model = make_model(info["model"], info["in_features"], info["num_classes"])
    ParameterLayout.of(model).load(model, report["model"])
    save_model(path, model, info)


def _source(settings: TrainSettings, name: str) -> str:
    """Where a release's parameter comes from: the operator's flag, a public computation
    from declared figures, or a noised release; never the records."""
    declared = {"sample_rate": "--sample-rate", "steps": "--site-steps/--local-epochs",
                "calibration_threshold": "the secagg threshold (--cohort, --sites)",
                "max_site_weight": "--max-site-weight", "expected_batch": "--expected-batch",
                "count_stddev": "--clip-count-stddev (or 10 x the noise multiplier)"}
    if name == "noise_multiplier" or name == "per_site_noise_stddev":
        return ("operator (--noise-multiplier)" if settings.noise_multiplier is not None
                else "public (calibrated to --epsilon, --delta, --rounds, --sample-rate)")
    if name == "clip_norm":
        return ("noised (adaptive clip: post-processing of the noised clip counts)"
                if settings.adaptive_clip is not None else "operator (--clip-norm)")
    if name == "bits":
        return "public (from --max-units, never a site's count)"
    return f"operator ({declared[name]})" if name in declared else "public"


#: The two neighbour relations a run's epsilons can be stated under, side by side.
EPSILON_UNITS = {
    "patient": {"unit": "patient", "relation": "add/remove one patient with all its records "
                "(--unit record: one record; patient-idp: each rate group's own figure)",
                "who": "the coordinator's accountant, composed over every release"},
    "site": {"unit": "site (a whole node)", "relation": "add/remove one site",
             "who": "not accounted by secagg train: no release bounds a whole site's "
                    "contribution (Flower's client-level DistributedDP does, docs/flower.md)"},
}


def add_sources(settings: TrainSettings, report: dict[str, Any]) -> None:
    """Per release, every parameter it used with its source, and the run's epsilons with
    their unit and neighbour relation side by side (docs/privacy.md, "Every parameter and its
    source")."""
    names = ("noise_multiplier", "sample_rate", "steps", "count_stddev",
             "per_site_noise_stddev", "calibration_threshold", "max_site_weight", "clip_norm")
    clips = {r["round"]: r.get("clip_norm") for r in report.get("rounds") or []}
    for release in report.get("releases") or []:
        release["parameters"] = {k: {"value": release[k], "source": _source(settings, k)}
                                 for k in names if release.get(k) is not None}
        if release.get("round", 0) >= 1 and "clip_norm" not in release["parameters"]:
            clip = clips.get(release["round"]) or settings.clip_norm
            release["parameters"]["clip_norm"] = {"value": clip,
                                                  "source": _source(settings, "clip_norm")}
        if release.get("mode") == "site" and settings.unit != "patient-idp":
            release["parameters"]["expected_batch"] = {
                "value": settings.expected_batch,
                "source": ("operator (--expected-batch)" if settings.expected_batch
                           else "public (none: the noised sum is not divided)")}
    last = next((r["epsilon"] for r in reversed(report.get("rounds") or [])
                 if r.get("epsilon") is not None), None)
    report["epsilons"] = [{**EPSILON_UNITS["patient"], "epsilon": last, "delta": settings.delta},
                          {**EPSILON_UNITS["site"], "epsilon": None, "delta": None}]


def _finish(args: argparse.Namespace, settings: TrainSettings, report: dict[str, Any]) -> int:
    """Write the report, model and plot, print the summary (the same for every role)."""
    if args.save_model is not None and report["rounds"]:
        _save_model(args.save_model, report)
        progress_log(args, "train")(f"model saved to {args.save_model} (state_dict; layout "
                                    f"in {args.save_model}.json)")
    report.pop("model", None)
    report["command"] = "train"
    add_sources(settings, report)
    if report["stopped"]:
        print(f"secagg train: stopped: {report['stopped']}", file=sys.stderr)
    if args.json:
        emit_json(report)
    if args.report is not None:
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.plot is not None and report["rounds"]:
        from fl.plot import plot_rounds

        plot_rounds(report["rounds"], args.plot,
                    f"{settings.sites} sites, dp={settings.dp}"
                    + (f", epsilon<={settings.epsilon:g}" if settings.epsilon else ""))
    last = report["rounds"][-1] if report["rounds"] else None
    summary = sys.stderr if args.json else sys.stdout  # stdout holds only the JSON
    if last is not None:
        eps = f", epsilon {last['epsilon']:.3f}" if last["epsilon"] is not None else ""
        acc = (f"final test accuracy {last['accuracy']:.4f}" if last["accuracy"] is not None
               else f"final test C-index {last['c_index']:.4f}"
               if last.get("c_index") is not None else "no test set")
        print(f"secagg train: {len(report['rounds'])} rounds, {acc}{eps}", file=summary)
    else:
        print("secagg train: no round was run", file=summary)
    return 0
