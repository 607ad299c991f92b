"""The site session's gate cost as the ledger grows (fl/site/session.py).

    python benchmarks/bench_session_replay.py [--rounds 10000] [--window 500]

Admits ``--rounds`` rounds of fresh keys through ``SiteSession.admit`` (the replay rule, then
a write-ahead charge) and withdraws each (``SiteSession.not_sent``: a round replaced before
its masked input existed, which a server can repeat at no cost to the site's budget), and
prints the CPU time per admit + withdraw for each ``--window`` rounds. The ledger charges in
constant time (benchmarks/bench_ledger.py); the session's replay rule (``joined``: every
charge's label) and the core's ``withdraw`` (the charge by id) scan the whole ledger, so this
column grows with it: 1.1 ms at 2,500 charges, 4.0-4.4 ms at 10,000 (a 2-core CI host,
review of issue 27). Profiled over 6,000 rounds: ``joined``'s scan took 28 s of the CPU
(18 million label comparisons), ``Ledger.charges`` (a new list per access) and
``SiteCore.withdraw``'s lookup most of the rest. The fix: the ledger keeps its round keys in
a set and its charges by id, so the gate is O(1) as the charge is.
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
