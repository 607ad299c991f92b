"""Input validation (docs/protocol.md section 10): what the L2 norm proof costs a site and
the server, against the same round without validation, measured in one run.

Per dimension d: the one-time generator setup (hash-to-curve, cached per process), a
site's proof, the server's verification of one proof, the server's sum check per round,
the proof's bytes against the masked input's, and (``--round-dims``) a whole ``simulate``
round of ``--sites`` sites with and without ``norm_bound`` (the ratio). d = 10^6 is not run
(about 10 minutes of proving per site here); it is extrapolated linearly from the largest
measured d, and the table says so. ACORN's published client cost (Bell et al., USENIX
Security 2023: 16-bit dense vectors of 250K entries in under 80 s, i.e. 320 us per entry)
is the per-coordinate reference.

    python benchmarks/bench_validation.py                      # d = 10^3, 10^4, 10^5
    python benchmarks/bench_validation.py --dims 1000 10000 --round-dims 10000
    python benchmarks/bench_validation.py --write-docs         # docs/performance.md table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from secagg import Config, simulate
from secagg.crypto import dtype_for_bits
from secagg.validation import NormStatement, proof_size, prove, verify
from secagg.validation import norm as _norm

ACORN_US_PER_ENTRY = 80.0 / 250_000 * 1e6
"""ACORN's client computation per entry (16-bit dense, 250K entries, < 80 s)."""
BITS = 32
REPO = Path(__file__).resolve().parent.parent
MARK_BEGIN, MARK_END = "<!-- bench_validation:begin -->", "<!-- bench_validation:end -->"


def inputs_within(n: int, dim: int, bound: int, seed: int = 0) -> dict[int, np.ndarray]:
    """n random encoded vectors of L2 norm at most ``bound`` (centred mod 2^BITS)."""
    rng = np.random.default_rng(seed)
    out = {}
    for cid in range(1, n + 1):
        v = rng.normal(size=dim)
        v *= 0.9 * bound / np.linalg.norm(v)
        out[cid] = (np.trunc(v).astype(np.int64) % (1 << BITS)).astype(dtype_for_bits(BITS))
    return out


def _timed(fn: Any, repeat: int) -> tuple[float, Any]:
    times, value = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), value


def bench_site(dim: int, sites: int, repeat: int = 1) -> dict[str, Any]:
    """One site's proof and the server's checks at ``dim``."""
    bound = (1 << (BITS - 2)) // sites  # the largest bound that cannot wrap the sum
    x = inputs_within(1, dim, bound)[1]
    start = time.perf_counter()
    _norm._generators(dim)  # one-time per process (hash-to-curve)
    setup = time.perf_counter() - start
    statement = NormStatement(os.urandom(32), 1, dim, BITS, bound, os.urandom(32))
    prove_s, proof = _timed(lambda: prove(statement, x, 12345), repeat)
    verify_s, commitment = _timed(lambda: verify(statement, proof), repeat)
    commitments = [commitment] * sites
    total = (x.astype(np.uint64) * sites) % (1 << BITS)
    check_s, ok = _timed(lambda: _norm.check_sum(commitments, total, BITS, 12345 * sites),
                         repeat)
    assert ok
    masked = dim * dtype_for_bits(BITS).itemsize
    return {"dim": dim, "bound": bound, "setup_s": setup, "prove_s": prove_s,
            "verify_s": verify_s, "sum_check_s": check_s,
            "proof_bytes": proof_size(dim), "masked_bytes": masked,
            "upload_ratio": (masked + proof_size(dim)) / masked,
            "prove_us_per_coord": prove_s / dim * 1e6,
            "verify_us_per_coord": verify_s / dim * 1e6}


def bench_round(dim: int, sites: int) -> dict[str, Any]:
    """A whole in-process round with and without the bound (the same inputs and seed)."""
    bound = (1 << (BITS - 2)) // sites
    inputs = inputs_within(sites, dim, bound)
    _norm._generators(dim)  # setup is per process, not per round: taken out of the ratio
    plain_s, plain = _timed(lambda: simulate(Config(sites, dim=dim, bits=BITS), inputs,
                                             seed=1), 1)
    checked_s, checked = _timed(lambda: simulate(
        Config(sites, dim=dim, bits=BITS, norm_bound=bound), inputs, seed=1), 1)
    assert np.array_equal(plain.total, checked.total) and not checked.refused
    return {"dim": dim, "sites": sites, "plain_s": plain_s, "validated_s": checked_s,
            "ratio": checked_s / plain_s,
            "plain_upload": plain.bytes_sent[1]["masked_input"],
            "validated_upload": checked.bytes_sent[1]["masked_input"]}


