"""Model-sized updates (issue 21): ``secagg simulate`` at d = 10^7 and 10^8 over the
embedded broker and Mosquitto, SecAgg+ at 20 clients, and the in-process
``secagg.simulate()`` at 10^8, each against the floor measured in the same run.

For every row: the round's seconds (the server's ``total``: round start to result) and
its ratio to the floor (AES-128-CTR keystream for every mask of every client, plus two
localhost socket copies of every masked input: client -> broker -> server; benchmarks/
_floor.py), the peak RSS of the largest process of the run (the command's own process,
its broker process and its worker processes: ``getrusage(RUSAGE_CHILDREN)`` of a wrapper
that runs only that command), the bytes each client put on the wire against d x bits / 8,
the payloads the server dropped (full buffers, bad frames: must be 0) and whether the sum
was checked correct; the command's CPU seconds, every process it started (broker, fork
server, workers) and their start-up included (the wrapper is a subreaper, so it reaps and
counts them all). Row ``10x1e3`` is the same command with next to no data: its CPU is the
command's fixed cost (interpreters, imports, key agreement, logins), which the data rows'
CPU minus it leaves as the cost of the data. Modules run from bytecode compiled once, as an
installed package's (``bytecode_env``). Each row runs in a fresh process, one at a time;
the 10^8 rows are meant to be run under ``nice``.

    nice python benchmarks/bench_model_size.py                       # every row
    nice python benchmarks/bench_model_size.py --rows 5x1e8 --source /tmp/before  # old code
    nice python benchmarks/bench_model_size.py --write-docs          # into docs/performance.md
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _floor import scaled_keystream_seconds, socket_copy_seconds  # noqa: E402

BITS = 32


@dataclass(frozen=True)
class Row:
    name: str
    clients: int
    dim: int
    neighbors: int | None = None
    broker: str = "embedded"
    inprocess: bool = False

    @property
    def label(self) -> str:
        if self.inprocess:
            return "in-process `simulate()`"
        graph = f"SecAgg+ k={self.neighbors}" if self.neighbors else "complete"
        return f"`secagg simulate`, {self.broker}, {graph}"

    @property
    def masks_per_client(self) -> int:
        peers = self.neighbors if self.neighbors else self.clients - 1
        return 1 + peers


ROWS = {row.name: row for row in (
    Row("10x1e3", 10, 10**3),  # the same command with next to no data: its fixed cost
    Row("10x1e6", 10, 10**6),
    Row("5x1e7", 5, 10**7),
    Row("10x1e7", 10, 10**7),
    Row("plus20x1e7", 20, 10**7, neighbors=10),
    Row("5x1e8", 5, 10**8),
    Row("10x1e8", 10, 10**8),
    Row("mosquitto5x1e8", 5, 10**8, broker="mosquitto"),
    Row("inprocess5x1e8", 5, 10**8, inprocess=True),
)}

_WRAPPER = """
import ctypes, json, os, resource, subprocess, sys
# A subreaper: every process the command starts (its broker, its fork server and the
# workers forked from it) is reaped here once it ends, however it was started, so that
# RUSAGE_CHILDREN counts the CPU of all of them, not only of those the command waited for.
subreaper = ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
while subreaper:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        break
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": rc, "max_rss": usage.ru_maxrss * 1024, "subreaper": subreaper,
                  "cpu": usage.ru_utime + usage.ru_stime}))
"""

_INPROCESS = """
import json, resource, sys, time
import numpy as np
from secagg import Config, simulate
n, dim, bits = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
config = Config(num_clients=n, dim=dim, bits=bits)
inputs = {c: np.random.default_rng([1, c]).integers(0, 1 << bits, dim, dtype=np.uint32)
          for c in range(1, n + 1)}
result = simulate(config, inputs, seed=1)
expected = np.zeros(dim, dtype=np.uint32)
for c in sorted(result.included):
    np.add(expected, inputs[c], out=expected)
