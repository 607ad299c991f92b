"""How ``secagg simulate`` scales with the number of clients, and the cost model behind the
round deadlines (``transport.deadlines.round_work``, docs/performance.md "Round deadlines").

Two parts:

* ``--calibrate``: the state machines in this process, no transport. For one round of
  ``--calibrate-clients`` clients it times each stage's client answer per neighbour pair,
  the mask expansion per vector element per pair, and the server's receive + advance per
  pair, in both security modes, and prints them beside the constants ``transport.deadlines``
  uses (measured: seconds; the constants must be at least the idle measurement, and the
  deadlines multiply them by ``transport.deadlines.SAFETY``).
* the default: the real ``secagg simulate`` command (embedded broker, worker processes,
  server) in a subprocess for each ``--clients`` value, complete graph and, with
  ``--neighbors K``, SecAgg+; prints the wall time, the slowest stage and that stage's
  deadline, and fails (exit 1) if a run did not finish with the correct sum.

    python benchmarks/bench_simulate_scale.py --calibrate
    python benchmarks/bench_simulate_scale.py --clients 100 200 300 500 --dim 1000 [--neighbors 40]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from secagg import Config, SigningKey, Stage, encode  # noqa: E402
from secagg.client import Client  # noqa: E402
from secagg.server import Server  # noqa: E402
from transport.deadlines import (  # noqa: E402
    ELEMENT_SECONDS,
    PAIR_SECONDS,
    SERVER_PAIR_SECONDS,
    round_timeouts,
)

SAMPLE = 24
"""Clients timed per stage (the first one warms Shamir tables and is left out)."""


def _round(n: int, dim: int, security: str) -> dict[str, Any]:
    """One in-process round; returns per-stage client seconds per pair and server seconds
    per pair."""
    config = Config(num_clients=n, dim=dim, bits=32, security=security)
    roster = list(range(1, n + 1))
    context = os.urandom(16)
    signing: dict[int, SigningKey] = {}
    verify: dict[int, bytes] | None = None
    if config.malicious:
        signing = {c: SigningKey.generate() for c in roster}
        verify = {c: k.public for c, k in signing.items()}
    server = Server(config, roster=roster, context=context, verify_keys=verify)
    rng = np.random.default_rng(0)
    clients = {c: Client(config, c, rng.integers(0, 1 << 32, size=dim, dtype=np.uint64),
                         roster=roster, context=context, signing_key=signing.get(c),
                         verify_keys=verify) for c in roster}
    k = n - 1
    client_pair: dict[str, float] = {}
    server_pair: dict[str, float] = {}
    replies: dict[int, bytes] = {}
    for c in roster:
        clients[c].bind_nonce(server.nonce)
        replies[c] = encode(clients[c].advertise())
    stage = Stage.ADVERTISE_KEYS
    while server.result is None:
        started = time.perf_counter()
        for c, raw in replies.items():
            server.receive(c, raw)
        out = server.advance()
        server_pair[stage.label] = (time.perf_counter() - started) / (n * k)
        if server.result is not None:
            break
        stage = server.stage
        raws = {c: encode(m) for c, m in out.items()}
        replies = {}
        timed = 0.0
        for i, (c, raw) in enumerate(raws.items()):
            started = time.perf_counter()
            replies[c] = encode(clients[c].handle(raw))
            if 1 <= i <= SAMPLE:
                timed += time.perf_counter() - started
        client_pair[stage.label] = timed / SAMPLE / k
    return {"client": client_pair, "server": server_pair}


def calibrate(n: int) -> int:
    small, large = 1000, 50_000
    print(f"in-process rounds, n = {n} (k = {n - 1}), load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    modes = {mode: _round(n, small, mode) for mode in ("semi-honest", "malicious")}
    big = _round(n, large, "semi-honest")
    element = ((big["client"]["masked_input"] - modes["semi-honest"]["client"]["masked_input"])
               / (large - small))
    print(f"{'stage':<18} {'semi-honest':>11} {'model':>7} {'malicious':>10} {'model':>7}"
          f" {'server':>7} {'model':>7}   (microseconds per pair)")
    for stage in Stage:
        label = stage.label
        semi = modes["semi-honest"]["client"].get(label)
        mal = modes["malicious"]["client"].get(label)
        srv = max(m["server"].get(label, 0.0) for m in modes.values())
        print(f"{label:<18} {_us(semi):>11} {_us(PAIR_SECONDS['semi-honest'][label]):>7}"
              f" {_us(mal):>10} {_us(PAIR_SECONDS['malicious'][label]):>7}"
              f" {_us(srv):>7} {_us(SERVER_PAIR_SECONDS):>7}")
    print(f"mask expansion per element per pair: {element * 1e9:.2f} ns "
          f"(model {ELEMENT_SECONDS * 1e9:.2f} ns)")
    return 0


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e6:.1f}"


def run_simulate(n: int, dim: int, neighbors: int | None, processes: int,
                 timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        report = Path(tmp, "report.json")
        argv = [sys.executable, "-m", "fl.cli", "simulate", "--clients", str(n), "--dim",
                str(dim), "--seed", "1", "--processes", str(processes), "--report",
                str(report)]
        if neighbors is not None:
            argv += ["--neighbors", str(neighbors), "--drop-rate", "0.0"]
        started = time.perf_counter()
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout, check=False,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        wall = time.perf_counter() - started
        data = json.loads(report.read_text()) if report.exists() else {}
    return {"returncode": proc.returncode, "wall": wall, "report": data,
            "stderr": proc.stderr[-2000:]}


def scale(args: argparse.Namespace) -> int:
    cores = len(os.sched_getaffinity(0))
    print(f"secagg simulate, d = {args.dim}, {args.processes} worker processes, embedded "
          f"broker, {cores} cores, load average {os.getloadavg()[0]:.2f} at the start")
    print(f"{'n':>5} {'k':>5} {'wall s':>8} {'round s':>8} {'slowest stage':<16}"
          f" {'its s':>7} {'deadline s':>10} {'republished':>11} {'ok':>3}")
    failed = 0
    for n in args.clients:
        config = Config(num_clients=n, dim=args.dim, neighbors=args.neighbors,
                        dropout_rate=0.0 if args.neighbors is not None else None)
        k = config.neighbors if config.neighbors is not None else n - 1
        deadlines = round_timeouts(60.0, clients=n, dim=args.dim, neighbors=config.neighbors,
                                   colocated=math.ceil(n / min(args.processes, cores)))
        run = run_simulate(n, args.dim, args.neighbors, args.processes, args.timeout)
        rep = run["report"]
        seconds = {s: v for s, v in rep.get("seconds", {}).items()
                   if s not in ("setup", "wall", "total")}
        slowest = max(seconds, key=seconds.__getitem__) if seconds else "-"
        ok = run["returncode"] == 0 and rep.get("correct") is True
        failed += not ok
        stage = Stage.parse(slowest) if seconds else Stage.SHARE_KEYS
        print(f"{n:>5} {k:>5} {run['wall']:>8.1f} {rep.get('seconds', {}).get('total', 0):>8.1f}"
              f" {slowest:<16} {seconds.get(slowest, 0.0):>7.1f}"
              f" {deadlines.deadline(stage):>10.0f}"
              f" {rep.get('transport', {}).get('republished', 0):>11} {'yes' if ok else 'NO':>3}",
              flush=True)
        if not ok:
            print(run["stderr"], file=sys.stderr)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the cost model's constants in-process")
    parser.add_argument("--calibrate-clients", type=int, default=200, metavar="N")
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 200, 300, 500])
    parser.add_argument("--dim", type=int, default=1000)
    parser.add_argument("--neighbors", type=int, metavar="K",
                        help="SecAgg+ with K neighbours (default: complete graph)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds per simulate run before it is killed")
    args = parser.parse_args()
    if args.calibrate:
        return calibrate(args.calibrate_clients)
    return scale(args)


if __name__ == "__main__":
    sys.exit(main())