def extrapolate(row: dict[str, Any], dim: int) -> dict[str, Any]:
    """Linear in d from a measured row (MSM and projections are linear; Pippenger's is
    slightly sublinear, so this errs high)."""
    f = dim / row["dim"]
    return {**row, "dim": dim, "extrapolated": True,
            **{k: row[k] * f for k in ("setup_s", "prove_s", "verify_s", "sum_check_s")},
            "proof_bytes": proof_size(dim),
            "masked_bytes": dim * dtype_for_bits(BITS).itemsize,
            "upload_ratio": (dim * 4 + proof_size(dim)) / (dim * 4)}


def markdown(rows: list[dict[str, Any]], rounds: list[dict[str, Any]], sites: int) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [MARK_BEGIN, "",
             f"`python benchmarks/bench_validation.py`: bits = {BITS}, bound = "
             f"2^{BITS - 2} / {sites}; load average {load:.1f} on {os.cpu_count()} cores "
             f"when the table was written (a shared machine: both sides of each ratio come "
             f"from the same run).", "",
             "| d | setup (once per process) | prove, per site | verify, per site | sum check, "
             "per round | proof | upload vs masked input | prove per coordinate | "
             "vs ACORN's 320 us |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tag = " (extrapolated)" if r.get("extrapolated") else ""
        lines.append(
            f"| {r['dim']:,}{tag} | {r['setup_s']:.1f} s | {r['prove_s']:.2f} s | "
            f"{r['verify_s']:.2f} s | {r['sum_check_s']:.2f} s | "
            f"{r['proof_bytes'] / 1024:,.0f} KiB | {r['upload_ratio']:.1f}x | "
            f"{r['prove_s'] / r['dim'] * 1e6:.0f} us | "
            f"{r['prove_s'] / r['dim'] * 1e6 / ACORN_US_PER_ENTRY:.2f}x |")
    if rounds:
        lines += ["", f"A whole in-process round (`simulate`, {sites} sites, the same inputs): "
                      "with validation against without.", "",
                  "| d | without | with `norm_bound` | ratio | bytes a site sends in "
                  "masked_input |", "|---|---|---|---|---|"]
        for r in rounds:
            lines.append(f"| {r['dim']:,} | {r['plain_s']:.2f} s | {r['validated_s']:.2f} s | "
                         f"{r['ratio']:.1f}x | {r['plain_upload']:,} -> "
                         f"{r['validated_upload']:,} |")
    lines += ["", MARK_END]
    return "\n".join(lines)


def write_docs(text: str, path: Path = REPO / "docs" / "performance.md") -> None:
    doc = path.read_text(encoding="utf-8")
    start, end = doc.index(MARK_BEGIN), doc.index(MARK_END) + len(MARK_END)
    path.write_text(doc[:start] + text + doc[end:], encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--round-dims", type=int, nargs="*", default=[1000, 10_000])
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--extrapolate", type=int, default=1_000_000)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for dim in args.dims:
        row = bench_site(dim, args.sites)
        rows.append(row)
        print(f"d={dim}: prove {row['prove_s']:.2f} s, verify {row['verify_s']:.2f} s, "
              f"sum check {row['sum_check_s']:.2f} s, setup {row['setup_s']:.1f} s",
              file=sys.stderr)
    if args.extrapolate and args.extrapolate > max(args.dims):
        rows.append(extrapolate(rows[-1], args.extrapolate))
    rounds = []
    for dim in args.round_dims:
        rounds.append(bench_round(dim, args.sites))
        print(f"round d={dim}: {rounds[-1]['ratio']:.1f}x", file=sys.stderr)
    text = markdown(rows, rounds, args.sites)
    if args.json:
        print(json.dumps({"sites": rows, "rounds": rounds}))
    else:
        print(text)
    if args.write_docs:
        write_docs(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