sent = {c: sum(s.values()) for c, s in result.bytes_sent.items()}
print(json.dumps({"seconds": result.seconds["total"], "correct": bool(
    np.array_equal(expected, result.total)), "wire": max(sent.values()),
    "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "dropped_payloads": 0, "included": len(result.included)}))
"""


def bytecode_env(source: Path, cache: Path) -> dict[str, str]:
    """The environment the rows run in: ``source`` on the path and its modules' bytecode
    compiled once into ``cache``, as an installed package's are (pip compiles them), even
    where ``PYTHONDONTWRITEBYTECODE`` is set (then every process of the command would
    compile every module it imports from source: 0.1-0.2 CPU s each here)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=str(source), PYTHONPYCACHEPREFIX=str(cache),
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    packages = [str(source / p) for p in ("secagg", "transport", "dp", "fl")
                if (source / p).is_dir()]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *packages], env=env,
                   stdout=subprocess.DEVNULL, check=True)
    return env


_ENV: dict[Path, dict[str, str]] = {}


def run_row(row: Row, source: Path) -> dict[str, Any]:
    if source not in _ENV:
        cache = tempfile.mkdtemp(prefix="bench-pyc-")
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
        _ENV[source] = bytecode_env(source, Path(cache))
    env = _ENV[source]
    started = time.perf_counter()
    if row.inprocess:
        out = subprocess.run([sys.executable, "-c", _INPROCESS, str(row.clients),
                              str(row.dim), str(BITS)], env=env, cwd=source,
                             capture_output=True, text=True, check=False)
        if out.returncode:
            return {"error": out.stderr.strip().splitlines()[-1:], "wall": 0.0}
        got = json.loads(out.stdout.strip().splitlines()[-1])
        got["wall"] = time.perf_counter() - started
        return got
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "fl.cli", "simulate", "--clients", str(row.clients),
                   "--dim", str(row.dim), "--bits", str(BITS), "--drop-rate", "0",
                   "--seed", "1", "--broker", row.broker, "--report", str(report_path)]
        if row.neighbors:
            command += ["--neighbors", str(row.neighbors)]
        out = subprocess.run([sys.executable, "-c", _WRAPPER, *command], env=env, cwd=source,
                             capture_output=True, text=True, check=False)
        wrapper = json.loads(out.stdout.strip().splitlines()[-1])
        if not report_path.exists():
            return {"error": out.stderr.strip().splitlines()[-3:], "wall": 0.0,
                    "max_rss": wrapper["max_rss"]}
        report = json.loads(report_path.read_text())
    transport = report.get("transport", {})
    return {"seconds": report["seconds"].get("total", float("nan")),
            "masked_input": report["seconds"].get("masked_input", float("nan")),
            "correct": report["correct"], "included": len(report["included"]),
            "error": report.get("error"),
            "wire": max(report.get("wire_bytes", {"": 0}).values()),
            "dropped_payloads": transport.get("invalid_payloads", 0),
            "republished": transport.get("republished", 0),
            "max_rss": wrapper["max_rss"], "cpu": wrapper["cpu"],
            "wall": time.perf_counter() - started}


