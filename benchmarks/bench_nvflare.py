"""NVFlare 2.9's plain FedAvg, NVFlare's HE (TenSEAL CKKS filters) and this package's
SecureFedAvg on the same job, side by side (docs/nvflare.md "Measured").

One POC deployment (NVFlare's ``PocEnv``: the server and K sites as processes on 127.0.0.1,
on free ports, provisioned with NVFlare's ``HEBuilder`` contexts), a numpy model of d
float32 parameters moved by the same deterministic step per site and round
(``benchmarks/nvflare/bench_step.py``), jobs run one after another:

* ``plain``: ``FedAvg`` (ModelController) + ``ScriptRunner``;
* ``he``: NVFlare's HE job (as its ``FedAvgRecipeWithHE``, for numpy): ``ScatterAndGather``
  with ``HEModelShareableGenerator`` and ``HEInTimeAccumulateWeightedAggregator`` at the
  server, ``HEModelDecryptor`` / ``HEModelEncryptor`` filters at the sites;
* ``secure``: ``SecureFedAvg`` + ``SecureScriptRunner`` (SecAgg, complete graph).

Per variant and d, from one R-round job: seconds per round and server / per-site CPU seconds
per round between site-1 receiving round 1's model and round R-1's (so start-up and the
first round's warm-up are left out; CPU of every POC process of the server / of each site,
job processes included, sampled with psutil), bytes each site uploads per round, and the
largest difference of the aggregate (the model site-1 receives in the last round) from
plain FedAvg's. Then, at the first d, site-3 goes silent for good in
round 1 ``before`` its upload (its training never returns) and ``after`` it (plain/HE: after
its result was sent; secure: after its masked input): does the round complete, over which
sites, and is the aggregate the weighted mean of theirs (max abs error against numpy)?

    nice PYTHONPATH=$PWD python benchmarks/bench_nvflare.py --dims 100000 1000000

Needs the nvflare extra (nvflare[HE]) and psutil.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "nvflare"))
sys.path.insert(0, str(ROOT / "tests" / "nvflare"))  # nvflare_sites.poc_project

from bench_step import PLAN_ENV, local_update  # noqa: E402

KINDS = ("plain", "he", "secure")
SILENT = "site-3"
TRAIN_TIMEOUT = 20  # the secure job's train deadline in the drop runs (seconds)
STAGE_TIMEOUT = 5.0


class CpuMeter:
    """CPU seconds (user + system) of the POC processes, by participant (``server``,
    ``site-N``): every process whose command line names the participant's kit folder,
    sampled every 0.2 s; a process that exited keeps its last sample."""

    def __init__(self, workspace: Path) -> None:
        self.pattern = re.compile(re.escape(str(workspace)) + r"\S*?/(server|site-\d+)(/|\s|$)")
        self.last: dict[int, tuple[str, float]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        import psutil

        while not self.stop.is_set():
            for proc in psutil.process_iter(["pid", "cmdline"]):
                try:
                    match = self.pattern.search(" ".join(proc.info["cmdline"] or ()))
                    if match:
                        times = proc.cpu_times()
                        self.last[proc.pid] = (match.group(1), times.user + times.system)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            time.sleep(0.2)

    def totals(self, settle: float = 0.5) -> dict[str, float]:
        time.sleep(settle)  # one more sample
        out: dict[str, float] = {}
        for role, cpu in list(self.last.values()):
            out[role] = out.get(role, 0.0) + cpu
        return out


def build_job(kind: str, dim: int, sites: int, rounds: int, work: Path, silent_run: bool,
              interval: float = 0.0) -> Any:
    from bench_components import BenchExecutor, EncryptedNPModelPersistor, TaskRequestInterval
    from nvflare.apis.dxo import DataKind
    from nvflare.app_common.np.np_model_persistor import NPModelPersistor
    from nvflare.app_common.workflows.fedavg import FedAvg
    from nvflare.app_common.workflows.scatter_and_gather import ScatterAndGather
    from nvflare.app_opt.he.intime_accumulate_model_aggregator import (
        HEInTimeAccumulateWeightedAggregator,
    )
    from nvflare.app_opt.he.model_decryptor import HEModelDecryptor
    from nvflare.app_opt.he.model_encryptor import HEModelEncryptor
    from nvflare.app_opt.he.model_shareable_generator import HEModelShareableGenerator
    from nvflare.fuel.utils.constants import FrameworkType
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.defs import FilterType
    from nvflare.job_config.script_runner import ScriptRunner

    from fl.nvflare import SecureFedAvg, SecureScriptRunner

    initial = work / "initial.npy"
    np.save(initial, np.zeros(dim, dtype=np.float32))
    job = FedJob(name=f"{kind}-{dim}-{rounds}", min_clients=sites)
    script = str(HERE / "nvflare" / "bench_train.py")
    persistor = EncryptedNPModelPersistor if kind == "he" else NPModelPersistor
    job.to_server(persistor(source_ckpt_file_full_name=str(initial)), id="persistor")
    if interval and kind != "secure":  # SecureFedAvg sets its own (0.1 s)
        job.to_server(TaskRequestInterval(interval))
    if kind == "plain":
        job.to_server(FedAvg(num_clients=sites, num_rounds=rounds))
        job.to_clients(ScriptRunner(script, framework=FrameworkType.NUMPY))
    elif kind == "he":
        generator = job.to_server(HEModelShareableGenerator(), id="shareable_generator")
        aggregator = job.to_server(HEInTimeAccumulateWeightedAggregator(
            expected_data_kind=DataKind.WEIGHTS, weigh_by_local_iter=False), id="aggregator")
        job.to_server(ScatterAndGather(min_clients=sites, num_rounds=rounds,
                                       wait_time_after_min_received=0,
                                       aggregator_id=aggregator, persistor_id="persistor",
                                       shareable_generator_id=generator))
        job.to_clients(ScriptRunner(script, framework=FrameworkType.NUMPY))
        job.to_clients(HEModelDecryptor(), tasks=["train"], filter_type=FilterType.TASK_DATA)
        job.to_clients(HEModelEncryptor(weigh_by_local_iter=True), tasks=["train"],
                       filter_type=FilterType.TASK_RESULT)
    else:
        job.to_server(SecureFedAvg(num_rounds=rounds, neighbors=None,
                                   stage_timeout=STAGE_TIMEOUT if silent_run else 60.0,
                                   train_timeout=TRAIN_TIMEOUT if silent_run else 3600.0,
                                   report_path=str(work / "reports.jsonl")))
        job.to_clients(SecureScriptRunner(script, framework=FrameworkType.NUMPY,
                                          executor=BenchExecutor()))
    return job


class Poc:
    """One POC deployment with HE kits; jobs submitted one after another."""

    def __init__(self, sites: int, work: Path) -> None:
        from nvflare.recipe.poc_env import PocEnv

        self.work = work
        self.names = [f"site-{i}" for i in range(1, sites + 1)]
        os.environ["NVFLARE_POC_WORKSPACE"] = str(work / "poc")
        os.environ["HOME"] = str(work / "home")  # NVFlare's ~/.nvflare
        (work / "home").mkdir(parents=True)
        os.environ["SECAGG_NVFLARE_DIR"] = str(work / "sites")
        os.environ[PLAN_ENV] = str(work / "plan.json")
        (work / "plan.json").write_text(json.dumps({"record": None, "silent": None}))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), str(HERE / "nvflare"), os.environ.get("PYTHONPATH", "")])
        for name in self.names:  # the sites opt in to exact sums
            (work / "sites" / name).mkdir(parents=True)
            (work / "sites" / name / "policy.json").write_text('{"modes": ["none"]}')
        from nvflare_sites import poc_project  # free loopback ports, NVFlare's HE kits

        self.env = PocEnv(project_conf_path=poc_project(work / "project", self.names,
                                                        use_he=True), use_he=True)
        self.started = False
        self.meter: CpuMeter | None = None

    def run(self, job: Any, rounds: int, record: Path, silent: list[Any] | None,
            limit: float) -> dict[str, Any]:
        """Run ``job`` of ``rounds`` rounds (aborted after ``limit`` seconds): wall seconds,
        CPU by participant, the final status, and the round marks: round k -> (the time
        site-1 received round k's model, the CPU by participant then)."""
        if not self.started:  # start the deployment with a tiny warm-up job, unmeasured
            warm = self.work / "warm-up"
            warm.mkdir()
            job_id = self.env.deploy(build_job("plain", 10, len(self.names), 1, warm, False))
            assert self.env.get_job_result(job_id, timeout=600) is not None
            self.started = True
            self.meter = CpuMeter(self.work / "poc")
        record.mkdir(parents=True)
        (self.work / "plan.json").write_text(json.dumps({"record": str(record),
                                                         "silent": silent}))
        assert self.meter is not None
        before = self.meter.totals()
        started = time.perf_counter()
        job_id = self.env._get_session_manager().submit_job(job)
        status, marks, polled = "", {}, 0.0
        while time.perf_counter() - started < limit:
            for k in range(rounds):  # site-1 received round k's model: a round mark
                path = record / f"site-1-r{k}.npy"
                if k not in marks and path.exists():
                    marks[k] = (path.stat().st_mtime, self.meter.totals(settle=0.2))
            if time.perf_counter() - polled > 1:
                polled = time.perf_counter()
                status = str(self.env.get_job_status(job_id) or "")
                if status.startswith("FINISHED"):
                    break
            time.sleep(0.05)
        wall = time.perf_counter() - started
        if not status.startswith("FINISHED"):
            self.env.abort_job(job_id)
            while not str(self.env.get_job_status(job_id) or "").startswith("FINISHED"):
                time.sleep(1)
            status = f"aborted by the benchmark after {limit:.0f} s"
        assert self.meter is not None
        after = self.meter.totals()
        cpu = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        return {"wall": wall, "cpu": cpu, "status": status, "marks": marks}

    def stop(self) -> None:
        import psutil

        self.env.stop(clean_up=True)
        if self.meter is None:
            return
        self.meter.stop.set()
        for pid in list(self.meter.last):  # a silent site's job process outlives the POC
            try:
                proc = psutil.Process(pid)
                if self.meter.pattern.search(" ".join(proc.cmdline())):
                    proc.kill()
            except psutil.NoSuchProcess:
                continue

    def he_upload_bytes(self, dim: int) -> int:
        """The bytes of one site's HE upload: its CKKS vector of d values, serialized with
        the context NVFlare provisioned to site-1."""
        import tenseal as ts

        kit = next((self.work / "poc").rglob("site-1/startup/client_context.tenseal"))
        context = ts.context_from(kit.read_bytes())
        return len(ts.ckks_vector(context, np.zeros(dim)).serialize())


def received(record: Path, site: str, server_round: int) -> np.ndarray | None:
    path = record / f"{site}-r{server_round}.npy"
    return np.load(path) if path.exists() else None


def reference(start: np.ndarray, server_round: int, sites: list[str]) -> np.ndarray:
    """The weighted FedAvg of ``sites``' updates from ``start`` (numpy, float64)."""
    updates = [local_update(s, server_round, start) for s in sites]
    total = sum(w for _, w in updates)
    return sum(w * u.astype(np.float64) for u, w in updates) / total


def timing(poc: Poc, kind: str, dim: int, rounds: int, work: Path, interval: float
           ) -> dict[str, Any]:
    """One ``rounds``-round job; per round: the seconds and CPU between site-1 receiving
    round 1's model and round ``rounds - 1``'s (start-up and the first round's warm-up
    excluded)."""
    folder = work / f"{kind}-{dim}"
    folder.mkdir(parents=True)
    job = build_job(kind, dim, len(poc.names), rounds, folder, silent_run=False,
                    interval=interval)
    run = poc.run(job, rounds, folder / "record", None, limit=3600)
    print(f"  {kind} d={dim}: {run['wall']:.1f} s {run['status']}", flush=True)
    first, last = run["marks"][1], run["marks"][rounds - 1]
    per = rounds - 2
    cpu = {k: (last[1].get(k, 0.0) - first[1].get(k, 0.0)) / per for k in last[1]}
    out: dict[str, Any] = {
        "s": (last[0] - first[0]) / per, "server_cpu": cpu.get("server", 0.0),
        "site_cpu": float(np.mean([cpu.get(s, 0.0) for s in poc.names])),
        "model": received(folder / "record", "site-1", rounds - 1), "status": run["status"],
    }
    if kind == "plain":
        out["up"] = 4 * dim
    elif kind == "he":
        out["up"] = poc.he_upload_bytes(dim)
    else:
        reports = [json.loads(line) for line in
                   (folder / "reports.jsonl").read_text().splitlines()]
        out["up"] = float(np.mean([np.mean(list(r["bytes_up"].values())) for r in reports]))
    return out


def drop(poc: Poc, kind: str, dim: int, when: str, work: Path, hang: float,
         interval: float) -> str:
    """Site-3 silent for good from round 1 (``before`` / ``after`` its upload) in a 3-round
    job: what happened to round 1 and to the job."""
    folder = work / f"drop-{kind}-{when}"
    folder.mkdir(parents=True)
    job = build_job(kind, dim, len(poc.names), 3, folder, silent_run=True,
                    interval=interval)
    budget = 60 + 2 * TRAIN_TIMEOUT + 6 * STAGE_TIMEOUT if kind == "secure" else 60
    run = poc.run(job, 3, folder / "record", [SILENT, 1, when], limit=budget + hang)
    record = folder / "record"
    start, result = received(record, "site-1", 1), received(record, "site-1", 2)
    if kind == "secure":
        reports = [json.loads(line) for line in
                   (folder / "reports.jsonl").read_text().splitlines()]
        first = next((r for r in reports if r["server_round"] == 1), None)
        included = first["included"] if first else []
        later = "; ".join(f"round {r['server_round']}: sum of {len(r['included'])}, "
                          f"{SILENT} dropped in {r['dropped'].get(SILENT, '-')}"
                          for r in reports if r["server_round"] > 1)
    else:
        included = [n for n in poc.names if n != SILENT] if when == "before" else poc.names
        later, reports = "", []
    if start is None or result is None:
        return (f"round 1 does not complete: waits for {SILENT} ({run['status']}, "
                f"{run['wall']:.0f} s)")
    error = float(np.max(np.abs(result - reference(start, 1, included))))
    who = "without" if SILENT not in included else "with"
    tail = f"; {later}" if later else ""
    if run["status"] == "FINISHED:COMPLETED":
        ending = "job completes"
    elif kind == "secure" and len(reports) == 3 and reports[-1]["total"] is not None:
        ending = (f"all 3 rounds complete, then the job's end waits for {SILENT}'s hung job "
                  f"process ({run['status']})")
    else:
        ending = f"round 2 waits for {SILENT} ({run['status']})"
    return (f"round 1 completes {who} {SILENT} (max abs error {error:.1e} against the "
            f"weighted mean of the {len(included)}){tail}; {ending}, {run['wall']:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dims", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4, help="at least 3")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--hang", type=float, default=60.0,
                        help="seconds a job may wait on a silent site past its budget")
    parser.add_argument("--no-drops", action="store_true")
    parser.add_argument("--task-request-interval", type=float, default=0.1,
                        help="the plain and HE jobs' server task_request_interval (seconds; "
                        "SecureFedAvg's default, 0.1, so that all three poll alike; 0: "
                        "NVFlare's default, 2 s)")
    args = parser.parse_args()
    rows: list[tuple[int, str, dict[str, Any]]] = []
    drops: dict[tuple[str, str], str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        poc = Poc(args.sites, work)
        try:
            for dim in args.dims:
                results = {kind: timing(poc, kind, dim, args.rounds, work,
                                        args.task_request_interval)
                           for kind in args.kinds}
                for kind in args.kinds:
                    rows.append((dim, kind, results[kind]))
            if not args.no_drops:
                for kind in args.kinds:
                    for when in ("before", "after"):
                        drops[kind, when] = drop(poc, kind, args.dims[0], when, work,
                                                 args.hang, args.task_request_interval)
                        print(f"  drop {kind} {when}: {drops[kind, when]}", flush=True)
        finally:
            poc.stop()
    names = {"plain": "NVFlare FedAvg", "he": "NVFlare HE (CKKS)", "secure": "SecureFedAvg"}
    print(f"\n{args.sites} sites, {args.rounds} rounds, NVFlare POC mode (processes on "
          f"127.0.0.1), task_request_interval {args.task_request_interval or 2} s "
          "(SecureFedAvg: 0.1 s), this machine")
    print("| d | variant | s/round | server CPU s/round | site CPU s/round | bytes up/site/round "
          "| max abs diff from plain FedAvg |")
    print("|---|---|---|---|---|---|---|")
    plain = {dim: r["model"] for dim, kind, r in rows if kind == "plain"}
    for dim, kind, r in rows:
        diff = ("-" if kind == "plain" or dim not in plain or r["model"] is None
                else f"{float(np.max(np.abs(r['model'] - plain[dim]))):.2e}")
        print(f"| {dim:,} | {names[kind]} | {r['s']:.2f} | {r['server_cpu']:.2f} | "
              f"{r['site_cpu']:.2f} | {r['up']:,.0f} | {diff} |")
    if drops:
        print(f"\n{SILENT} silent for good from round 1, d = {args.dims[0]:,}:\n")
        print("| variant | silent before its upload | silent after its upload |")
        print("|---|---|---|")
        for kind in args.kinds:
            print(f"| {names[kind]} | {drops[kind, 'before']} | {drops[kind, 'after']} |")


if __name__ == "__main__":
    main()
