"""The options of ``secagg train``: its parser, one function per section of its help (who
reads it: every role, the coordinator, a site, the connection, the results, a site's
privacy policy). The settings made from them: :mod:`fl.cli.train_settings`; running the
command: :mod:`fl.cli.train`.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from dp import MODES as DP_MODES
from dp import UNITS, accountant_names
from fl.cli._common import nonnegative_int
from fl.data import DATASETS
from fl.settings import MODELS, SCALING, STRATEGIES, TrainSettings

ROLES = ("all", "coordinator", "site")
Group = argparse._ArgumentGroup  # a section of the help


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
    # Options by who reads them: a site operator reads "every role" and "site" only. One
    # function per section of the help, in its order.
    group = p.add_argument_group
    _every_role_options(group("every role: the data, the model and the privacy mode"), d)
    _coordinator_options(group("coordinator (--role all or coordinator): rounds, local "
                               "training, privacy plan"), d)
    _across_machines_options(group("coordinator across machines (--role coordinator)"))
    _site_options(group("site (--role site)"))
    _connection_options(group("connection (--role coordinator and site)"))
    _results_options(group("results"))
    _site_policy_options(group(
        "site privacy policy (--role site; set by the site's operator, never the "
        "coordinator; with --dp the site takes part only in that mode, and --epsilon/--delta "
        "are its own budget)"))
    p.set_defaults(command="train")
    return p


def _every_role_options(r: Group, d: TrainSettings) -> None:
    """Every role: the role, the data, the privacy mode and budget, the broker, the model."""
    # the role and the data
    r.add_argument("--role", choices=ROLES, default="all",
                   help="all: coordinator and simulated sites in this process (default); "
                        "coordinator / site: one party of a federation across machines")
    r.add_argument("--sites", metavar="S|ID,ID,..",
                   help="number of sites (ids 1..S) or their ids; required for --role all "
                        "and coordinator, and for a site of a bundled --dataset (its shard)")
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
    # the privacy mode, the budget and the unit
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
    r.add_argument("--broker", default=d.broker, metavar="embedded|memory|mosquitto|mqtt://..",
                   help="embedded MQTT broker (default), in-process memory bus, a local "
                        "Mosquitto, or an existing broker's URL")
    r.add_argument("--seed", type=nonnegative_int, default=d.seed, metavar="S",
                   help="seeds data splits, model init, shuffles and the drop schedule "
                        "(never the masks or the DP noise)")
    r.add_argument("--model", choices=MODELS, default=None,
                   help="logreg or mlp for tables, cnn for square images such as --dataset "
                        f"digits, cox for survival (default {d.model}; tcga-brca: cox)")
    r.add_argument("--accountant", choices=accountant_names(), default=d.accountant,
                   help="rdp (default) or prv (tighter; --dp site, the sampled Gaussian); "
                        "--unit patient-idp: rdp or pld (dp-accounting's privacy loss "
                        "distribution of each rate group: tighter for patients with many "
                        "records, slower to plan; --role all only: a site's ledger composes RDP)")


def _coordinator_options(c: Group, d: TrainSettings) -> None:
    """The coordinator (``--role all`` or ``coordinator``): the rounds, the local training, the
    privacy plan, the feature scaler and the strategy."""
    _rounds_options(c, d)
    _local_training_options(c, d)
    _privacy_plan_options(c, d)
    _scaler_options(c)
    c.add_argument("--plan", action="store_true",
                   help="print the privacy plan (mode, mechanism, noise, threshold, epsilon "
                        "after each round) computed by the code the run uses, and exit")
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


def _rounds_options(c: Group, d: TrainSettings) -> None:
    """How many rounds, of how many units, and what a round survives."""
    c.add_argument("--rounds", type=int, metavar="R", help="training rounds (not for sites)")
    c.add_argument("--max-units", type=int, metavar="N",
                   help="--dp distributed: public bound on the patients (records) a site "
                        "sums in a round; the modulus is sized for it (default 100000)")
    c.add_argument("--drop-rate", type=float, default=d.drop_rate, metavar="P",
                   help="probability a site drops out of a round, at a random stage")
    c.add_argument("--max-attempts", type=int, default=d.max_attempts, metavar="N",
                   help="attempts at each round before the run fails (a round aborts when "
                        "too many sites drop out; each attempt is a fresh secure round)")


def _local_training_options(c: Group, d: TrainSettings) -> None:
    """A site's local training and the server's step."""
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
    c.add_argument("--alpha", type=float, default=d.alpha,
                   help=f"Dirichlet non-IID concentration (default {d.alpha})")


def _privacy_plan_options(c: Group, d: TrainSettings) -> None:
    """The privacy plan: clipping, sampling, noise, input validation, the private clip and
    the site weights."""
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


def _scaler_options(c: Group) -> None:
    """The feature scaler: public statistics, or a noised secure sum of clipped features."""
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


def _across_machines_options(m: Group) -> None:
    """The coordinator across machines (``--role coordinator``)."""
    m.add_argument("--eval-csv", metavar="PATH",
                   help="coordinator with --csv sites: held-out table to evaluate on")
    m.add_argument("--labels", metavar="A,B,..",
                   help="coordinator with --csv sites: the federation's label values (sites "
                        "do not announce theirs); a --csv site: pin that public list (it "
                        "takes part only in rounds announcing exactly it)")
    m.add_argument("--join-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="coordinator: how long to wait for every site before starting "
                        "(default 600)")
    m.add_argument("--ready-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="coordinator: how long a round waits for the sites' local training "
                        "(default 300)")


def _site_options(t: Group) -> None:
    """A site (``--role site``): its id, its identity and how long it waits."""
    t.add_argument("--site-id", type=int, metavar="N", help="--role site: this site's id "
                   "(it connects as MQTT user site-N)")
    t.add_argument("--signing-key", metavar="site-N.key",
                   help="site: this site's identity key (secagg keygen); with --peer-keys")
    t.add_argument("--idle-timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="site: exit after this long without word from the coordinator")


def _connection_options(n: Group) -> None:
    """The connection of ``--role coordinator`` and ``site``: keys, topics, broker login,
    deadlines."""
    n.add_argument("--peer-keys", metavar="DIR",
                   help="coordinator/site: the federation's public keys, one site-<id>.pub "
                        "per site, from the operators (out of band): rounds run "
                        "authenticated (secagg malicious mode) and a site refuses a round "
                        "naming a site it has no key for (docs/privacy.md)")
    n.add_argument("--federation", default="fl", metavar="NAME",
                   help="coordinator/site: the federation's topic name (default fl); lets "
                        "several federations share a broker")
    n.add_argument("--password-file", metavar="PATH",
                   help="coordinator/site: MQTT password (else $SECAGG_BROKER_PASSWORD or "
                        "the URL's)")
    n.add_argument("--connect-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="give up reaching the broker after this long, at the start and "
                        "after a lost connection (default 30)")
    n.add_argument("--stage-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="coordinator/site: secure-aggregation stage deadline (default 60)")
    n.add_argument("--insecure-verify", action="store_true",
                   help="TESTING ONLY, defeats secure aggregation: sites also send their "
                        "input in the clear so the coordinator can verify each aggregate "
                        "(a site sends it only when it is started with this flag too, and "
                        "refuses it unless it runs --dp none)")


def _results_options(o: Group) -> None:
    """What a run writes: the model, the report, the plot, checkpoints."""
    o.add_argument("--save-model", metavar="PATH.pt",
                   help="write the final model's torch state_dict here (load it with "
                        "model.load_state_dict(torch.load(PATH))) and its layout, labels and "
                        "feature scaler to PATH.json")
    o.add_argument("--report", metavar="REPORT.json", help="write the JSON report here")
    o.add_argument("--plot", metavar="PATH.png", help="plot accuracy and epsilon per round")
    o.add_argument("--checkpoint", metavar="DIR", help="save a checkpoint after every round")
    o.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    o.add_argument("--json", action="store_true",
                   help="print the run's report (with --plan: the plan) as one JSON object on "
                        "stdout; progress stays on stderr")


def _site_policy_options(site: Group) -> None:
    """The site's own privacy policy, set by its operator."""
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