def floor(row: Row) -> float:
    vector = row.dim * BITS // 8
    keystreams = scaled_keystream_seconds(row.clients * row.masks_per_client, row.dim,
                                          BITS // 8)
    copies = 0.0 if row.inprocess else 2 * socket_copy_seconds(row.clients * vector)
    return keystreams + copies


def table(results: list[tuple[Row, dict[str, Any], float]], source: Path,
          notes: list[str] | None = None) -> str:
    code = "this checkout" if source == REPO else f"`{source}`"
    lines = [f"Code: {code}; 32 bits, no dropouts, seed 1.", *(notes or []), "",
             "| run | clients | d | round s | floor s | ratio | command CPU s "
             "| peak RSS, largest process "
             "| wire bytes per client / (d x 4) | dropped payloads | correct |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row, got, floor_s in results:
        if got.get("error") and "seconds" not in got:
            rss = f"{got.get('max_rss', 0) / 2**30:.2f} GiB" if got.get("max_rss") else "-"
            lines.append(f"| {row.label} | {row.clients} | {row.dim:.0e} | failed: "
                         f"{' '.join(got['error'])[:120]} | {floor_s:.2f} | - | - | {rss} | - "
                         "| - | no |")
            continue
        seconds = got["seconds"]
        lines.append(
            f"| {row.label} | {row.clients} | {row.dim:.0e} | {seconds:.2f} | {floor_s:.2f} "
            f"| {seconds / floor_s:.1f}x | {got.get('cpu', float('nan')):.2f} "
            f"| {got['max_rss'] / 2**30:.2f} GiB "
            f"| {got['wire'] / (row.dim * BITS / 8):.4f} | {got['dropped_payloads']} "
            f"| {'yes' if got['correct'] else 'NO'}"
            + ("" if got.get("included", row.clients) == row.clients
               else f" ({got['included']}/{row.clients} included)") + " |")
    return "\n".join(lines)


def run_repeated(row: Row, source: Path, repeat: int) -> tuple[dict[str, Any], float, str]:
    """``repeat`` runs of ``row``, each against the floor measured right after it: the run
    whose ratio is the median, its floor, and a note with every ratio and the load."""
    runs = []
    load_before = os.getloadavg()[0]
    for _ in range(repeat):
        got = run_row(row, source)
        runs.append((got, floor(row)))
        print(f"{row.name}: {json.dumps(got)}", file=sys.stderr, flush=True)
    ratios = [g.get("seconds", float("inf")) / f for g, f in runs]
    median = sorted(range(repeat), key=ratios.__getitem__)[repeat // 2]
    cpu = sorted(g.get("cpu", float("nan")) for g, _ in runs)
    note = (f"{row.name}: the median of {repeat} runs (ratios "
            + ", ".join(f"{r:.1f}x" for r in ratios)
            + f"); load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; "
            f"CPU seconds of the whole command, every process, start-up included (less "
            f"sensitive to the load than the round's wall time): median {cpu[repeat // 2]:.2f}"
            f" (" + ", ".join(f"{c:.2f}" for c in cpu) + ").")
    return runs[median][0], runs[median][1], note


def write_docs(text: str, command: str, block: str) -> None:
    """Put ``text`` (printed by ``command``) into docs/performance.md's "Model-sized
    updates" section, as its ``block`` (``current`` or ``before``: a run of older code)."""
    path = REPO / "docs" / "performance.md"
    doc = path.read_text(encoding="utf-8")
    head = "## Model-sized updates"
    if head not in doc:
        doc = doc.rstrip("\n") + (
            f"\n\n{head}\n\nMasked inputs stream chunk by chunk end to end "
            "(docs/protocol.md 6.3, docs/deployment.md 6.1). The floor is AES-128-CTR "
            "keystream for every mask of every client plus two localhost socket copies of "
            "every masked input (client -> broker -> server), measured in the same run "
            "(benchmarks/_floor.py); peak RSS is the largest process of the run (the "
            "command, its broker, its workers).\n\n"
            "<!-- bench_model_size:current -->\n<!-- /bench_model_size:current -->\n\n"
            "<!-- bench_model_size:before -->\n<!-- /bench_model_size:before -->\n")
    start_tag, end_tag = f"<!-- bench_model_size:{block} -->", f"<!-- /bench_model_size:{block} -->"
    if start_tag not in doc or end_tag not in doc:
        raise SystemExit(f"docs/performance.md has no {start_tag} ... {end_tag} block; add "
                         "it where the table belongs")
    start, end = doc.index(start_tag) + len(start_tag), doc.index(end_tag)
    title = "Before (main at 43626a8)" if block == "before" else (
        "Before" if block.endswith("before") else "Now")
    doc = (doc[:start] + f"\n{title}: `{command}`\n\n{text}\n" + doc[end:])
    path.write_text(doc, encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS))
    parser.add_argument("--source", type=Path, default=REPO,
                        help="the checkout whose code runs (e.g. an older commit)")
    parser.add_argument("--write-docs", action="store_true",
                        help="write the table into docs/performance.md")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run each row N times and report the run of median ratio, "
                             "with every ratio and the load average (a shared machine)")
    parser.add_argument("--block", metavar="NAME",
                        help="the docs block --write-docs fills (default: current, or "
                             "before for --source); another block must exist as "
                             "<!-- bench_model_size:NAME --> (titled Before if NAME ends "
                             "with 'before')")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat: need at least 1 run")
    results, notes = [], []
    for name in args.rows:
        got, floor_s, note = run_repeated(ROWS[name], args.source.resolve(), args.repeat)
        results.append((ROWS[name], got, floor_s))
        if args.repeat > 1:
            notes.append(note)
    text = table(results, args.source.resolve(), notes)
    print(json.dumps([{"row": r.name, **g, "floor": f} for r, g, f in results])
          if args.json else text)
    if args.write_docs:
        block = args.block or ("current" if args.source.resolve() == REPO else "before")
        write_docs(text, " ".join(["nice python benchmarks/bench_model_size.py",
                                   *(a for a in sys.argv[1:] if a != "--write-docs")]),
                   block)
    failed = any(not g.get("correct") or g.get("dropped_payloads") for _, g, _ in results)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
