"""The site session's gate cost as the ledger grows (fl/site/session.py).

    python benchmarks/bench_session_replay.py [--rounds 10000] [--window 500]

Admits ``--rounds`` rounds of fresh keys through ``SiteSession.admit`` (the replay rule, then
a write-ahead charge) and withdraws each (``SiteSession.not_sent``: a round replaced before
its masked input existed, which a server can repeat at no cost to the site's budget), and
prints the CPU time per admit + withdraw for each ``--window`` rounds. The replay rule
(``joined``) asks the ledger, which keeps its round keys in a set and its charges by id
(dp/ledger.py, built at open from the log), and a withdrawal recomposes only the active
charges, so the column is flat.

``python benchmarks/bench_session_replay.py --rounds 10000 --window 2500`` on a 2-core host
(load about 2, 2026-11-29), CPU ms per admit + withdraw at 2,500 / 5,000 / 7,500 / 10,000
charges: before (each admit scanned every label, each withdrawal rebuilt the charge list and
found the charge by a scan) 0.80 / 2.00 / 2.17 / 3.54; now 0.32 / 0.39 / 0.39 / 0.32.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def measure(rounds: int, window: int) -> list[tuple[int, float]]:
    from dp.policy import SitePolicy
    from fl.site.core import open_site_core
    from fl.site.session import SiteSession, Terms

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        core = open_site_core(policy=SitePolicy(modes=("none",)),
                              ledger_path=os.path.join(folder, "ledger.json"))
        session = SiteSession(core=core, runtime="bench")
        try:
            for start in range(0, rounds, window):
                began = time.process_time()
                for _ in range(window):
                    admitted = session.admit(Terms(
                        os.urandom(16), "round", num_clients=3, threshold=2, neighbors=None,
                        security="semi-honest",
                        charge=lambda c, label: c.admit(None, secagg_threshold=2,
                                                        label=label)))
                    session.not_sent(admitted.charge, "replaced")
                rows.append((start + window, (time.process_time() - began) / window))
        finally:
            core.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10_000)
    parser.add_argument("--window", type=int, default=500)
    args = parser.parse_args()
    print("charges  CPU ms per admit + withdraw")
    for charges, seconds in measure(args.rounds, args.window):
        print(f"{charges:7d}  {seconds * 1e3:.2f}")


if __name__ == "__main__":
    main()
