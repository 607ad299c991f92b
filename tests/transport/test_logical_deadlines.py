"""Simulations drop only what they were asked to drop (docs/performance.md "Logical
deadlines"): on a host slowed on purpose (the simulation niced, CPU hogs beside it) the
round finishes with exactly the scheduled dropouts, and a run that cannot go on says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from secagg import Config, Stage
from transport.drivers import Timeouts
from transport.errors import TransportError
from transport.runner import InputSource, SimulationSpec, SimulationStalled, run_simulation

REPO = Path(__file__).resolve().parents[2]
HOG = "while True: pass"


@contextlib.contextmanager
def cpu_hogs(count: int = 2) -> Iterator[None]:
    """``count`` busy processes at normal priority (one per core of this machine)."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _niced(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(["nice", "-n", "10", sys.executable, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_secagg_simulate_on_a_starved_host_drops_only_the_scheduled_clients() -> None:
    """`secagg simulate` (logical deadlines, the default) niced (10) beside two CPU hogs:
    every scheduled dropout, at its stage, and nothing else; the sum is correct."""
    with cpu_hogs():
        done = _niced(["-m", "fl.cli", "simulate", "--clients", "8", "--dim", "500",
                       "--drop-rate", "0.25", "--seed", "3", "--json"], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["deadlines"] == "logical" and report["overrun"] is None
    assert len(report["drop_schedule"]) == 2
    assert report["dropped"] == report["drop_schedule"]
    assert report["correct"] is True


# The deadlines a deployment would use are absurdly short here (10 ms stages, 0.5 s to
# start or give up): under wall-clock deadlines this host drops sites (or all of them time
# out waiting for the round start); under logical ones the clock does not matter.
SCRIPT = """
import asyncio, json, sys
from secagg import Config, Stage
from transport.drivers import Timeouts
from transport.runner import InputSource, SimulationSpec, run_simulation
from fl.cli.simulate import plaintext_sum
config = Config(num_clients=10, dim=5000)
drops = {2: Stage.SHARE_KEYS, 5: Stage.MASKED_INPUT, 9: Stage.UNMASKING}
source = InputSource(seed=11)
spec = SimulationSpec(config, tuple(range(1, 11)), source, drops, processes=2,
                      timeouts=Timeouts(stage=0.01, start=0.5, give_up=0.5, retry=5.0,
                                        answer=30.0),
                      stall=float(sys.argv[1]) if sys.argv[1] != "wall" else None)
run = asyncio.run(run_simulation(spec))
result = run.result
print(json.dumps({
    "error": run.error, "overrun": run.overrun,
    "dropped": {} if result is None else {c: s.label for c, s in result.dropped.items()},
    "correct": result is not None and bool(
        (plaintext_sum(source, config, sorted(result.included)) == result.total).all())}))
"""


def test_logical_deadlines_ignore_the_clock_on_a_starved_host() -> None:
    with cpu_hogs():
        done = _niced(["-c", SCRIPT, "120"], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["error"] is None and out["overrun"] is None, out
    assert out["dropped"] == {"2": "share_keys", "5": "masked_input", "9": "unmasking"}
    assert out["correct"] is True


def _workers() -> list[psutil.Process]:
    """This process's ``secagg simulate`` worker processes: spawned (``spawn_main``), or
    forked by multiprocessing's fork server (its children; not the server itself)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            spawned = any("spawn_main" in part for part in child.cmdline())
            forked = any("forkserver import main" in part
                         for part in child.parent().cmdline())
            if spawned or forked:
                out.append(child)
    return out


def test_a_run_that_cannot_keep_up_says_so_instead_of_dropping() -> None:
    """The sites stop answering (their processes are stopped, SIGSTOP): a logical-deadline
    run fails with ``SimulationStalled`` naming the cause, it reports no dropouts."""
    stopped: list[psutil.Process] = []

    def status(text: str) -> None:
        if text.endswith("round starts"):
            for worker in _workers():
                worker.send_signal(signal.SIGSTOP)
                stopped.append(worker)

    config = Config(num_clients=6, dim=100)
    spec = SimulationSpec(config, tuple(range(1, 7)), InputSource(seed=1), {},
                          processes=2, timeouts=Timeouts(stage=60.0), stall=2.0)
    try:
        with pytest.raises(SimulationStalled, match=r"no progress for .* cannot keep up"):
            asyncio.run(run_simulation(spec, on_status=status))
    finally:
        for worker in stopped:
            with contextlib.suppress(psutil.Error):
                worker.send_signal(signal.SIGCONT)
    assert len(stopped) == 2


def test_unasked_dropouts_are_named_as_the_host_not_keeping_up() -> None:
    from transport.runner import _overrun

    asked = {3: Stage.SHARE_KEYS}
    assert _overrun(asked, {3: Stage.SHARE_KEYS}, {}) is None
    text = _overrun(asked, {3: Stage.SHARE_KEYS, 4: Stage.MASKED_INPUT},
                    {4: "it left the round (offline)"})
    assert text is not None and "could not keep up" in text and "client 4" in text
    assert _overrun(asked, {3: Stage.MASKED_INPUT}, {}) is not None  # the wrong stage


def test_logins_slower_than_any_fixed_bound_do_not_fail_a_logical_run() -> None:
    """Logical deadlines: the sites' logins are waited for as long as sites keep joining
    (10,000 logins on a busy host take longer than the wall-clock model's login bound).
    Here that bound is 10 ms, far below what six logins take, and the run completes
    exactly; the same spec on wall-clock deadlines fails at that bound (the mutation)."""
    config = Config(num_clients=6, dim=50)
    timeouts = Timeouts(stage=60.0, start=0.01)

    def spec(stall: float | None) -> SimulationSpec:
        return SimulationSpec(config, tuple(range(1, 7)), InputSource(seed=2),
                              {3: Stage.SHARE_KEYS}, processes=2, timeouts=timeouts,
                              connect_timeout=0.01, stall=stall)

    run = asyncio.run(run_simulation(spec(60.0)))
    assert run.error is None and run.overrun is None
    assert run.result is not None and set(run.result.dropped) == {3}
    with pytest.raises(TransportError, match=r"only \d+ of 6 clients connected within"):
        asyncio.run(run_simulation(spec(None)))
