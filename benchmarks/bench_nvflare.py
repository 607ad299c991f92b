"""NVFlare 2.9's plain FedAvg against this package's SecureFedAvg on the same job
(docs/nvflare.md "Measured"): K sites on NVFlare's simulator, a numpy model of d parameters,
R rounds; wall seconds per round (the difference of an R-round and a 1-round run, so the
simulator's start-up cancels), bytes each site uploads per round, and the aggregate's
largest difference from plain FedAvg's.

    PYTHONPATH=$PWD python benchmarks/bench_nvflare.py --dims 100000 1000000

Needs the nvflare extra. NVFlare's HE (TenSEAL CKKS) variant is not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent


def run(kind: str, dim: int, sites: int, rounds: int, work: Path) -> dict[str, Any]:
    from nvflare.app_common.np.np_model_persistor import NPModelPersistor
    from nvflare.app_common.workflows.fedavg import FedAvg
    from nvflare.fuel.utils.constants import FrameworkType
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.script_runner import ScriptRunner

    from fl.nvflare import SecureFedAvg, SecureScriptRunner

    work.mkdir(parents=True)
    initial = work / "initial.npy"
    np.save(initial, np.zeros(dim, dtype=np.float32))
    job = FedJob(name=f"{kind}-{dim}", min_clients=sites)
    script = str(HERE / "nvflare" / "bench_train.py")
    report = work / "reports.jsonl"
    if kind == "plain":
        job.to_server(FedAvg(num_clients=sites, num_rounds=rounds))
        job.to_clients(ScriptRunner(script, framework=FrameworkType.NUMPY))
    else:
        job.to_server(SecureFedAvg(num_rounds=rounds, neighbors=None, stage_timeout=60.0,
                                   report_path=str(report)))
        job.to_clients(SecureScriptRunner(script, framework=FrameworkType.NUMPY))
    job.to_server(NPModelPersistor(source_ckpt_file_full_name=str(initial)), id="persistor")
    os.environ["SECAGG_NVFLARE_DIR"] = str(work / "sites")
    for i in range(1, sites + 1):  # the sites opt in to exact sums
        (work / "sites" / f"site-{i}").mkdir(parents=True)
        (work / "sites" / f"site-{i}" / "policy.json").write_text('{"modes": ["none"]}')
    started = time.perf_counter()
    job.simulator_run(str(work / "ws"), n_clients=sites, threads=sites)
    wall = time.perf_counter() - started
    model = np.load(next((work / "ws").rglob("server.npy"))).ravel()
    reports = ([json.loads(line) for line in report.read_text().splitlines()]
               if report.exists() else [])
    return {"wall": wall, "model": model, "reports": reports}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dims", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dim in args.dims:
            result: dict[str, dict[str, Any]] = {}
            for kind in ("plain", "secure"):
                long = run(kind, dim, args.sites, args.rounds, Path(tmp) / f"{kind}-{dim}-R")
                one = run(kind, dim, args.sites, 1, Path(tmp) / f"{kind}-{dim}-1")
                result[kind] = {"per_round": (long["wall"] - one["wall"]) / (args.rounds - 1),
                                "model": long["model"], "reports": long["reports"]}
            secure = result["secure"]["reports"]
            up = np.mean([np.mean(list(r["bytes_up"].values())) for r in secure])
            stages = {k: np.mean([r["seconds"][k] for r in secure])
                      for k in secure[0]["seconds"]}
            error = float(np.max(np.abs(result["secure"]["model"] - result["plain"]["model"])))
            rows.append((dim, result["plain"]["per_round"], result["secure"]["per_round"],
                         4 * dim, up, error, stages))
    print(f"{args.sites} sites, {args.rounds} rounds, NVFlare simulator, this machine")
    print("| d | plain FedAvg s/round | SecureFedAvg s/round | plain bytes up/site/round "
          "| secure bytes up/site/round | max abs diff of the aggregates | secure s per stage |")
    print("|---|---|---|---|---|---|---|")
    for dim, plain, secure_s, plain_up, secure_up, error, stages in rows:
        print(f"| {dim:,} | {plain:.2f} | {secure_s:.2f} | {plain_up:,} | {secure_up:,.0f} "
              f"| {error:.2e} | " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()) + " |")


if __name__ == "__main__":
    main()
