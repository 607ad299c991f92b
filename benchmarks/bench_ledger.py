"""The site ledger's cost per charge as the ledger grows (dp/ledger.py).

    python benchmarks/bench_ledger.py [--charges 10000] [--source DIR]

Charges one distributed-DP proposal ``--charges`` times into a new ledger (each charge checks
the policy and the budget, appends its record and fsyncs, as on a site) and prints, for the
first and the last 100 charges, the wall time and CPU time per charge and the bytes the
process wrote per charge (``wchar`` of ``/proc/self/io``; elsewhere the file's growth). A
charge that costs the same at 10,000 as at 100 has flat CPU and bytes columns (wall time
includes the disk's fsync). ``--source DIR`` imports ``dp`` from another checkout (e.g.
``git archive main dp | tar -x -C /tmp/before``) to measure it the same way; format 1
rewrote every past charge, so keep ``--charges`` near 300 there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _written(path: Path) -> int:
    """Bytes this process has passed to write calls (Linux), else ``path``'s size."""
    io = Path("/proc/self/io")
    if io.exists():
        for line in io.read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return path.stat().st_size if path.exists() else 0


def measure(charges: int, window: int = 100) -> list[dict[str, float]]:
    from dp.encoding import EncodingParams
    from dp.ledger import Ledger
    from dp.policy import Proposal, SitePolicy

    policy = SitePolicy(modes=("distributed",), min_threshold=2, epsilon=1e9, delta=1e-5)
    params = EncodingParams(dim=20, clip_norm=1.0, scale=4096.0, bits=40, noise_stddev=50.0,
                            rotation_seed=1, threshold=3)
    proposal = Proposal.distributed(params, sample_rate=0.01, secagg_threshold=3)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ledger.json"
        samples: list[tuple[float, float, int]] = []
        with Ledger.open(path, policy) as ledger:
            for n in range(1, charges + 1):
                size = _written(path)
                wall, cpu = time.perf_counter(), time.process_time()
                ledger.charge(proposal)
                samples.append((time.perf_counter() - wall, time.process_time() - cpu,
                                _written(path) - size))
                if n in (window, charges):
                    last = samples[-window:]
                    rows.append({"at": n, "wall_ms": 1e3 * statistics.median(s[0] for s in last),
                                 "cpu_ms": 1e3 * statistics.mean(s[1] for s in last),
                                 "bytes": statistics.mean(s[2] for s in last)})
                    samples.clear()
                elif len(samples) > window:
                    samples.pop(0)
        rows.append({"at": charges, "file_mb": path.stat().st_size / 1e6})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--charges", type=int, default=10_000)
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[1],
                        help="import dp from this checkout (default: this script's)")
    args = parser.parse_args()
    sys.path.insert(0, str(args.source.resolve()))
    import dp

    print(f"dp from {Path(dp.__file__).parent}, {args.charges} charges, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    rows = measure(args.charges)
    print("| charges so far | wall per charge (median) | CPU per charge | bytes written per "
          "charge |")
    print("|---|---|---|---|")
    for row in rows[:-1]:
        print(f"| {row['at']:,} | {row['wall_ms']:.2f} ms | {row['cpu_ms']:.2f} ms "
              f"| {row['bytes']:,.0f} |")
    print(f"ledger file after {args.charges:,} charges: {rows[-1]['file_mb']:.1f} MB")


if __name__ == "__main__":
    main()
