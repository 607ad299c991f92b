"""Benchmark ``secagg simulate`` (docs/architecture.md section 7): 100 clients, d = 10^5,
30% dropout, 2 worker processes, embedded broker (and Mosquitto). Target: under 30 s wall,
under 4 GiB.

Runs the real command in a subprocess (broker, server, worker processes and all), samples
the summed RSS of that process tree (psutil; without it, the largest single process from
``getrusage(RUSAGE_CHILDREN)``, a lower bound), and prints wall time, peak memory, bytes per
client per stage, and the ratio to the floor: ``secagg.simulate`` on the same configuration,
inputs and drop schedule in one process (the state machines with no transport at all).

    python benchmarks/bench_simulate.py [--clients 100 --dim 100000 --drop-rate 0.3]
                                        [--broker embedded|mosquitto|both] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from secagg import Config, simulate  # noqa: E402

try:
    import psutil
except ImportError:  # pragma: no cover - optional
    psutil = None

# fl.cli imports every subcommand; stand in for ``train`` if it is not written yet.
ENTRY = (
    "import sys, types, importlib.util\n"
    "if importlib.util.find_spec('fl.cli.train') is None:\n"
    "    m = types.ModuleType('fl.cli.train')\n"
    "    m.add_parser = lambda sub: sub.add_parser('train'); m.run = lambda a: 0\n"
    "    sys.modules['fl.cli.train'] = m\n"
    "from fl.cli import main\n"
    "sys.exit(main())\n"
)


class TreeMemory:
    """Peak of the summed RSS of a process and all its descendants, sampled every 50 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        assert psutil is not None
        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            total = 0
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    total += proc.memory_info().rss
            self.peak = max(self.peak, total)
            self._stop.wait(0.05)

    def __enter__(self) -> TreeMemory:
        if psutil is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def run_cli(args: argparse.Namespace, broker: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp, "report.json")
        argv = [sys.executable, "-c", ENTRY, "simulate", "--clients", str(args.clients),
                "--dim", str(args.dim), "--bits", str(args.bits), "--drop-rate",
                str(args.drop_rate), "--processes", str(args.processes), "--broker", broker,
                "--seed", str(args.seed), "--report", str(report_path)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        started = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=tmp, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        with TreeMemory(proc.pid) as memory:
            stdout, stderr = proc.communicate()
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"secagg simulate failed ({proc.returncode}):\n{stdout}\n{stderr}")
        report = json.loads(report_path.read_text())
    peak = memory.peak
    method = "psutil process-tree sum"
    if not peak:
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        method = "largest child (getrusage), a lower bound"
    per_stage: dict[str, list[int]] = {}
    for counts in report["bytes"].values():
        for stage, n in counts.items():
            per_stage.setdefault(stage, []).append(n)
    return {
        "broker": broker,
        "wall_seconds": round(wall, 3),
        "round_seconds": report["seconds"].get("total"),
        "setup_seconds": report["seconds"].get("setup"),
        "stage_seconds": {k: v for k, v in report["seconds"].items()
                          if k not in ("total", "setup", "wall")},
        "peak_rss_bytes": peak,
        "peak_rss_method": method,
        "correct": report["correct"],
        "included": len(report["included"]),
        "dropped": len(report["dropped"]),
        "bytes_per_client_per_stage": {s: int(statistics.median(v))
                                       for s, v in per_stage.items()},
        "wire_bytes_total": sum(report["wire_bytes"].values()),
    }


def floor(args: argparse.Namespace) -> float:
    """The same round in one process with ``secagg.simulate`` (no transport)."""
    from fl.cli.simulate import drop_schedule
    from transport.runner import InputSource

    config = Config(num_clients=args.clients, dim=args.dim, bits=args.bits)
    ids = list(range(1, args.clients + 1))
    drops = drop_schedule(config, ids, args.drop_rate, "random", args.seed)
    source = InputSource(seed=args.seed)
    inputs = {c: source.load(c, config) for c in ids}
    started = time.perf_counter()
    simulate(config, inputs, drops, seed=args.seed)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--dim", type=int, default=100_000)
    parser.add_argument("--bits", type=int, default=32)
    parser.add_argument("--drop-rate", type=float, default=0.3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--broker", default="both",
                        help="embedded, mosquitto, both (default), or a URL")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    brokers = ["embedded", "mosquitto"] if args.broker == "both" else [args.broker]
    if "mosquitto" in brokers and args.broker == "both":
        from transport.mosquitto import mosquitto_available

        if not mosquitto_available():
            brokers.remove("mosquitto")
    in_process = floor(args)
    runs = [run_cli(args, broker) for broker in brokers]
    for run in runs:
        run["ratio_to_in_process"] = round(run["wall_seconds"] / in_process, 2)
    result = {"clients": args.clients, "dim": args.dim, "bits": args.bits,
              "drop_rate": args.drop_rate, "processes": args.processes,
              "cores": os.cpu_count(), "in_process_simulate_seconds": round(in_process, 3),
              "target": {"wall_seconds": 30, "peak_rss_bytes": 4 << 30}, "runs": runs}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"secagg simulate: {args.clients} clients, d = {args.dim}, {args.drop_rate:.0%} "
          f"dropout, {args.processes} worker processes, {os.cpu_count()} cores")
    print(f"floor: secagg.simulate in one process: {in_process:.2f} s")
    for run in runs:
        ok = run["wall_seconds"] < 30 and run["peak_rss_bytes"] < 4 << 30
        print(f"\n[{run['broker']}] wall {run['wall_seconds']:.2f} s (round "
              f"{run['round_seconds']:.2f} s, setup {run['setup_seconds']:.2f} s), "
              f"{run['ratio_to_in_process']:.2f}x the in-process floor; peak memory "
              f"{run['peak_rss_bytes'] / 2**20:.0f} MiB ({run['peak_rss_method']}); "
              f"correct={run['correct']}; target {'met' if ok else 'MISSED'}")
        print("  stage seconds: " + ", ".join(f"{k} {v:.2f}"
                                               for k, v in run["stage_seconds"].items()))
        print("  bytes per client per stage (median): " + ", ".join(
            f"{k} {v}" for k, v in run["bytes_per_client_per_stage"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
