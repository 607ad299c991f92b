"""``secagg train``: federated training across simulated hospitals (DESIGN.md section 4).

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
import json
import sys
from pathlib import Path
from typing import Any

from fl.settings import DP_MODES, MODELS, SCALING, TrainSettings

DATASETS = ("breast-cancer", "ehr")  # fl.data.DATASETS, repeated to keep torch out


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "train", help="federated training across simulated hospitals with secure aggregation",
        description="Train one model across simulated hospital sites: every round the sites' "
                    "updates (and sample counts) are summed by secure aggregation over MQTT, "
                    "optionally with differential privacy.")
    d = TrainSettings()
    p.add_argument("--sites", type=int, required=True, metavar="S", help="number of sites")
    p.add_argument("--rounds", type=int, required=True, metavar="R", help="training rounds")
    p.add_argument("--dataset", choices=DATASETS, default=d.dataset,
                   help="breast-cancer (scikit-learn's bundled clinical set, one record per "
                        "patient) or ehr (synthetic longitudinal EHR, several visits per "
                        f"patient); default {d.dataset}")
    p.add_argument("--csv", metavar="PATH", help="train on your own table instead")
    p.add_argument("--patient-column", metavar="COL", help="patient id column of --csv")
    p.add_argument("--label-column", metavar="COL", help="label column of --csv")
    p.add_argument("--dp", choices=DP_MODES, default=d.dp, help="privacy mode (default none)")
    p.add_argument("--epsilon", type=float, metavar="E", help="total privacy budget")
    p.add_argument("--delta", type=float, default=d.delta, metavar="D",
                   help=f"delta (default {d.delta:g})")
    p.add_argument("--unit", choices=("patient", "record"), default=d.unit,
                   help="privacy unit (default patient)")
    p.add_argument("--drop-rate", type=float, default=d.drop_rate, metavar="P",
                   help="probability a site drops out of a round, at a random stage")
    p.add_argument("--broker", default=d.broker, metavar="embedded|memory|mosquitto|mqtt://..",
                   help="embedded MQTT broker (default), in-process memory bus, a local "
                        "Mosquitto, or an existing broker's URL")
    p.add_argument("--report", metavar="REPORT.json", help="write the JSON report here")
    p.add_argument("--plot", metavar="PATH.png", help="plot accuracy and epsilon per round")
    p.add_argument("--seed", type=int, default=d.seed, metavar="S",
                   help="seeds data splits, model init, shuffles and the drop schedule "
                        "(never the masks or the DP noise)")
    p.add_argument("--checkpoint", metavar="DIR", help="save a checkpoint after every round")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--local-epochs", type=int, default=d.local_epochs, metavar="E")
    p.add_argument("--fedprox-mu", type=float, default=d.fedprox_mu, metavar="MU",
                   help="FedProx proximal weight (default 0: FedAvg)")
    p.add_argument("--lr", type=float, default=d.lr, help=f"local learning rate ({d.lr})")
    p.add_argument("--server-lr", type=float, default=d.server_lr,
                   help=f"step applied to the averaged update ({d.server_lr})")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--model", choices=MODELS, default=d.model)
    p.add_argument("--alpha", type=float, default=d.alpha,
                   help=f"Dirichlet non-IID concentration (default {d.alpha})")
    p.add_argument("--clip-norm", type=float, default=d.clip_norm, help="DP clip norm")
    p.add_argument("--sample-rate", type=float, default=d.sample_rate,
                   help=f"DP: patient sampling rate per step (default {d.sample_rate})")
    p.add_argument("--noise-multiplier", type=float, metavar="Z",
                   help="DP: fix the noise instead of calibrating it to --epsilon/--rounds")
    p.add_argument("--cohort", type=int, metavar="K", help="sites per round (default all)")
    p.add_argument("--scaling", choices=SCALING, default=d.scaling,
                   help="feature scaling: secure sum of statistics, none, or auto")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(command="train")
    return p


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    return TrainSettings(
        sites=args.sites, rounds=args.rounds, dataset=args.dataset, csv=args.csv,
        patient_column=args.patient_column, label_column=args.label_column, dp=args.dp,
        epsilon=args.epsilon, delta=args.delta, unit=args.unit, drop_rate=args.drop_rate,
        broker=args.broker, seed=args.seed, local_epochs=args.local_epochs,
        fedprox_mu=args.fedprox_mu, lr=args.lr, server_lr=args.server_lr,
        batch_size=args.batch_size, model=args.model, alpha=args.alpha,
        clip_norm=args.clip_norm, sample_rate=args.sample_rate,
        noise_multiplier=args.noise_multiplier, cohort=args.cohort, scaling=args.scaling,
        checkpoint=args.checkpoint, resume=args.resume)


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        from fl.aggregation import check_broker

        check_broker(settings.broker)
        for path in (args.report, args.plot):
            if path is not None and not Path(path).resolve().parent.is_dir():
                raise ValueError(f"{path}: its directory does not exist")
    except ValueError as exc:
        print(f"secagg train: error: {exc}", file=sys.stderr)
        return 2

    def log(text: str) -> None:
        if not args.quiet:
            print(f"[train] {text}", file=sys.stderr, flush=True)

    from fl.checkpoint import CheckpointError
    from fl.data import DataError
    from fl.federation import train

    try:
        report = train(settings, log=log)
    except (CheckpointError, DataError, ValueError) as exc:
        print(f"secagg train: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a round that kept aborting, or a wrong aggregate
        print(f"secagg train: error: {exc}", file=sys.stderr)
        return 1
    report.pop("model", None)
    report["command"] = "train"
    if report["stopped"]:
        print(f"secagg train: stopped: {report['stopped']}", file=sys.stderr)
    if args.report is not None:
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.plot is not None and report["rounds"]:
        from fl.plot import plot_rounds

        plot_rounds(report["rounds"], args.plot,
                    f"{settings.sites} sites, dp={settings.dp}"
                    + (f", epsilon<={settings.epsilon:g}" if settings.epsilon else ""))
    last = report["rounds"][-1] if report["rounds"] else None
    if last is not None:
        eps = f", epsilon {last['epsilon']:.3f}" if last["epsilon"] is not None else ""
        print(f"secagg train: {len(report['rounds'])} rounds, final test accuracy "
              f"{last['accuracy']:.4f}{eps}")
    else:
        print("secagg train: no round was run")
    return 0
