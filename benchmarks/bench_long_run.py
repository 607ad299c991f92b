"""A long federation in one process: RSS of the training process every 100 rounds.

    python benchmarks/bench_long_run.py [--rounds 2000] [--every 100] [--broker memory]
                                        [--checkpoint DIR] [--json]

Why: a federation runs for thousands of rounds; what the coordinator keeps per round must
not add up (issue 23 measured +25 KB per round: 339 MB at round 184, 385 MB at round 1,983).
``secagg train --role all`` (``fl.federation.train``) runs here with three sites and the
logistic model on the breast-cancer table, fast rounds, and the resident set size (from
/proc/self/statm, else the peak from ``resource``) is read at every ``--every``-th round.
The growth per round is the least-squares slope over the second half of the samples (the
first rounds warm caches and allocators up). Not a timed test: the smoke test runs it tiny.

Measured (2,000 rounds, memory bus, 2 shared cores, 1,399 s): 322.7 MiB at round 100, 326.7
MiB at round 2,000, 1.76 KiB per round over rounds 1,000-2,000, of which about 0.7 KB is
the report's history row and the rest secagg's bounded digest caches filling up (flat once
full). Before issue 23's fixes the same script gave 9.0 KiB per round over 300 rounds: every
round's event loop and share graphs were kept.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss_bytes() -> int:
    """The process's resident set size now (Linux), or its peak elsewhere."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares bytes per round over ``points`` (round, rss)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(r for r, _ in points) / n
    my = sum(b for _, b in points) / n
    var = sum((r - mx) ** 2 for r, _ in points)
    return sum((r - mx) * (b - my) for r, b in points) / var if var else 0.0


def run(rounds: int, every: int, broker: str, checkpoint: str | None,
        out: Any = sys.stdout) -> dict[str, Any]:
    from fl.federation import train
    from fl.settings import TrainSettings

    samples: list[tuple[int, int]] = [(0, rss_bytes())]
    started = time.perf_counter()

    def sample(capture: Any) -> None:
        if capture.round % every == 0:
            samples.append((capture.round, rss_bytes()))
            print(f"round {capture.round:5d}  rss {samples[-1][1] / 2**20:8.1f} MiB  "
                  f"{time.perf_counter() - started:7.1f} s", file=out, flush=True)

    settings = TrainSettings(sites=3, rounds=rounds, dataset="breast-cancer", seed=0,
                             broker=broker, checkpoint=checkpoint, batch_size=64)
    train(settings, on_capture=sample)
    later = samples[len(samples) // 2:]
    result = {"rounds": rounds, "every": every, "broker": broker,
              "checkpoint": checkpoint is not None,
              "rss_mib": [{"round": r, "rss_mib": round(b / 2**20, 2)} for r, b in samples],
              "growth_bytes_per_round": round(slope(later), 1),
              "seconds": round(time.perf_counter() - started, 1)}
    print(f"growth over rounds {later[0][0]}..{later[-1][0]}: "
          f"{result['growth_bytes_per_round'] / 1024:.2f} KiB per round", file=out)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2000, help="rounds to run (default 2000)")
    ap.add_argument("--every", type=int, default=100,
                    help="read the RSS every this many rounds (default 100)")
    ap.add_argument("--broker", default="memory",
                    help="memory (default) or embedded: the bus the rounds go through")
    ap.add_argument("--checkpoint", metavar="DIR",
                    help="checkpoint every round into DIR (default: a temporary folder; "
                         "'none' for no checkpoint)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON at the end")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.every < 1:
        ap.error("--rounds and --every must be at least 1")
    with tempfile.TemporaryDirectory(prefix="bench-long-run-") as tmp:
        checkpoint = (None if args.checkpoint == "none"
                      else args.checkpoint or str(Path(tmp, "ckpt")))
        result = run(args.rounds, args.every, args.broker, checkpoint)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
