"""What a ``secagg train`` run writes, whatever role runs it: the checks that its outputs
can be written (before training), the JSON report with every release's parameters and
their sources, the model, the plot and the one-line summary (after it, also when a run
fails after completed rounds)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fl.cli._common import emit_json, progress_log
from fl.settings import TrainSettings


def finish_failed(args: argparse.Namespace, settings: TrainSettings,
                   report: dict[str, Any]) -> None:
    """Whatever ended the run, its completed rounds' report and model are written (the
    caller then raises the one-line error: exit 1)."""
    try:
        finish(args, settings, report)
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


def finish(args: argparse.Namespace, settings: TrainSettings, report: dict[str, Any]) -> int:
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
