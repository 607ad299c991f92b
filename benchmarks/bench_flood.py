"""One flooding login against an honest round (issue 29), at the default deadlines.

A round of ``--sites`` sites (d = ``--dim``, 32-bit) runs over the embedded broker in its own
process (as ``secagg simulate`` runs it), with ``transport.drivers.Timeouts()`` (60 s per
stage). A second connection under one site's login (``in``: a site of the round) or a login
outside the round (``out``) publishes ``--flood`` tiny messages on topics its ACL allows, as
fast as the broker takes them: 16-byte junk and valid one-chunk frames of garbage,
alternately. Printed per row: the round's seconds (the server's ``total``), whether it
completed and with how many sites, and how many of the flood's publishes the broker took
in during the round.

Each row runs in a fresh process with ``PYTHONPATH=--source``: this checkout (the defences)
or a copy of the code before them (``git archive b1c034d | tar -x -C /tmp/before``)::

    python benchmarks/bench_flood.py                        # this checkout
    python benchmarks/bench_flood.py --source /tmp/before   # without the defences

Not a test: timings depend on the machine (docs/security.md quotes a run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

_ROUND = """
import asyncio, json, secrets, sys, time
import numpy as np
from secagg import Config, ProtocolAbort, Stage
from tests.transport.mqtt_raw import RawClient, publish_packet
from transport.drivers import Timeouts
from transport.framing import frame
from transport.launch import running_broker
from transport.mqtt import MqttNetwork
from transport.rounds import run_round
from transport.topics import SERVER_USER, Topics, acl_table, site_name

sites, dim, flood, where = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ids = list(range(1, sites + 1))
outsider = sites + 1
users = {site_name(c): secrets.token_hex(12) for c in [*ids, outsider]}
users[SERVER_USER] = secrets.token_hex(12)
config = Config(num_clients=sites, dim=dim, bits=32)
inputs = {c: np.random.default_rng([1, c]).integers(0, 1 << 32, dim, dtype=np.uint64)
          for c in ids}
topics = Topics(f"flood-{secrets.token_hex(4)}")
evil = 1 if where == "in" else outsider

async def flood_with(client, topic, sent):
    junk = publish_packet(topic, bytes(range(16)))
    garbage = publish_packet(topic, frame(bytes(16))[0])
    for i in range(flood):
        client.send(junk if i % 2 else garbage)
        sent[0] += 1
        if i % 1000 == 999:
            await client.writer.drain()

async def main():
    async with running_broker("embedded", users, acl_table([*ids, outsider])) as settings:
        sent = [0]
        task = None
        if flood:
            client = await RawClient.login(settings.port, f"{site_name(evil)}-flood",
                                           site_name(evil), users[site_name(evil)])
            task = asyncio.create_task(flood_with(
                client, topics.stage_upstream(evil, Stage.ADVERTISE_KEYS), sent))
        started = time.monotonic()
        try:
            report = await run_round(MqttNetwork(settings), config, inputs,
                                     round_name=topics.round_name, timeouts=Timeouts())
            out = {"completed": True, "seconds": report.seconds["total"],
                   "included": len(report.included)}
        except ProtocolAbort as exc:
            out = {"completed": False, "seconds": time.monotonic() - started,
                   "included": 0, "reason": str(exc)[:120]}
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        out["flood_written"] = sent[0]
        print(json.dumps(out))

asyncio.run(main())
"""


def run_row(source: Path, sites: int, dim: int, flood: int, where: str,
            timeout: float) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(source))
    try:
        done = subprocess.run([sys.executable, "-c", _ROUND, str(sites), str(dim),
                               str(flood), where], env=env, cwd=source, capture_output=True,
                              text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"completed": False, "seconds": timeout, "included": 0,
                "reason": f"no result within {timeout:g} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"completed": False, "seconds": float("nan"), "included": 0,
                "reason": (done.stderr.strip().splitlines() or ["?"])[-1][:120]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, default=REPO,
                        help="the code to run (default: this checkout)")
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--dim", type=int, default=100_000)
    parser.add_argument("--flood", type=int, default=100_000)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    source = args.source.resolve()
    print(f"# {args.sites} sites, d = {args.dim}, default Timeouts (60 s stages), "
          f"code: {'this checkout' if source == REPO else source}")
    print("| flooding login | round s | completed | sites included | flood publishes written |")
    print("|---|---|---|---|---|")
    for label, flood, where in (("none", 0, "out"), ("outside the round", args.flood, "out"),
                                ("in the round", args.flood, "in")):
        got = run_row(source, args.sites, args.dim, flood, where, args.timeout)
        status = "yes" if got["completed"] else f"no ({got.get('reason', '')})"
        print(f"| {label} | {got['seconds']:.1f} | {status} | {got['included']} | "
              f"{got.get('flood_written', 0)} |", flush=True)


if __name__ == "__main__":
    main()
