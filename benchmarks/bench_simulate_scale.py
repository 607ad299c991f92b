"""How ``secagg simulate`` scales with the number of clients, and the cost model behind the
round deadlines (``transport.deadlines.round_work``, docs/performance.md "Round deadlines").

Three parts:

* ``--calibrate``: the state machines in this process, no transport. For one round of
  ``--calibrate-clients`` clients it times each stage's client answer per neighbour pair,
  the mask expansion per vector element per pair, and the server's receive + advance per
  pair, in both security modes, and prints them beside the constants ``transport.deadlines``
  uses (measured: seconds; the constants must be at least the idle measurement, and the
  deadlines multiply them by ``transport.deadlines.SAFETY``).
* ``--server-cost``: the server's own cost per client message against n (SecAgg+, k and
  t from ``secagg_plus_parameters(n, 0.1, 0.1)`` unless ``--neighbors``, 10% of the
  clients dropped at seeded random stages, in-process state machines). Per message it
  times what ``transport.server_driver`` does for one: ``Server.receive`` and the
  queries the driver makes after it (``pending_count``, ``is_pending``,
  ``grant_uploads(exclude=gone)``); the clients' work is not timed. Prints process-CPU
  microseconds per message by stage, the stage closes (``advance``), and the log-log
  slope of the per-message cost against n: about 0 when it is O(1) or O(k) per message,
  1 when it grows with n (the O(n^2) round that made 10,000 clients slow).
* the default: the real ``secagg simulate`` command (embedded broker, worker processes,
  server) in a subprocess for each ``--clients`` value, complete graph and, with
  ``--neighbors K``, SecAgg+; prints the wall time, the slowest stage and that stage's
  deadline, and fails (exit 1) if a run did not finish with the correct sum.

    python benchmarks/bench_simulate_scale.py --calibrate
    python benchmarks/bench_simulate_scale.py --clients 100 200 300 500 --dim 1000 [--neighbors 40]
    python benchmarks/bench_simulate_scale.py --server-cost --clients 250 500 1000 2000
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

from secagg import Config, SigningKey, Stage, encode, secagg_plus_parameters  # noqa: E402
from secagg.client import Client  # noqa: E402
from secagg.masked_stream import MaskedStream  # noqa: E402
from secagg.server import Server  # noqa: E402
from secagg.simulate import LocalRound  # noqa: E402
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


def server_round(n: int, dim: int, neighbors: int | None = None, seed: int = 1,
                 drop_rate: float = 0.1) -> dict[str, Any]:
    """One in-process SecAgg+ round of ``n`` clients; returns the server's CPU seconds per
    stage (``receive`` plus the driver's per-message queries, and ``advance``), the
    messages each stage received, and the round's check."""
    if neighbors is None:  # what the docs' runs use
        params = secagg_plus_parameters(n, 0.1, 0.1)
        config = Config(num_clients=n, threshold=params.threshold, dim=dim,
                        neighbors=params.neighbors, dropout_rate=0.1, corrupt_rate=0.1)
    else:  # what `secagg simulate --neighbors K --drop-rate 0.1` uses
        config = Config(num_clients=n, dim=dim, neighbors=neighbors, dropout_rate=drop_rate)
    rng = np.random.default_rng(seed)
    roster = list(range(1, n + 1))
    inputs = {c: rng.integers(0, 1 << 32, size=dim, dtype=np.uint64) for c in roster}
    stages = [Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASKING]
    drops = {int(c): stages[int(rng.integers(0, len(stages)))]
             for c in rng.choice(roster, size=int(n * drop_rate), replace=False)}
    parties = LocalRound.new(config, roster, os.urandom(16))
    server = parties.server
    clients = {c: parties.client(c, inputs[c]) for c in roster}
    gone: dict[int, str] = {}
    receive: dict[str, float] = {}
    advance: dict[str, float] = {}
    messages: dict[str, int] = {}
    outgoing: dict[int, bytes] = {}
    while server.result is None:
        stage = server.stage
        replies: list[tuple[int, bytes]] = []
        for c in roster if stage is Stage.ADVERTISE_KEYS else list(outgoing):
            if drops.get(c, Stage.UNMASKING + 1) <= stage:
                gone[c] = "offline"  # the driver learns it from the sign-off
                continue
            reply = (clients[c].advertise() if stage is Stage.ADVERTISE_KEYS
                     else clients[c].stream(outgoing[c]))
            if isinstance(reply, MaskedStream):
                replies += [(c, encode(chunk)) for chunk in reply.chunks(dim)]
            else:
                replies.append((c, encode(reply)))
        started = time.process_time()
        server.grant_uploads(exclude=gone, chunk_elements=dim)
        for c, raw in replies:  # what ServerDriver does with one client message
            server.receive(c, raw)
            server.is_pending(c)
            if server.pending_count <= len(gone):
                any(p not in gone for p in server.pending)
            server.grant_uploads(exclude=gone, chunk_elements=dim)
        receive[stage.label] = time.process_time() - started
        messages[stage.label] = len(replies)
        started = time.process_time()
        out = server.advance()
        advance[stage.label] = time.process_time() - started
        outgoing = {c: encode(m) for c, m in out.items()}
    result = server.result
    total = np.zeros(dim, dtype=np.uint64)
    for c in result.included:
        total += inputs[c]
    correct = bool(np.array_equal(result.total, (total % (1 << 32)).astype(np.uint32)))
    return {"k": config.neighbors, "t": config.threshold, "receive": receive,
            "advance": advance, "messages": messages, "correct": correct,
            "included": len(result.included)}


def _slope(points: list[tuple[float, float]]) -> float:
    xs, ys = np.log([p[0] for p in points]), np.log([p[1] for p in points])
    return float(np.polyfit(xs, ys, 1)[0])


def server_cost(args: argparse.Namespace) -> int:
    cores = len(os.sched_getaffinity(0))
    print(f"secagg.Server per client message, in-process, d = {args.dim}, SecAgg+, 10% "
          f"dropped at random stages; {cores} cores, load average "
          f"{os.getloadavg()[0]:.2f} at the start; process CPU, clients not timed")
    labels = [Stage.ADVERTISE_KEYS.label, Stage.SHARE_KEYS.label, Stage.MASKED_INPUT.label,
              Stage.UNMASKING.label]
    print(f"{'n':>6} {'k':>4} {'t':>4} " + " ".join(f"{lab + ' us/msg':>20}" for lab in labels)
          + f" {'all us/msg':>10} {'advance s':>9} {'ok':>3}")
    points: list[tuple[float, float]] = []
    per_k: list[tuple[float, float]] = []
    failed = 0
    for n in args.clients:
        got = server_round(n, args.dim, args.neighbors)
        per = {lab: 1e6 * got["receive"][lab] / max(1, got["messages"][lab]) for lab in labels}
        overall = 1e6 * sum(got["receive"].values()) / max(1, sum(got["messages"].values()))
        points.append((n, overall))
        per_k.append((n, overall / got["k"]))
        failed += not got["correct"]
        print(f"{n:>6} {got['k']:>4} {got['t']:>4} "
              + " ".join(f"{per[lab]:>20.1f}" for lab in labels)
              + f" {overall:>10.1f} {sum(got['advance'].values()):>9.2f}"
              f" {'yes' if got['correct'] else 'NO':>3}", flush=True)
    if len(points) > 1:
        print(f"log-log slope of us per message against n: {_slope(points):.2f}; of us per "
              f"message per neighbour: {_slope(per_k):.2f} (0: constant per message, or per "
              f"neighbour; 1: linear in n per message, quadratic per round)")
    return 1 if failed else 0


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
    parser.add_argument("--server-cost", action="store_true",
                        help="the server's CPU per client message against --clients "
                             "(in-process, SecAgg+)")
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
    if args.server_cost:
        return server_cost(args)
    return scale(args)


if __name__ == "__main__":
    sys.exit(main())
