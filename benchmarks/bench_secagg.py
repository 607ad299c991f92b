"""Protocol-core benchmarks against the targets of docs/architecture.md section 7.

Every figure is printed with its ratio to the floor measured in the same run
(benchmarks/_floor.py). Run by hand:

    python benchmarks/bench_secagg.py            # everything (about 3 minutes on 2 cores)
    python benchmarks/bench_secagg.py --quick    # skips the n = 500 round
    python benchmarks/bench_secagg.py --json     # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _floor import floor_seconds, keystream_seconds

from secagg import (
    Client,
    Config,
    Server,
    Stage,
    encode,
    secagg_plus_parameters,
    shamir,
    simulate,
)
from secagg.messages import Ciphertexts

RESULTS: dict[str, Any] = {}


def report(name: str, seconds: float, floor: float | None, target: str, **extra: Any) -> None:
    ratio = seconds / floor if floor else None
    RESULTS[name] = {"seconds": seconds, "floor_seconds": floor, "ratio": ratio,
                     "target": target, **extra}
    ratio_txt = f"{ratio:6.2f}x floor" if ratio is not None else " " * 13
    print(f"{name:<44} {seconds * 1e3:10.1f} ms  {ratio_txt}   target: {target}",
          file=sys.stderr)


class Round:
    """Drives real clients and a real server, timing each side separately."""

    def __init__(self, config: Config, drop: dict[int, Stage], executor: Any = None,
                 seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.config = config
        self.context = os.urandom(16)
        self.inputs = {i: rng.integers(0, 2 ** config.bits, config.dim, dtype=np.uint64)
                       for i in range(1, config.num_clients + 1)}
        self.drop = drop
        self.server = Server(config, context=self.context, executor=executor)
        self.clients = {i: Client(config, i, v, context=self.context)
                        for i, v in self.inputs.items()}
        self.server_seconds: dict[str, float] = {}
        self._cleared = False
        self.client_seconds: dict[int, float] = {i: 0.0 for i in self.clients}

    cold_client: int | None = None  # its first message is handled with empty Shamir caches

    def _client(self, cid: int, fn: Any) -> Any:
        if cid == self.cold_client and self.client_seconds[cid] > 0 and not self._cleared:
            shamir._limb_power_table.cache_clear()
            shamir.lagrange_weights.cache_clear()
            self._cleared = True
        start = time.perf_counter()
        out = fn()
        self.client_seconds[cid] += time.perf_counter() - start
        return out

    def run(self) -> None:
        stages = [Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASKING]
        outgoing: dict[int, bytes] = {}
        for stage in stages:
            replies = {}
            for cid, client in self.clients.items():
                if self.drop.get(cid, Stage.UNMASKING + 1) <= stage:
                    continue
                if stage is Stage.ADVERTISE_KEYS:
                    replies[cid] = self._client(cid, lambda c=client: encode(c.advertise()))
                elif cid in outgoing:
                    data = outgoing[cid]
                    replies[cid] = self._client(
                        cid, lambda c=client, d=data: encode(c.handle(d)))
            start = time.perf_counter()
            for cid, data in replies.items():
                self.server.receive(cid, data)
            messages = self.server.advance()
            outgoing = {cid: encode(m) for cid, m in messages.items()}
            self.server_seconds[stage.label] = time.perf_counter() - start
        result = self.server.result
        assert result is not None
        expected = np.zeros(self.config.dim, dtype=np.uint64)
        for cid in result.included:
            expected += self.inputs[cid]
        expected &= np.uint64(self.config.modulus - 1)
        assert np.array_equal(result.total, expected), "wrong aggregate"


def bench_shamir() -> None:
    holders = list(range(1, 201))
    secret = os.urandom(32)
    shamir._limb_power_table.cache_clear()
    shamir.lagrange_weights.cache_clear()
    start = time.perf_counter()
    shamir.split(secret, holders, 101)
    cold = time.perf_counter() - start
    runs = 200
    start = time.perf_counter()
    for _ in range(runs):
        shamir.split(os.urandom(32), holders, 101)
    warm = (time.perf_counter() - start) / runs
    report("shamir split, 200 holders, t=101 (warm)", warm, None, "< 3 ms",
           cold_seconds=cold)
    print(f"{'  (first split, tables cold)':<44} {cold * 1e3:10.1f} ms", file=sys.stderr)


def bench_client_masking(dim: int = 1_000_000, neighbours: int = 50) -> None:
    """One client with 50 neighbours masks a 10^6 vector (SecAgg+ closed neighbourhood 51)."""
    n = neighbours + 1
    config = Config(num_clients=n, dim=dim, bits=32, threshold=n // 2 + 1)
    ctx = os.urandom(16)
    rng = np.random.default_rng(1)
    server = Server(config, context=ctx)
    clients = {i: Client(config, i, rng.integers(0, 2 ** 32, dim, dtype=np.uint64),
                         context=ctx) for i in range(1, n + 1)}
    for cid, c in clients.items():
        server.receive(cid, encode(c.advertise()))
    for cid, msg in server.advance().items():
        server.receive(cid, encode(clients[cid].handle(encode(msg))))
    forwarded = server.advance()
    times = []
    for cid in (1, 2, 3):  # three clients, each masking once: report the best
        message = forwarded[cid]
        assert isinstance(message, Ciphertexts)
        start = time.perf_counter()
        clients[cid].handle(message)
        times.append(time.perf_counter() - start)
    floor = floor_seconds(keystreams=neighbours + 1, dim=dim, exchanges=neighbours)
    report(f"client masking, d=10^6, k={neighbours}", min(times), floor, "<= 1.5x floor",
           all_seconds=times)


def bench_server_unmasking(n: int = 50, dim: int = 100_000, drop_rate: float = 0.2) -> None:
    config = Config(num_clients=n, dim=dim, bits=32)
    dropped = int(n * drop_rate)
    drop = {i: Stage.MASKED_INPUT for i in range(1, dropped + 1)}
    survivors = n - dropped
    floor = floor_seconds(keystreams=survivors + dropped * survivors, dim=dim,
                          exchanges=dropped * survivors)
    times = []
    for seed in range(3):
        rnd = Round(config, drop, seed=seed)
        rnd.run()
        times.append(rnd.server_seconds["unmasking"])
    report(f"server unmasking, n={n}, d=10^5, {int(drop_rate * 100)}% dropped",
           min(times), floor, "<= 2x floor", all_seconds=times)
    with ProcessPoolExecutor(2) as pool:
        pool.submit(int).result()  # start the workers before timing
        times = []
        for seed in range(3):
            rnd = Round(config, drop, executor=pool, seed=seed)
            rnd.run()
            times.append(rnd.server_seconds["unmasking"])
        report("  same, 2 worker processes", min(times), floor, "<= 2x floor",
               all_seconds=times)


def bench_n500(dim: int = 100_000, drop_rate: float = 0.3) -> None:
    n = 500
    config = Config(num_clients=n, dim=dim, bits=32)
    dropped = int(n * drop_rate)
    drop = {i: Stage.MASKED_INPUT for i in range(1, dropped + 1)}
    with ProcessPoolExecutor(2) as pool:
        pool.submit(int).result()
        rnd = Round(config, drop, executor=pool)
        rnd.cold_client = n  # the last survivor: every table it needs is built afresh
        rnd.run()
    server_total = sum(rnd.server_seconds.values())
    survivors = n - dropped
    floor = floor_seconds(keystreams=survivors + dropped * survivors, dim=dim,
                          exchanges=dropped * survivors)
    report("server, n=500, d=10^5, 30% dropped (total)", server_total, floor, "< 5 s",
           stages=rnd.server_seconds)
    per_client = sorted(rnd.client_seconds[i] for i in range(dropped + 1, n))
    first = rnd.client_seconds[n]
    client_floor = floor_seconds(keystreams=n, dim=dim, exchanges=2 * (n - 1))
    report("client, n=500, d=10^5 (median survivor, warm)", per_client[len(per_client) // 2],
           client_floor, "< 150 ms", first_client_seconds=first)
    print(f"{'  (a client whose Shamir tables are cold)':<44} {first * 1e3:10.1f} ms",
          file=sys.stderr)


def bench_secagg_plus_scaling(sizes: list[int], dim: int = 1000) -> None:
    rows = []
    for n in sizes:
        params = secagg_plus_parameters(n, dropout_rate=0.1, corrupt_rate=0.1)
        config = Config(num_clients=n, dim=dim, bits=32, neighbors=params.neighbors,
                        threshold=params.threshold, dropout_rate=0.1, corrupt_rate=0.1)
        drop = {i: Stage.MASKED_INPUT for i in range(1, n // 10 + 1)}
        rnd = Round(config, drop)
        rnd.run()
        seconds = sum(rnd.server_seconds.values())
        rows.append((n, params.neighbors, params.threshold, seconds))
        print(f"  SecAgg+ n={n:>6} k={params.neighbors} t={params.threshold}: server "
              f"{seconds:8.3f} s, per n log n {seconds / (n * math.log(n)) * 1e6:7.2f} us",
              file=sys.stderr)
    ns = np.log([r[0] for r in rows])
    ts = np.log([r[3] for r in rows])
    slope = float(np.polyfit(ns, ts, 1)[0])
    RESULTS["secagg_plus_scaling"] = {
        "rows": [{"n": n, "neighbors": k, "threshold": t, "server_seconds": s}
                 for n, k, t, s in rows],
        "log_log_slope": slope, "target": "grows as n log n (slope ~1.1), not n^2 (slope 2)"}
    print(f"{'SecAgg+ server cost log-log slope':<44} {slope:10.2f}      target: ~1 "
          "(n log n), not 2", file=sys.stderr)


def bench_simulate(n: int = 10, dim: int = 1_000_000, repeat: int = 3) -> None:
    """The whole reference driver, ``secagg.simulate``, every message through the codec.
    Floor: each client expands its self mask and n - 1 pairwise masks and does 2(n - 1)
    X25519 exchanges (share keys and masks); the server expands the n self masks."""
    config = Config(num_clients=n, dim=dim, bits=32)
    rng = np.random.default_rng(0)
    inputs = {i: rng.integers(0, 2**32, dim, dtype=np.uint64) for i in range(1, n + 1)}
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        result = simulate(config, inputs, seed=0)
        best = min(best, time.perf_counter() - start)
        assert result.included == frozenset(inputs)
    floor = floor_seconds(n * n + n, dim, 2 * n * (n - 1))
    report(f"simulate(), n = {n}, d = {dim:.0e}", best, floor, "at most 2.5x the floor")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="skip the n=500 round")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--markdown", metavar="PATH",
                        help="also write the results as a markdown table (docs/performance.md)")
    parser.add_argument("--max-n", type=int, default=1600,
                        help="largest n of the SecAgg+ scaling run (default 1600)")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    RESULTS["load_average"] = load
    print(f"load average {load:.2f} on {os.cpu_count()} cores (ratios are measured in this "
          "run, so they survive some load; absolute times do not)", file=sys.stderr)
    RESULTS["keystream_gb_per_s"] = 200 * 400_000 / keystream_seconds(200, 100_000) / 1e9
    bench_shamir()
    bench_simulate()
    bench_client_masking()
    bench_server_unmasking()
    if not args.quick:
        bench_n500()
    sizes = [n for n in (100, 200, 400, 800, 1600, 3200, 6400, 10_000) if n <= args.max_n]
    bench_secagg_plus_scaling(sizes)
    if args.json:
        print(json.dumps(RESULTS, indent=2, default=float))
    if args.markdown:
        write_markdown(args.markdown, " ".join(sys.argv[1:]))
    return 0


def write_markdown(path: str, argv: str) -> None:
    lines = [
        "# Performance of the protocol core",
        "",
        f"Generated by `python benchmarks/bench_secagg.py {argv}` on "
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, load average "
        f"{RESULTS['load_average']:.2f} at the start. The floor is measured in the same run: "
        "AES-128-CTR keystream into a preallocated buffer (one cipher per mask key), the "
        "uint additions and one X25519 exchange per pair (benchmarks/_floor.py).",
        "",
        "| benchmark | measured | floor | ratio | target |",
        "|---|---:|---:|---:|---|",
    ]
    for name, row in RESULTS.items():
        if not isinstance(row, dict) or "seconds" not in row:
            continue
        floor = row.get("floor_seconds")
        ratio = row.get("ratio")
        lines.append(
            f"| {name.strip()} | {row['seconds'] * 1e3:.1f} ms | "
            f"{'' if floor is None else f'{floor * 1e3:.1f} ms'} | "
            f"{'' if ratio is None else f'{ratio:.2f}x'} | {row['target']} |")
        labels = {"cold_seconds": "the first split (tables cold)",
                  "first_client_seconds": "a client whose Shamir tables are cold"}
        for extra, label in labels.items():
            if extra in row:
                lines.append(f"| {label} | {row[extra] * 1e3:.1f} ms | | | |")
    server = RESULTS.get("server, n=500, d=10^5, 30% dropped (total)")
    if server:
        stages = server.get("stages", {})
        other = sum(v for k, v in stages.items() if k != "unmasking")
        lines += [
            "", "## Reading the n = 500 server figure", "",
            f"The server removes one pairwise mask per (dropped, survivor) pair: 150 x 350 = "
            f"52,500 X25519 exchanges and AES-CTR expansions of 400 KB, plus 350 self masks. "
            f"Their floor, measured above on one core, is {server['floor_seconds']:.2f} s; "
            f"the server spreads them over two worker processes "
            f"(`Server(executor=ProcessPoolExecutor(2))`), so it runs below the one-core "
            f"floor. Even a perfect two-core split costs floor / 2 = "
            f"{server['floor_seconds'] / 2:.2f} s, and the other stages (key lists, share "
            f"forwarding, summing the masked inputs) took {other:.2f} s here, so on this "
            f"machine the 5 s target sits at the physical limit: AES-CTR keystream plus "
            f"the add runs at {RESULTS.get('keystream_gb_per_s', 0):.1f} GB/s here (400 KB "
            f"per key), below the 9 GB/s docs/architecture.md quotes. Stage times: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in stages.items()) + "."]
    scaling = RESULTS.get("secagg_plus_scaling")
    if scaling:
        lines += ["", "## SecAgg+ server cost against n (d = 1000, 10% dropped after "
                  "share_keys, (k, t) from `secagg_plus_parameters(n, 0.1, 0.1)`)", "",
                  "| n | k | t | server seconds | us per n log n |", "|---:|---:|---:|---:|---:|"]
        for row in scaling["rows"]:
            per = row["server_seconds"] / (row["n"] * math.log(row["n"])) * 1e6
            lines.append(f"| {row['n']} | {row['neighbors']} | {row['threshold']} | "
                         f"{row['server_seconds']:.3f} | {per:.1f} |")
        lines += ["", f"log-log slope: {scaling['log_log_slope']:.2f} (n log n is about 1.1 "
                  "over this range; a complete graph would be 2)."]
    lines += _other_sections(path, {line for line in lines if line.startswith("## ")})
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")


def _other_sections(path: str, ours: set[str]) -> list[str]:
    """The ``## `` sections of the existing file that this benchmark does not write (other
    benchmarks' sections, e.g. bench_simulate_scale.py's), kept as they are."""
    try:
        with open(path, encoding="utf-8") as fh:
            old = fh.read().splitlines()
    except FileNotFoundError:
        return []
    kept: list[str] = []
    keep = False
    for line in old:
        if line.startswith("## "):
            keep = line not in ours and not line.startswith(
                ("## Reading the n = 500", "## SecAgg+ server cost against n"))
            if keep:
                kept.append("")
        if keep:
            kept.append(line)
    while kept and not kept[-1]:
        kept.pop()
    return kept


if __name__ == "__main__":
    sys.exit(main())
