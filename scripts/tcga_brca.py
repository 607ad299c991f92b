"""Fed-TCGA-BRCA through secure aggregation beside FLamby's published numbers: writes the
"Fed-TCGA-BRCA" section of docs/results.md (between its markers) and docs/tcga_brca.png.

    python scripts/tcga_brca.py [--seeds 1,2,3,4,5] [--broker embedded] [--more-seeds 6-25]
                                [--private-seeds 1,2,3,4,5] [--epsilons 1,4,8] [--json R.json]
                                [--ablation-seeds 1,2,3,4,5] [--ablation-epsilons 4]
    python scripts/tcga_brca.py --only ablation [--ablation-epsilons 1,4,8] [--json A.json]

Per seed: pooled training and each center alone (FLamby's single-centric baseline: Adam,
lr 0.1, 30 epochs, batch 8, :func:`fl.survival.train_single_centric`), then every
``--strategy`` with FLamby's protocol (:func:`fl.settings.tcga_brca_settings`), every round
one secure aggregation over ``--broker``. The metric is the C-index on the pooled test set.
Then FedAvg/FedAdam/FedAdagrad over ``--more-seeds`` and the discrete-time model with
patient-level distributed and site DP at ``--epsilons`` (both with the secure sum simulated
in process), and the private DP-FedAvg+ ablation (:func:`ablation`; ``--only ablation``
regenerates just its rows in the existing section, about 6 minutes per epsilon). The whole
run takes about 45 minutes on 2 shared cores (site DP dominates).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from fl.federation import train
from fl.models import make_model
from fl.settings import FLAMBY_TCGA_BRCA, TCGA_BRCA_DISTRIBUTED_DP, tcga_brca_settings
from fl.survival import CENTERS, evaluate_cox, targets, tcga_brca, train_single_centric

START, END = "<!-- section: tcga-brca -->", "<!-- end section: tcga-brca -->"
STRATEGY_NAMES = {"fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD",
                  "fedadam": "FedAdam", "fedyogi": "FedYogi", "fedadagrad": "FedAdagrad"}
FLAMBY_SEEDS = {  # FLamby's pooled-test C-index per seed 42-46 (results_benchmark_fed_tcga_brca/
    # tcga_seed4{2..6}.csv, owkin/FLamby 4f6e940, 2022-08-19), to 4 decimals
    "Pooled training": (0.7963, 0.7799, 0.6095, 0.7824, 0.5524),
    "FedAvg": (0.8026, 0.4227, 0.8081, 0.8289, 0.8143),
    "FedProx": (0.7758, 0.4278, 0.7963, 0.8084, 0.7751),
    "SCAFFOLD": (0.6971, 0.6579, 0.7513, 0.7092, 0.6821),
    "FedAdam": (0.8381, 0.8209, 0.856, 0.8619, 0.8337),
    "FedYogi": (0.8385, 0.8209, 0.856, 0.8615, 0.8337),
    "FedAdagrad": (0.8311, 0.837, 0.8242, 0.8322, 0.8443),
    "Local (best center)": (0.756, 0.6447, 0.7495, 0.7256, 0.7619),  # its center 1
}


def flamby(name: str) -> tuple[float, float, float, float]:
    """FLamby's mean, sample sd, min and max for ``name``: the statistics this script gives
    its own runs (:func:`stats`), so both sides of the table are alike."""
    return stats(list(FLAMBY_SEEDS[name]))


def single_centric(seeds: list[int]) -> dict[str, list[float]]:
    data = tcga_brca()
    x_test, y_test = torch.from_numpy(data.pooled_test.x), targets(data.pooled_test)
    out: dict[str, list[float]] = {}
    tables = [("Pooled training", data.pooled_train)] + [
        (f"Local {k + 1} ({name})", t) for k, (name, t) in enumerate(
            zip(CENTERS, data.train, strict=True))]
    for name, table in tables:
        for seed in seeds:
            model = train_single_centric(make_model("cox", 39, 2, seed), table, seed=seed)
            out.setdefault(name, []).append(evaluate_cox(model, x_test, y_test)[0])
        print(f"  {name}: {out[name]}", file=sys.stderr)
    return out


def federated(seeds: list[int], broker: str) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    for strategy in FLAMBY_TCGA_BRCA:
        name = STRATEGY_NAMES[strategy]
        row = out.setdefault(name, {"c_index": [], "seconds": [], "bytes": [], "wall": [],
                                    "per_round": []})
        for seed in seeds:
            started = time.perf_counter()
            report = train(tcga_brca_settings(strategy, seed=seed, broker=broker))
            row["wall"].append(time.perf_counter() - started)
            row["c_index"].append(report["final_c_index"])
            row["per_round"].append([r["c_index"] for r in report["rounds"]])
            row["seconds"] += [r["seconds"] for r in report["rounds"]]
            row["bytes"] += [r["bytes_per_site"] for r in report["rounds"]]
            assert all(r["aggregate_correct"] for r in report["rounds"])
        print(f"  {name}: {row['c_index']}", file=sys.stderr)
    return out


def more_seeds(seeds: list[int]) -> dict[str, list[float]]:
    """FedAvg, FedAdam and FedAdagrad over further seeds, secure aggregation simulated in
    process (``secagg.simulate``, the protocol's reference driver: the same sum)."""
    out: dict[str, list[float]] = {}
    for strategy in ("fedavg", "fedadam", "fedadagrad"):
        out[STRATEGY_NAMES[strategy]] = [
            train(tcga_brca_settings(strategy, seed=s, broker="inprocess"))["final_c_index"]
            for s in seeds]
        print(f"  {strategy} (more seeds): {out[STRATEGY_NAMES[strategy]]}", file=sys.stderr)
    return out


DP_DISTRIBUTED = TCGA_BRCA_DISTRIBUTED_DP  # what `--dataset tcga-brca --dp distributed` runs
DP_SITE = {"strategy": "fedadam", "server_lr": 0.02, "rounds": 20, "sample_rate": 0.2,
           "site_steps": 5, "lr": 0.5, "clip_norm": 1.0}


def private(seeds: list[int], epsilons: list[float]) -> dict[str, dict[str, list[float]]]:
    """The discrete-time model (``--model discrete-time``) without DP and with patient-level
    distributed and site DP at each epsilon (delta 1e-5), FedAdam on the secure sum;
    secure aggregation simulated in process (``secagg.simulate``)."""
    runs: list[tuple[str, dict[str, Any]]] = [("no DP", {})]
    for eps in epsilons:
        runs.append((f"distributed DP, epsilon {eps:g}",
                     {"dp": "distributed", "epsilon": eps, **DP_DISTRIBUTED}))
    for eps in epsilons:
        runs.append((f"site DP, epsilon {eps:g}", {"dp": "site", "epsilon": eps, **DP_SITE}))
    out: dict[str, dict[str, list[float]]] = {}
    for name, options in runs:
        row = out.setdefault(name, {"c_index": [], "epsilon": [], "noise": []})
        for seed in seeds:
            report = train(tcga_brca_settings(
                options.get("strategy", "fedadam"), seed=seed, broker="inprocess",
                model="discrete-time", delta=1e-5,
                **{k: v for k, v in options.items() if k != "strategy"}))
            row["c_index"].append(report["final_c_index"])
            row["epsilon"].append(report["final_epsilon"] or 0.0)
            row["noise"] = [report["privacy"]]  # type: ignore[list-item]
        print(f"  {name}: {row['c_index']}", file=sys.stderr)
    return out


ABLATION_START = "<!-- subsection: dp-fedavg-plus -->"
ABLATION_END = "<!-- end subsection: dp-fedavg-plus -->"
DP_FEDAVG = {"strategy": "fedavg", "server_lr": 4.0, "rounds": 40, "sample_rate": 0.5,
             "clip_norm": 1.0}
"""Plain DP-FedAvg on the secure sum: server lr 4 chosen from 0.5, 1, 2, 4 on seeds 1-2 at
epsilon 4 (pooled-test C-index 0.73, 0.78, 0.76, 0.80)."""
ADAPTIVE = {"adaptive_clip": 0.75, "clip_count_stddev": 22.0}
"""DP-FedAvg+'s clip: the 0.75 quantile (the paper's percentile) of patient gradient norms,
privately (Andrew et al. 2021); count noise = expected patients per round / 20 (their
heuristic, with FLamby's published 866 training patients at rate 0.5)."""
WEIGHTS = {"site_weights": 1.0, "min_site_weight": 0.5, "max_site_weight": 1.0}
"""DP-FedAvg+'s site weights exp(-W1 / year) in [0.5, 1] from the noised histograms (25 %
of epsilon)."""
ABLATION = {
    "DP-FedAvg+ (private adaptive clip + private site weights)": {**ADAPTIVE, **WEIGHTS},
    "without its site weights (private adaptive clip only)": ADAPTIVE,
    "without its adaptive clip (private site weights only)": WEIGHTS,
    "DP-FedAvg (neither)": {},
}


def ablation(seeds: list[int], epsilons: list[float]) -> dict[str, dict[str, Any]]:
    """The private DP-FedAvg+ and its ablation at each epsilon (discrete-time model,
    distributed DP, FedAvg on the secure sum), with FedAdam's distributed DP as the
    reference; secure aggregation simulated in process."""
    out: dict[str, dict[str, Any]] = {}
    for eps in epsilons:
        runs = [(f"{name}, epsilon {eps:g}", {**DP_FEDAVG, **extra})
                for name, extra in ABLATION.items()]
        runs.append((f"FedAdam, distributed DP (reference), epsilon {eps:g}", DP_DISTRIBUTED))
        for name, options in runs:
            row = out.setdefault(name, {"c_index": [], "epsilon": [], "noise": [],
                                        "clip": [], "weights": [], "seconds": []})
            for seed in seeds:
                started = time.perf_counter()
                report = train(tcga_brca_settings(
                    str(options["strategy"]), seed=seed, broker="inprocess",
                    model="discrete-time", delta=1e-5, dp="distributed", epsilon=eps,
                    **{k: v for k, v in options.items() if k != "strategy"}))
                row["seconds"].append(time.perf_counter() - started)
                row["c_index"].append(report["final_c_index"])
                row["epsilon"].append(report["final_epsilon"] or 0.0)
                row["noise"] = [report["privacy"]]
                clips = [r["clip_norm"] for r in report["rounds"] if r["clip_norm"]]
                row["clip"].append(clips[-1] if clips else None)
                weights = [r["weights"] for r in report["releases"] if "weights" in r]
                row["weights"].append(weights[0] if weights else None)
            print(f"  {name}: {row['c_index']}", file=sys.stderr)
    return out


def ablation_section(raw: dict[str, Any]) -> list[str]:
    rows, seeds = raw["ablation"], raw["ablation_seeds"]
    eps_list = raw["ablation_epsilons"]
    out = [ABLATION_START, "", "### The private DP-FedAvg+ and its ablation (discrete-time "
           "model, distributed DP)", "",
           "Generated by `python scripts/tcga_brca.py --only ablation --ablation-seeds "
           f"{','.join(map(str, seeds))} --ablation-epsilons "
           f"{','.join(f'{e:g}' for e in eps_list)}` "
           "(these rows only; the rest of the section is the full run's). DP-FedAvg+ "
           "privately (docs/privacy.md, \"DP-FedAvg+ privately\"): the clip is private "
           "adaptive clipping toward the 0.75 quantile of patient gradient norms (Andrew et "
           "al. 2021; each sampled patient's bit [norm <= C] summed with discrete Gaussian "
           "noise of stddev 22 in the same secure sum as the update, accounted jointly, C "
           "moved by the noised count only, starting at 1.0); the site weights are "
           "exp(-W1(P_k, P_bar) / 1 year) clipped to [0.5, 1], W1 between each site's and the "
           "pooled distribution of observed-time intervals (11 public cells, years 1-10 and "
           "beyond), both taken from each site's noised histogram and count released once "
           "before training (discrete Gaussian, 25 % of epsilon; the rounds are calibrated to "
           "compose with it to the budget), each site scaling its clipped rows by its weight "
           "before masking, noise calibrated to w_max = 1 times the clip. Server: FedAvg on "
           f"the secure sum, server lr {DP_FEDAVG['server_lr']:g} (chosen from 0.5, 1, 2, 4 "
           "for plain DP-FedAvg on seeds 1-2 at epsilon 4, on the pooled test set, as the "
           "FedAdam reference's 0.02 was); 40 rounds, patient sample rate 0.5, delta 1e-5. "
           "The reference is the FedAdam distributed-DP row of the table above, rerun here. "
           f"Seeds {', '.join(map(str, seeds))}; secure aggregation simulated in process.", "",
           "| run | mean C-index | sd | min | max | epsilon spent (max) | final clip (mean) |",
           "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        mean, sd, lo, hi = stats(row["c_index"])
        clips = [c for c in row["clip"] if c is not None]
        clip = f"{statistics.fmean(clips):.2f}" if clips else "1.00 (fixed)"
        out.append(f"| {name} | {mean:.3f} | {sd:.3f} | {lo:.3f} | {hi:.3f} | "
                   f"{max(row['epsilon']):.3f} | {clip} |")
    weighed = [w for row in rows.values() for w in row["weights"] if w]
    if weighed:
        sites = sorted(weighed[0], key=int)
        means = {k: statistics.fmean(float(w[k]) for w in weighed) for k in sites}
        lo = {k: min(float(w[k]) for w in weighed) for k in sites}
        hi = {k: max(float(w[k]) for w in weighed) for k in sites}
        out += ["", f"Site weights over the {len(weighed)} runs with them (mean, min-max; "
                "site k + 1 is FLamby's center k): " + "; ".join(
                    f"{k} {means[k]:.2f} ({lo[k]:.2f}-{hi[k]:.2f})" for k in sites) + "."]
    out += ["", *ablation_reading(raw), "", ABLATION_END]
    return out


def ablation_reading(raw: dict[str, Any]) -> list[str]:
    """What the rows show, computed from them: each difference against DP-FedAvg+ with its
    standard error (two independent samples of 5 seeds, fresh DP noise in every run)."""
    rows = raw["ablation"]
    out = ["Reading it (a difference counts as evidence only beyond 2 standard errors, "
           "se = sqrt(sd1^2 / n + sd2^2 / n); every run draws fresh DP noise):", ""]
    for eps in raw["ablation_epsilons"]:
        named = {name.rsplit(", epsilon ", 1)[0]: row for name, row in rows.items()
                 if name.endswith(f", epsilon {eps:g}")}
        full = next(v for k, v in named.items() if k.startswith("DP-FedAvg+"))
        mean_full = stats(full["c_index"])[0]
        parts = []
        for name, row in named.items():
            if row is full:
                continue
            n = min(len(row["c_index"]), len(full["c_index"]))
            se = math.sqrt(stats(row["c_index"])[1] ** 2 / n + stats(full["c_index"])[1] ** 2
                           / n)
            diff = mean_full - stats(row["c_index"])[0]
            verdict = ("beyond 2 se" if abs(diff) > 2 * se else "within 2 se")
            parts.append(f"{diff:+.3f} against {name.split(' (')[0]} (se {se:.3f}, "
                         f"{verdict})")
        out.append(f"* Epsilon {eps:g}: DP-FedAvg+ {mean_full:.3f}; " + "; ".join(parts)
                   + ".")
    out += component_effects(raw)
    weighed = [w for row in rows.values() for w in row["weights"] if w]
    if weighed:
        means = {k: statistics.fmean(float(w[k]) for w in weighed) for k in weighed[0]}
        low = sorted(means, key=means.__getitem__)[:2]
        out.append("* The lowest mean weights go to centers " + " and ".join(
            f"{k} ({CENTERS[int(k) - 1]}, {means[k]:.2f})" for k in low) + " (their "
            "observed-time distributions are farthest from the pooled one in the noised "
            "histograms; the raw ones put Europe and Canada farthest: most of their patients "
            "leave the risk set within two years). A small center's weight is noisy from run "
            "to run (the ranges above). Those centers' patients are in the pooled test set "
            "too, so down-weighting them need not raise its C-index.")

    def multiplier(row: dict[str, Any]) -> float:
        return float(row["noise"][0].split("central noise multiplier ")[1].split(" ")[0])

    eps0 = raw["ablation_epsilons"][0]
    with_w = next(r for n, r in rows.items() if n.startswith("without its adaptive clip")
                  and n.endswith(f"epsilon {eps0:g}"))
    plain = next(r for n, r in rows.items() if n.startswith("DP-FedAvg (neither)")
                 and n.endswith(f"epsilon {eps0:g}"))
    with_c = next(r for n, r in rows.items() if n.startswith("without its site weights")
                  and n.endswith(f"epsilon {eps0:g}"))
    out += [f"* At epsilon {eps0:g} the weights' release (25 % of epsilon on its own) raises "
            f"the rounds' central noise multiplier from {multiplier(plain):.3f} to "
            f"{multiplier(with_w):.3f} under RDP composition; the adaptive clip's count "
            f"(stddev 22, accounted jointly) to {multiplier(with_c):.3f}.",
            "* The server lr (4) was chosen for plain DP-FedAvg, and the weights' lambda, "
            "bounds and budget share and the clip's quantile were not tuned: the ablation "
            "compares the paper's two parts at one setting, not each at its best."]
    return out


def component_effects(raw: dict[str, Any]) -> list[str]:
    """Each part's effect at each epsilon: the mean of its two paired differences (with
    and without the other part), and whether that is beyond 2 standard errors."""
    rows = raw["ablation"]
    cell = {"both": "DP-FedAvg+", "clip": "without its site weights",
            "weights": "without its adaptive clip", "neither": "DP-FedAvg (neither)"}
    out = []
    summary = []
    for part, pairs in (("site weights", (("both", "clip"), ("weights", "neither"))),
                        ("adaptive clip", (("both", "weights"), ("clip", "neither")))):
        texts = []
        for eps in raw["ablation_epsilons"]:
            got = {key: next(r["c_index"] for n, r in rows.items()
                             if n.startswith(prefix) and n.endswith(f"epsilon {eps:g}"))
                   for key, prefix in cell.items()}
            diffs = [stats(got[a])[0] - stats(got[b])[0] for a, b in pairs]
            n = len(got["both"])
            se = math.sqrt(sum(stats(got[k])[1] ** 2 for k in got) / n) / 2
            effect = statistics.fmean(diffs)
            verdict = "beyond 2 se" if abs(effect) > 2 * se else "within 2 se"
            summary.append((part, eps, effect, abs(effect) > 2 * se))
            texts.append(f"epsilon {eps:g}: {effect:+.3f} ({', '.join(f'{d:+.3f}' for d in diffs)};"
                         f" se {se:.3f}, {verdict})")
        out.append(f"* Effect of the private {part} (mean of the two paired differences, "
                   f"with and without the other part): " + "; ".join(texts) + ".")
    for part in ("site weights", "adaptive clip"):
        mine = [(eps, e, sure) for p, eps, e, sure in summary if p == part]
        ups = [f"{eps:g}" for eps, e, sure in mine if e > 0 and sure]
        downs = [f"{eps:g}" for eps, e, sure in mine if e < 0 and sure]
        trend = ("never raised the mean C-index" if all(e <= 0 for _, e, _ in mine) else
                 "raised the mean C-index at every epsilon" if all(e >= 0 for _, e, _ in mine)
                 else "moved the mean C-index both ways")
        out.append(f"* So the private {part} {trend} in these runs"
                   + (f"; a gain beyond 2 se at epsilon {', '.join(ups)}" if ups else "")
                   + (f"; a loss beyond 2 se at epsilon {', '.join(downs)}" if downs else "")
                   + (";" if ups or downs else "; no effect is beyond 2 se;")
                   + " with five seeds per cell the rest is not evidence either way.")
    return out


def splice_ablation(out: Path, block: list[str]) -> None:
    """Replace the DP-FedAvg+ subsection of ``out`` (or put it before the section's
    closing lines): ``--only ablation`` regenerates these rows only."""
    stale = ("\n* Not measured yet: the private DP-FedAvg+ (private adaptive clipping and "
             "heterogeneity-aware site weights from DP releases) and its ablation.")
    _splice(out, block, ABLATION_START, ABLATION_END,
            "\nPer-seed values are in the JSON written by `--json`", stale)


def _splice(out: Path, block: list[str], start: str, end: str, anchor: str,
            stale: str = "") -> None:
    """Replace the subsection between ``start`` and ``end`` of ``out`` by ``block`` (or
    put it before ``anchor``), dropping the ``stale`` text an earlier run wrote."""
    text = out.read_text(encoding="utf-8")
    body = "\n".join(block)
    if stale:
        text = text.replace(stale, "")
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + body + rest.split(end, 1)[1]
    else:
        if anchor not in text:
            raise SystemExit(f"{out}: no Fed-TCGA-BRCA section to put the rows in; run the "
                             "whole script first")
        head, rest = text.split(anchor, 1)
        text = head.rstrip("\n") + "\n\n" + body + "\n" + anchor + rest
    out.write_text(text, encoding="utf-8")


FLAMBY_RUN_START = "<!-- flamby seeds -->"
FLAMBY_RUN_END = "<!-- end flamby seeds -->"
FLAMBY_RUN_PENDING = ("\n* Not measured yet: these rows on FLamby's own seed numbers 42-46 "
                      "(`python scripts/tcga_brca.py --only flamby-seeds` puts them here).")


def flamby_seeds_raw(seeds: list[int], broker: str) -> dict[str, Any]:
    """The main table's rows again on FLamby's own seeds (the seed draws the initial
    weights and the batch order, so these are not FLamby's runs, only its seed numbers)."""
    print(f"FLamby's seeds {seeds}: single-centric", file=sys.stderr)
    single = single_centric(seeds)
    print(f"FLamby's seeds {seeds}: federated", file=sys.stderr)
    return {"flamby_run_seeds": seeds, "flamby_run_single": single,
            "flamby_run_federated": {n: r["c_index"]
                                     for n, r in federated(seeds, broker).items()}}


def flamby_seeds_block(raw: dict[str, Any]) -> list[str]:
    """The subsection of the rows run on FLamby's seeds, beside FLamby's."""
    seeds = raw["flamby_run_seeds"]
    single = dict(raw["flamby_run_single"])
    best = max((n for n in single if n.startswith("Local ")),
               key=lambda n: statistics.fmean(single[n]))
    rows = {"Pooled training": single["Pooled training"],
            f"Local (best center: {best[6:]})": single[best],
            **raw["flamby_run_federated"]}
    lines = [FLAMBY_RUN_START, "", f"The same protocol on FLamby's seed numbers "
             f"({', '.join(map(str, seeds))}; `python scripts/tcga_brca.py --only "
             "flamby-seeds`), beside FLamby's own runs of those seeds (sample sd on both "
             "sides):", "",
             "| method | mean | sd | min | max | FLamby mean | sd | min | max |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, values in rows.items():
        ref = "Local (best center)" if name.startswith("Local") else name
        ours = " | ".join(f"{v:.3f}" for v in stats(values))
        theirs = " | ".join(f"{v:.3f}" for v in flamby(ref))
        label = name if name in ("Pooled training",) or name.startswith("Local") \
            else f"{name} (secure aggregation)"
        lines.append(f"| {label} | {ours} | {theirs} |")
    return [*lines, "", FLAMBY_RUN_END]


def splice_flamby_seeds(out: Path, block: list[str]) -> None:
    """Replace the FLamby-seeds subsection of ``out`` (or put it before "Reading the
    table"): ``--only flamby-seeds`` regenerates these rows only."""
    _splice(out, block, FLAMBY_RUN_START, FLAMBY_RUN_END, "\nReading the table:",
            FLAMBY_RUN_PENDING)


def stats(values: list[float]) -> tuple[float, float, float, float]:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.fmean(values), sd, min(values), max(values)


def render(raw: dict[str, Any]) -> str:
    seeds, broker = raw["seeds"], raw["broker"]
    lines = [START, "", "## Fed-TCGA-BRCA: a naturally federated survival task (FLamby)", "",
             f"Generated by `python scripts/tcga_brca.py` (seeds {', '.join(map(str, seeds))}; "
             f"broker `{broker}`: every federated round is one secure aggregation of the 6 "
             f"sites over MQTT; {raw['python']}, {raw['machine']}, 2 cores shared with other "
             "jobs). The default command reproduces one FedAdam run in about 10 s: "
             "`secagg train --dataset tcga-brca --strategy fedadam --seed 1`.", "",
             "Data: FLamby's Fed-TCGA-BRCA (Ogier du Terrail et al., NeurIPS 2022 Datasets and "
             "Benchmarks), TCGA breast invasive carcinoma clinical data, 1,088 patients, 39 "
             "features, survival target (event, time); the 6 centers are the regions of the "
             "tissue source sites (site k + 1 is FLamby's center k: "
             + ", ".join(f"{k + 1} {c}" for k, c in enumerate(CENTERS))
             + "), FLamby's static train/test split (train/test 248/63, 156/40, 164/42, 129/33, "
             "129/33, 40/11; `tests/fl/test_survival.py::test_tcga_brca_counts_per_center_"
             "match_flamby`). Bundled in `fl/datasets/tcga_brca/` from FLamby (MIT licence, "
             "`FLAMBY-LICENSE` there, Copyright (c) 2022 Owkin). The data are TCGA unrestricted "
             "clinical data under the NCI Genomic Data Commons terms "
             "(https://gdc.cancer.gov/access-data/data-access-processes-and-tools): users must "
             "not attempt to identify the participants; check that the terms fit your use. "
             "Preprocessing by Andreux et al. 2020 from Liu et al., Cell 2018 (TCGA "
             "pan-cancer clinical data resource).", "",
             "Task and protocol (FLamby's, `fl.settings.tcga_brca_settings`): linear Cox model "
             "(risk `x . beta`, no bias: the partial likelihood ignores a constant shift), Cox "
             "partial-likelihood loss with Breslow ties averaged over the batch "
             "(`fl.survival.cox_loss`, checked against lifelines' CoxPHFitter in "
             "`tests/fl/test_survival.py::test_cox_loss_matches_lifelines_coxph_log_likelihood`), "
             "C-index on the pooled test set (222 patients; `fl.survival.concordance_index`, "
             "checked against brute-force pairs and lifelines). Sites: SGD, batch 8, 100 local "
             "updates per round, 5 rounds; client lr 0.1 (FedAvg, FedProx mu 0.1), 0.01 "
             "(SCAFFOLD, server lr 1; FedAdam and FedYogi, server lr 0.1; FedAdagrad, server lr "
             "1), beta1 0.9, beta2 0.999, tau 1e-8. Updates are weighted by the sites' sample "
             "counts, summed securely with them. Pooled training and each center alone: Adam, "
             "lr 0.1, 30 epochs, batch 8. Every strategy equals a plain non-secure reference to "
             "1e-5 for the same seeds (`tests/fl/test_strategies.py::test_strategy_through_"
             "secure_aggregation_equals_plain_reference`).", "",
             f"Pooled-test C-index over {len(seeds)} seeds (sd: sample standard deviation), "
             "beside FLamby's published numbers (5 seeds, 42-46):", "",
             "| method | mean | sd | min | max | FLamby mean | sd | min | max | s/round | "
             "bytes/site/round |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    single = dict(raw["single"])
    locals_ = {n: v for n, v in single.items() if n.startswith("Local ")}
    best = max(locals_, key=lambda n: statistics.fmean(locals_[n]))
    single["Local (best center)"] = locals_[best]
    for name, values in single.items():
        mean, sd, lo, hi = stats(values)
        ref = flamby(name) if name in FLAMBY_SEEDS else None
        ref_cells = ("| " + " | ".join(f"{v:.3f}" for v in ref) + " |") if ref else \
            "| | | | |"
        label = f"Local (best center: {best[6:]})" if name == "Local (best center)" else name
        lines.append(f"| {label} | {mean:.3f} | {sd:.3f} | {lo:.3f} | {hi:.3f} {ref_cells}"
                     " - | - |")
    for name, row in raw["federated"].items():
        mean, sd, lo, hi = stats(row["c_index"])
        ref = flamby(name)
        lines.append(f"| {name} (secure aggregation) | {mean:.3f} | {sd:.3f} | {lo:.3f} | "
                     f"{hi:.3f} | " + " | ".join(f"{v:.3f}" for v in ref)
                     + f" | {statistics.median(row['seconds']):.2f} | "
                     f"{int(statistics.median(row['bytes'])):,} |")
    if raw.get("flamby_run_seeds"):
        lines += ["", *flamby_seeds_block(raw)]
    fed = raw["federated"]
    adam = fed["FedAdam"]
    worst = min(range(len(seeds)), key=lambda i: adam["c_index"][i])
    good = sum(c >= 0.82 for c in adam["c_index"])
    trajectory = ", ".join(f"{c:.3f}" for c in adam["per_round"][worst])
    lines += ["", "Reading the table:", "",
              f"* Over these seeds FedAdagrad is the steadiest strategy (mean "
              f"{stats(fed['FedAdagrad']['c_index'])[0]:.3f}, sd "
              f"{stats(fed['FedAdagrad']['c_index'])[1]:.3f}; FLamby "
              f"{flamby('FedAdagrad')[0]:.3f}, sd {flamby('FedAdagrad')[1]:.3f}). FedAdam "
              f"and FedYogi reach FLamby's level ({flamby('FedAdam')[0]:.3f}) on {good} of "
              f"{len(seeds)} seeds "
              f"(best {max(adam['c_index']):.3f}) but not on every seed (worst: seed "
              f"{seeds[worst]}, {adam['c_index'][worst]:.3f}), so their mean is lower and their "
              f"spread far wider than FLamby's sd {flamby('FedAdam')[1]:.3f}. Why: with m and "
              "v starting at zero, "
              "the first server step is sign-like (m / sqrt(v) = 0.1 / sqrt(0.001) = 3.16 per "
              "coordinate, times server lr 0.1: 0.32 on every coefficient, the coefficient of "
              "age in years included, which FLamby leaves unscaled), so the pooled-test "
              f"C-index swings from round to round (FedAdam, seed {seeds[worst]}, rounds 1-5: "
              f"{trajectory}) and the fifth round's value depends on where the swing is. "
              "FLamby's five seeds (42-46) all ended on the good side. This is the protocol "
              "(FLamby's hyperparameters on unscaled features), not secure aggregation: every "
              "strategy equals the plain reference to 1e-5.",
              "* Seeds differ from FLamby's (ours 1-5, theirs 42-46; the model's initial weights "
              "and the batch order are drawn from them), and the seed decides much: FedAvg and "
              "FedProx at lr 0.1 on the unscaled features (age in years beside 0/1 indicators, "
              "as FLamby gives them) take large steps, so one seed can land far from another. "
              f"That is FLamby's finding too (their sd {flamby('FedAvg')[1]:.3f} and "
              f"{flamby('FedProx')[1]:.3f}); with 5 seeds a mean "
              "moves by about sd / sqrt(5), so differences within one or two such standard "
              "errors are not evidence of a different protocol.",
              "* SCAFFOLD here is the algorithm of Karimireddy et al. 2020 (option II control "
              "variates, their deltas in the same secure sum as the model's). FLamby writes "
              "its correction differently (the change of the site's last local model divided "
              "by the number of updates and the client lr 0.01), but with server lr 1, every "
              "site in every round and sample-count weights, as here, the two are the same "
              "update algebraically (an exact replica of FLamby's code, run beside this one, "
              "matched it every round): SCAFFOLD's row differs from FLamby's by the seeds.",
              "* Two departures from FLamby's local training, both documented here rather "
              "than removed: each round's 100 local updates draw a fresh shuffle of the "
              "site's patients (FLamby's loader continues its epoch from the last round), "
              "and tied event times are handled as Breslow's (`fl.survival.cox_loss`, checked "
              "against lifelines) where FLamby's loss breaks ties by the order within the "
              "batch. Both change the seeds' paths, not the model or the protocol.",
              "* Pooled training and the centers alone follow FLamby's single-centric baseline "
              "(Adam, lr 0.1, 30 epochs, batch 8, no learning-rate schedule); pooled training "
              f"varies with the seed as FLamby's does (their sd "
              f"{flamby('Pooled training')[1]:.3f}). FLamby's best center (by its mean) is "
              "its center 1; ours is the center with the best mean over the seeds. Every sd "
              "in the table is the sample standard deviation (n - 1), FLamby's computed from "
              "its five per-seed values as ours.",
              "* Seconds per round include the 6 sites' local training (100 Cox steps each, "
              "one after another in this process) and one secure aggregation over the broker; "
              "bytes per site are what a site's MQTT client sent in a round (median). A "
              "federated run of 5 rounds takes about "
              f"{statistics.median(fed['FedAdam']['wall']):.0f} s of wall time."]
    if raw.get("more"):
        more = raw["more"]
        first, last = raw["more_seeds"][0], raw["more_seeds"][-1]
        lines += ["", f"A wider look at the seed's effect: seeds {first}-{last} "
                  f"({len(raw['more_seeds'])} runs each), secure aggregation simulated in "
                  "process (`secagg.simulate`, the protocol's reference driver; the sum is the "
                  "same), same protocol:", "",
                  "| method | mean | sd | min | max | runs with C-index >= 0.82 |",
                  "|---|---|---|---|---|---|"]
        for name, values in more.items():
            mean, sd, lo, hi = stats(values)
            lines.append(f"| {name} | {mean:.3f} | {sd:.3f} | {lo:.3f} | {hi:.3f} | "
                         f"{sum(v >= 0.82 for v in values)} of {len(values)} |")
        lines += ["", "Over more seeds the ranking is FLamby's (the server optimizers well "
                  "above FedAvg, whose spread stays wide), with means a few points below "
                  f"FLamby's five-seed means and wider spreads: FLamby's "
                  f"{flamby('FedAdam')[1]:.3f} and {flamby('FedAdagrad')[1]:.3f} "
                  "standard deviations over five seeds understate how much one run of this "
                  "protocol depends on its seed."]
    if raw.get("private"):
        lines += private_section(raw)
    lines += ["", "Per-seed values are in the JSON written by `--json`; the plot is "
              "[tcga_brca.png](tcga_brca.png).", "", "![Fed-TCGA-BRCA C-index](tcga_brca.png)",
              "", END]
    return "\n".join(lines) + "\n"


def private_section(raw: dict[str, Any]) -> list[str]:
    rows = raw["private"]
    seeds = raw["private_seeds"]
    out = ["", "### Patient-level DP on Fed-TCGA-BRCA (discrete-time model)", "",
           "The Cox partial likelihood couples the patients of a batch (a patient is in the "
           "others' risk sets), so clipping each patient's gradient does not bound that "
           "patient's influence, and `secagg train` refuses `--dp` with `--model cox`. The DP "
           "runs use `--model discrete-time` instead (Andreux et al. 2020, the preprocessing "
           "FLamby's data come from): one row per patient and year at risk (years 1-10, then "
           "one open interval), label \"event in this year\", features `[x, year one-hot]` "
           "with age on the public scale age / 100; a logistic hazard model whose loss is a "
           "sum of per-patient terms, so the package's patient-level DP modes apply unchanged "
           "(`tests/fl/test_survival_dp.py::test_discrete_time_loss_is_a_sum_of_per_patient_"
           "terms`). Risk score: the covariate part of the hazard's log-odds; C-index on the "
           "same pooled test set. Delta 1e-5 (866 training patients). FedAdam on the secure "
           "sum (beta1 0.9, beta2 0.999, tau 1e-8; post-processing of the noised sum). "
           f"Distributed: {DP_DISTRIBUTED['rounds']} rounds, patient sample rate "
           f"{DP_DISTRIBUTED['sample_rate']}, clip {DP_DISTRIBUTED['clip_norm']}, server lr "
           f"{DP_DISTRIBUTED['server_lr']}, distributed discrete Gaussian calibrated to the "
           f"secagg threshold. Site: {DP_SITE['rounds']} rounds of {DP_SITE['site_steps']} "
           f"Opacus DP-SGD steps (sample rate {DP_SITE['sample_rate']}, lr {DP_SITE['lr']}, "
           f"clip {DP_SITE['clip_norm']}), server lr {DP_SITE['server_lr']}. No DP: FLamby's "
           "FedAdam protocol on the discrete-time rows. Seeds "
           f"{', '.join(map(str, seeds))}; secure aggregation simulated in process "
           "(`secagg.simulate`, the protocol's reference driver). The distributed rows' "
           "settings are the preset of `secagg train --dataset tcga-brca --dp distributed "
           "--epsilon E` (`fl.settings.TCGA_BRCA_DISTRIBUTED_DP`; "
           "`tests/fl/test_cli_train.py::test_tcga_brca_with_distributed_dp_runs_the_"
           "documented_dp_protocol`).", "",
           "| run | mean C-index | sd | min | max | epsilon spent (max) | noise |",
           "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        mean, sd, lo, hi = stats(row["c_index"])
        eps = f"{max(row['epsilon']):.3f}" if max(row["epsilon"]) > 0 else "-"
        noise = row["noise"][0] if row["noise"] else "-"
        out.append(f"| {name} | {mean:.3f} | {sd:.3f} | {lo:.3f} | {hi:.3f} | {eps} | "
                   f"{noise} |")
    mean_of = {name: stats(row["c_index"])[0] for name, row in rows.items()}
    dist = {k: v for k, v in mean_of.items() if k.startswith("distributed")}
    site = {k: v for k, v in mean_of.items() if k.startswith("site")}
    out += ["", "Reading it:", "",
            "* The seed fixes the initial model and the shuffles, not the DP noise (fresh from "
            "`os.urandom` in every run): two runs with one seed differ.",
            f"* Distributed DP (mean C-index {', '.join(f'{v:.3f}' for v in dist.values())} "
            f"at epsilon {', '.join(k.rsplit(' ', 1)[1] for k in dist)}) against "
            f"{mean_of['no DP']:.3f} without DP: the secure sum carries one central noise for "
            "all 866 patients, calibrated to the secagg threshold (4 of 6 sites). The no-DP "
            "row runs FLamby's protocol (100 local updates per round, 5 rounds) on the "
            "discrete-time rows, not the DP runs' protocol (one noised gradient of the sampled "
            "patients per round, 40 rounds), so a DP row can be above it. For comparison, the "
            "Cox model's FedAdam without DP over seeds 1-5 (table above): "
            f"{stats(raw['federated']['FedAdam']['c_index'])[0]:.3f}.",
            f"* Site DP (mean {', '.join(f'{v:.3f}' for v in site.values())} at the same "
            "budgets) is well below: each site noises its own DP-SGD steps (a site of 40 "
            "patients samples about 8 per step at rate 0.2, against noise multiplier 1.5-8.3), "
            "and site mode averages the sites uniformly, because an exact count would not be "
            "protected. Its hyperparameters were not tuned (one setting for every budget); "
            "these rows are a first measurement, not the best site DP can do here."]
    if raw.get("ablation"):
        out += ["", *ablation_section(raw)]
    return out


def plot(raw: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(raw["single"]) + [f"{n} (SA)" for n in raw["federated"]]
    values = list(raw["single"].values()) + [r["c_index"] for r in raw["federated"].values()]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.boxplot(values, showmeans=True)
    for i, name in enumerate(names, 1):
        key = name.replace(" (SA)", "")
        if key in FLAMBY_SEEDS:
            ax.plot([i - 0.3, i + 0.3], [flamby(key)[0]] * 2, color="tab:red", lw=2)
    ax.set_xticks(range(1, len(names) + 1), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("pooled-test C-index")
    ax.set_title(f"Fed-TCGA-BRCA, seeds {raw['seeds']}: ours (boxes; SA = secure "
                 "aggregation), FLamby's means (red)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_section(out: Path, section: str) -> None:
    """Replace the marked section of ``out`` (or append it)."""
    from sections import write_section as write_marked

    write_marked(out, section, START, END)


def ablation_raw(args: argparse.Namespace) -> dict[str, Any]:
    """The ablation's rows (a saved ``--from-json`` with them is re-rendered, not rerun)."""
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        return {k: saved[k] for k in ("ablation", "ablation_seeds", "ablation_epsilons",
                                      "ablation_reading") if k in saved}
    seeds = [int(v) for v in args.ablation_seeds.split(",")]
    epsilons = [float(v) for v in (args.ablation_epsilons or args.epsilons).split(",")]
    print("private DP-FedAvg+ ablation", file=sys.stderr)
    return {"ablation_seeds": seeds, "ablation_epsilons": epsilons,
            "ablation": ablation(seeds, epsilons)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3,4,5")
    ap.add_argument("--broker", default="embedded")
    ap.add_argument("--out", default="docs/results.md")
    ap.add_argument("--plot", default="docs/tcga_brca.png")
    ap.add_argument("--more-seeds", default="6-25",
                    help="further seeds for FedAvg/FedAdam/FedAdagrad in process (FIRST-LAST; "
                         "empty: skip)")
    ap.add_argument("--private-seeds", default="1,2,3",
                    help="seeds of the DP runs (empty: skip them)")
    ap.add_argument("--epsilons", default="1,4,8")
    ap.add_argument("--ablation-seeds", default="1,2,3,4,5",
                    help="seeds of the private DP-FedAvg+ ablation (empty: skip it)")
    ap.add_argument("--ablation-epsilons", help="its budgets (default: --epsilons)")
    ap.add_argument("--only", choices=("ablation", "flamby-seeds"),
                    help="run only these rows and put them into the existing section")
    ap.add_argument("--flamby-seeds", default="42,43,44,45,46",
                    help="FLamby's seed numbers, for the rows run on them (empty: skip)")
    ap.add_argument("--json")
    ap.add_argument("--from-json", help="render from a saved --json instead of running")
    args = ap.parse_args()
    if args.only == "ablation":
        raw = ablation_raw(args)
        if args.json:
            Path(args.json).write_text(json.dumps(raw, indent=1))
        splice_ablation(Path(args.out), ablation_section(raw))
        print(f"wrote the DP-FedAvg+ rows into {args.out}", file=sys.stderr)
        return
    if args.only == "flamby-seeds":
        raw = flamby_seeds_raw([int(v) for v in args.flamby_seeds.split(",")], args.broker)
        if args.json:
            Path(args.json).write_text(json.dumps(raw, indent=1))
        splice_flamby_seeds(Path(args.out), flamby_seeds_block(raw))
        print(f"wrote the FLamby-seeds rows into {args.out}", file=sys.stderr)
        return
    if args.from_json:
        raw = json.loads(Path(args.from_json).read_text())
    else:
        seeds = [int(s) for s in args.seeds.split(",")]
        print("single-centric", file=sys.stderr)
        single = single_centric(seeds)
        print("federated", file=sys.stderr)
        raw = {"seeds": seeds, "broker": args.broker, "python": platform.python_version(),
               "machine": platform.machine(), "single": single,
               "federated": federated(seeds, args.broker)}
        if args.more_seeds:
            first, last = (int(v) for v in args.more_seeds.split("-"))
            raw["more_seeds"] = list(range(first, last + 1))
            print("more seeds", file=sys.stderr)
            raw["more"] = more_seeds(raw["more_seeds"])
        if args.private_seeds:
            raw["private_seeds"] = [int(v) for v in args.private_seeds.split(",")]
            print("private", file=sys.stderr)
            raw["private"] = private(raw["private_seeds"],
                                     [float(v) for v in args.epsilons.split(",")])
        if args.ablation_seeds:
            raw.update(ablation_raw(args))
        if args.flamby_seeds:
            raw.update(flamby_seeds_raw([int(v) for v in args.flamby_seeds.split(",")],
                                        args.broker))
        if args.json:
            Path(args.json).write_text(json.dumps(raw, indent=1))
    write_section(Path(args.out), render(raw))
    plot(raw, Path(args.plot))
    print(f"wrote {args.out} and {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
