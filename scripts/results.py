"""Measure the federated-learning results and write docs/results.md.

    python scripts/results.py [--out docs/results.md] [--broker embedded] [--json R.json]

1. Non-private FedAvg over 5 sites (Dirichlet 0.5 non-IID) vs the same model trained
   centrally on the pooled data, on scikit-learn's breast cancer set, same test split.
2. Patient-level DP at epsilon = 4, delta = 1e-5 on the synthetic longitudinal EHR (several
   visits per patient): distributed DP and site DP beside the non-private run.
3. 30 % of sites dropping in random rounds and stages: training completes, every aggregate
   equals the plaintext sum of the included sites' encoded inputs.
Every round of every run is one secure aggregation over the chosen broker.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fl.federation import train, train_central
from fl.settings import TrainSettings


def run(settings: TrainSettings) -> dict[str, Any]:
    started = time.perf_counter()
    report = train(settings)
    report["wall_seconds"] = time.perf_counter() - started
    report.pop("model", None)
    print(f"  {settings.dataset} dp={settings.dp} drop={settings.drop_rate}: "
          f"{len(report['rounds'])} rounds, accuracy {report['final_accuracy']:.4f}, "
          f"{report['wall_seconds']:.1f} s", file=sys.stderr)
    return report


def sklearn_reference(settings: TrainSettings) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    from fl.federation import load_split

    split = load_split(settings)
    scaler = StandardScaler().fit(split.train.x)
    clf = LogisticRegression(max_iter=5000).fit(scaler.transform(split.train.x), split.train.y)
    return float(clf.score(scaler.transform(split.test.x), split.test.y))


def drop_summary(report: dict[str, Any]) -> dict[str, Any]:
    stages: Counter[str] = Counter()
    for row in report["rounds"]:
        stages.update(row["dropped"].values())
    return {"rounds": len(report["rounds"]),
            "rounds_with_drops": sum(1 for r in report["rounds"] if r["dropped"]),
            "drops_by_stage": dict(stages),
            "retried_rounds": sum(1 for r in report["rounds"] if r["attempts"] > 1),
            "all_correct": all(r["aggregate_correct"] for r in report["rounds"]),
            "min_included": min(len(r["included"]) for r in report["rounds"]),
            "final_accuracy": report["final_accuracy"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="docs/results.md")
    ap.add_argument("--broker", default="embedded")
    ap.add_argument("--json", help="also write the raw reports here")
    ap.add_argument("--from-json", help="only re-render docs from reports saved by --json")
    args = ap.parse_args()
    b = args.broker
    if args.from_json:
        write(Path(args.out), render(json.loads(Path(args.from_json).read_text()), b))
        return

    print("1. central vs FedAvg (breast cancer)", file=sys.stderr)
    bc = TrainSettings(sites=5, rounds=40, dataset="breast-cancer", broker=b, seed=0)
    fed = run(bc)
    central = train_central(bc)
    skl = sklearn_reference(bc)
    prox = run(replace(bc, fedprox_mu=0.1))

    print("2. DP at epsilon 4 (EHR, patient level)", file=sys.stderr)
    ehr = TrainSettings(sites=5, rounds=30, dataset="ehr", broker=b, seed=0, sample_rate=0.2,
                        epsilon=4.0, delta=1e-5, unit="patient", dp="distributed")
    dp_none = run(replace(ehr, dp="none", epsilon=None))
    dp_dist = run(replace(ehr, dp="distributed"))
    dp_site = run(replace(ehr, dp="site"))
    ehr_central = train_central(replace(ehr, dp="none", epsilon=None))

    print("3. 30 % dropout", file=sys.stderr)
    drop_none = run(replace(bc, rounds=30, drop_rate=0.3, seed=1))
    drop_dist = run(replace(ehr, dp="distributed", drop_rate=0.3, seed=1))

    raw = {"fedavg": fed, "fedprox": prox, "central": central, "sklearn": skl,
           "ehr_central": ehr_central, "dp_none": dp_none, "dp_distributed": dp_dist,
           "dp_site": dp_site, "drop_none": drop_none, "drop_distributed": drop_dist}
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    write(Path(args.out), render(raw, b))
    print(f"wrote {args.out}", file=sys.stderr)


OTHERS = (("<!-- section: attacks -->", "<!-- end section: attacks -->"),)
"""Sections of docs/results.md that other scripts own, besides scripts/tcga_brca.py's
(benchmarks/bench_attacks.py's)."""


def write(out: Path, text: str) -> None:
    """Write ``text``, keeping the sections other scripts own (scripts/tcga_brca.py,
    :data:`OTHERS`)."""
    from tcga_brca import END, START

    old = out.read_text(encoding="utf-8") if out.exists() else ""
    for start, end in ((START, END), *OTHERS):
        if start in old and end in old:
            kept = start + old.split(start, 1)[1].split(end, 1)[0] + end
            text = text.rstrip("\n") + "\n\n" + kept + "\n"
    out.write_text(text, encoding="utf-8")


def _acc(report: dict[str, Any]) -> float:
    return float(report["final_accuracy"])


def render(r: dict[str, Any], broker: str) -> str:
    fed, central = r["fedavg"], r["central"]
    gap = 100 * (central["accuracy"] - _acc(fed))
    lines = [
        "# Federated learning results",
        "",
        "Generated by `python scripts/results.py` (do not edit by hand); "
        f"{platform.python_version()}, {platform.machine()}, broker `{broker}` (every round "
        "is one secure aggregation over MQTT with the topic ACL). Accuracies are on a held-out "
        "test split by patient (20 %), the same for the federated and the central model.",
        "",
        "Patients with different numbers of records (record-level DP, naive group privacy with "
        "a cut-off, patient units, individual sampling rates and clip norms, individual "
        "budgets): [patient_privacy.md](patient_privacy.md), generated by "
        "`python scripts/patient_privacy.py`.",
        "",
        "## 1. FedAvg vs central training (breast cancer, no DP)",
        "",
        "scikit-learn's bundled Wisconsin diagnostic breast cancer set (569 patients, one "
        "record each), 5 sites, non-IID (Dirichlet alpha 0.5 over labels), logistic "
        "regression, 40 rounds x 1 local epoch (SGD, lr 0.1, batch 32) vs 40 epochs of "
        "the same SGD on the pooled training data. Sample counts are summed securely "
        "(weighted FedAvg).",
        "",
        "| model | test accuracy | test loss |",
        "|---|---|---|",
        f"| central (pooled data, same SGD) | {central['accuracy']:.4f} | "
        f"{central['loss']:.4f} |",
        f"| FedAvg, 5 sites | {_acc(fed):.4f} | {fed['rounds'][-1]['loss']:.4f} |",
        f"| FedProx (mu 0.1), 5 sites | {_acc(r['fedprox']):.4f} | "
        f"{r['fedprox']['rounds'][-1]['loss']:.4f} |",
        f"| scikit-learn LogisticRegression (reference) | {r['sklearn']:.4f} | |",
        f"| majority class | {central['chance']:.4f} | |",
        "",
        f"Gap central - FedAvg: {gap:+.2f} points (target: within 2). "
        f"{len(fed['rounds'])} rounds in {fed['wall_seconds']:.1f} s.",
        "",
        "## 2. Patient-level DP, epsilon = 4, delta = 1e-5 (synthetic longitudinal EHR)",
        "",
        "The synthetic EHR generator (1000 patients, 2-8 visits each, 12 standardized "
        "features, labels sharing a per-patient latent risk), 5 sites (Dirichlet 0.5), "
        "logistic regression, 30 rounds, patient sampling rate 0.2, clip 1. The unit is the "
        "patient: all of a patient's visits are grouped before clipping. Distributed: each "
        "round, per-patient gradients at the global model with a secure count column, the "
        "site's share of discrete Gaussian noise (calibrated to the threshold 3 of 5), "
        "server step 1.0. Site: each site runs Opacus DP-SGD with full local noise (5 steps "
        "per round, lr 0.1), uniform averaging.",
        "",
        f"Central (pooled, no DP) reference: {r['ehr_central']['accuracy']:.4f}.",
        "",
        "| mode | final accuracy | gap to non-private | epsilon spent | noise |",
        "|---|---|---|---|---|",
    ]
    base = _acc(r["dp_none"])
    for name, key in (("none", "dp_none"), ("distributed", "dp_distributed"),
                      ("site", "dp_site")):
        rep = r[key]
        eps = rep["final_epsilon"]
        lines.append(f"| {name} | {_acc(rep):.4f} | {100 * (_acc(rep) - base):+.2f} pts | "
                     f"{'-' if eps is None else f'{eps:.3f}'} | {rep['privacy']} |")
    lines += ["", "Per round (accuracy / epsilon):", "",
              "| round | none | distributed | site |", "|---|---|---|---|"]
    for i, row in enumerate(r["dp_none"]["rounds"]):
        d = r["dp_distributed"]["rounds"][i] if i < len(r["dp_distributed"]["rounds"]) else None
        s = r["dp_site"]["rounds"][i] if i < len(r["dp_site"]["rounds"]) else None
        def cell(x):
            return ("-" if x is None else f"{x['accuracy']:.4f} / {x['epsilon']:.3f}")
        lines.append(f"| {row['round']} | {row['accuracy']:.4f} | {cell(d)} | {cell(s)} |")
    lines += ["", "## 3. 30 % of sites dropping in random rounds and stages", "",
              "Each site drops out of each round with probability 0.3 at a uniformly random "
              "stage (advertise_keys, share_keys, masked_input, unmasking; it signs off as its "
              "last will would). A round with fewer than the threshold 3 survivors aborts, "
              "releases nothing, spends nothing and is retried with fresh inputs. Every "
              "aggregate is compared with the plaintext modular sum of the included sites' "
              "encoded inputs (possible only because the simulation holds them). Seed 1, so the "
              "breast cancer test split differs from section 1's.", "",
              "| run | rounds | rounds with drops | drops by stage | retried rounds | "
              "min included | all aggregates correct | final accuracy |",
              "|---|---|---|---|---|---|---|---|"]
    for name, key in (("breast cancer, no DP", "drop_none"),
                      ("EHR, distributed DP eps 4", "drop_distributed")):
        s = drop_summary(r[key])
        stages = ", ".join(f"{k} {v}" for k, v in sorted(s["drops_by_stage"].items()))
        lines.append(f"| {name} | {s['rounds']} | {s['rounds_with_drops']} | {stages} | "
                     f"{s['retried_rounds']} | {s['min_included']} | "
                     f"{'yes' if s['all_correct'] else 'NO'} | {s['final_accuracy']:.4f} |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
