"""``secagg simulate``: one secure aggregation round across real processes and a real broker.

The server runs in this process, the sites in ``--processes`` worker processes, and every
message crosses an MQTT broker (the embedded one by default). ``--drop-rate`` sites stop at
``--drop-stage`` (signing off as their last will would); with ``--kill`` they die by SIGKILL
and the broker publishes their wills. Afterwards this process computes the plaintext sum of
the included inputs itself and compares it with the aggregate: ``correct`` is measured.
By default the round runs on logical deadlines (``--deadlines logical``): the only dropouts
are the scheduled ones however slow the host; a run that cannot keep up fails saying so.

Imports no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import os
import random
import secrets
import signal
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from secagg import SECURITY_MODES, Config, Stage, round_stages
from secagg.crypto import dtype_for_bits

from ..errors import FLError
from ._common import UsageError, nonnegative_int, positive_int

DEFAULT_CLIENTS = 10
DEFAULT_DIM = 1000


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "simulate", help="run one secure aggregation round across processes and a broker",
        description="Run one secure aggregation round: the server here, the clients in worker "
                    "processes, every message through an MQTT broker, with real dropouts.")
    parser.add_argument("--clients", type=int, metavar="N",
                        help=f"number of clients (default {DEFAULT_CLIENTS}, or the number "
                             "of files in --inputs)")
    parser.add_argument("--threshold", type=positive_int, metavar="T",
                        help="Shamir threshold (default: the smallest safe one)")
    parser.add_argument("--dim", type=int, metavar="D",
                        help=f"vector length (default {DEFAULT_DIM}, or that of --inputs)")
    parser.add_argument("--bits", type=int, default=32, metavar="B",
                        help="the sum is mod 2**B (default 32)")
    parser.add_argument("--neighbors", type=int, metavar="K",
                        help="SecAgg+ neighbourhood size (default: complete graph)")
    parser.add_argument("--security", choices=SECURITY_MODES,
                        default="semi-honest",
                        help="threat model: semi-honest (default), or malicious (signed "
                             "messages and a consistency check)")
    parser.add_argument("--norm-bound", type=int, metavar="B",
                        help="input validation: every client proves in zero knowledge that "
                             "its vector (centred integers mod 2**bits) has L2 norm <= B; a "
                             "failed proof leaves it out, named (needs the validation extra; "
                             "docs/protocol.md section 10)")
    parser.add_argument("--drop-rate", type=float, default=0.0, metavar="P",
                        help="fraction of clients that drop out (default 0)")
    parser.add_argument("--drop-stage", default="random", metavar="STAGE|random",
                        help="stage at which they stop sending: "
                             + ", ".join(s.label for s in Stage) + " or random (default)")
    parser.add_argument("--kill", action="store_true",
                        help="dropping clients die by SIGKILL instead of signing off")
    parser.add_argument("--deadlines", choices=("logical", "wall"), default="logical",
                        help="logical (default): a stage closes when every client answered "
                             "or declared its drop, however slow the host, and a run that "
                             "cannot keep up fails saying so; wall: a deployment's "
                             "wall-clock deadlines, under which a slow host drops clients")
    parser.add_argument("--processes", type=int, metavar="P",
                        help="worker processes for the clients (default min(2, clients))")
    parser.add_argument("--broker", default="embedded",
                        metavar="embedded|mosquitto|mqtt(s)://host:port",
                        help="the embedded broker (default), a local Mosquitto with a "
                             "generated config, or an existing broker's URL")
    parser.add_argument("--inputs", metavar="DIR",
                        help="directory of <id>.npy unsigned vectors (ids are the file stems)")
    parser.add_argument("--output", metavar="SUM.npy", help="write the aggregate here")
    parser.add_argument("--report", metavar="REPORT.json", help="write a JSON report here")
    parser.add_argument("--seed", type=nonnegative_int, metavar="S",
                        help="seed for random inputs and the drop schedule")
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON on stdout instead of the summary")
    parser.set_defaults(command="simulate")
    return parser  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- options


def _client_ids(args: argparse.Namespace) -> list[int]:
    from transport import input_ids

    if args.inputs is None:
        n = DEFAULT_CLIENTS if args.clients is None else args.clients
        if n < 2:
            raise UsageError(f"--clients {n}: need at least 2 clients")
        return list(range(1, n + 1))
    if not Path(args.inputs).is_dir():
        raise UsageError(f"--inputs {args.inputs}: not a directory of <id>.npy files")
    try:
        ids = input_ids(args.inputs)
    except ValueError as exc:
        raise UsageError(f"--inputs: {exc}") from None
    if args.clients is not None and args.clients != len(ids):
        raise UsageError(f"--clients {args.clients} but --inputs holds {len(ids)} vectors; "
                          "drop --clients or make them agree")
    if len(ids) < 2:
        raise UsageError(f"--inputs {args.inputs} holds {len(ids)} vector; need at least 2")
    return ids


def _dim(args: argparse.Namespace, ids: list[int]) -> int:
    if args.inputs is None:
        return DEFAULT_DIM if args.dim is None else int(args.dim)
    first = Path(args.inputs) / f"{ids[0]}.npy"
    try:
        shape = np.load(first, mmap_mode="r", allow_pickle=False).shape
    except (OSError, ValueError) as exc:
        raise UsageError(f"--inputs: cannot read {first}: {exc}") from None
    if len(shape) != 1:
        raise UsageError(f"--inputs: {first} has shape {shape}; store 1-d vectors")
    if args.dim is not None and args.dim != shape[0]:
        raise UsageError(f"--dim {args.dim} but the vectors in --inputs have length "
                          f"{shape[0]}; drop --dim or make them agree")
    return int(shape[0])


def build_config(args: argparse.Namespace, n: int, dim: int) -> Config:
    if not 0.0 <= args.drop_rate < 1.0:
        raise UsageError(f"--drop-rate {args.drop_rate}: need a fraction in [0, 1)")
    try:
        return Config(num_clients=n, threshold=args.threshold, dim=dim, bits=args.bits,
                      neighbors=args.neighbors, security=args.security,
                      dropout_rate=args.drop_rate if args.neighbors is not None else None,
                      norm_bound=getattr(args, "norm_bound", None))
    except ValueError as exc:
        raise UsageError(str(exc).replace("use neighbors=None", "drop --neighbors")
                          .replace("threshold=", "--threshold ")
                          .replace("num_clients=", "--clients ").replace("dim=", "--dim ")
                          .replace("bits=", "--bits ").replace("neighbors=", "--neighbors ")
                          .replace("norm_bound=", "--norm-bound ")
                          ) from None


def drop_schedule(config: Config, ids: list[int], rate: float, stage: str,
                  seed: int) -> dict[int, Stage]:
    """Which clients drop and where: ``round(rate * n)`` clients chosen with ``seed``."""
    stages = list(round_stages(config))
    fixed: Stage | None = None
    if stage != "random":
        try:
            fixed = Stage.parse(stage)
        except ValueError as exc:
            raise UsageError(f"--drop-stage: {exc} or random") from None
        if fixed not in stages:
            raise UsageError(f"--drop-stage {stage}: that stage only exists with "
                              "--security malicious")
    rng = random.Random(seed)  # which clients drop is a simulation choice, not a secret
    chosen = rng.sample(ids, round(rate * len(ids)))
    return {cid: fixed if fixed is not None else rng.choice(stages) for cid in sorted(chosen)}


# --------------------------------------------------------------------------- running


PROGRESS_INTERVAL = 10.0
"""Seconds between progress lines when stderr is not a terminal."""


class StageDisplay:
    """A round's stages on stderr. On a terminal: status lines, and inside a stage one line kept
    up to date (clients answered / expected, elapsed). Elsewhere (a log file, a CI job):
    a line every ``interval`` seconds while a stage is open, and the stage summaries."""

    def __init__(self, stream: TextIO, n_clients: int, *, interval: float = PROGRESS_INTERVAL,
                 clock: Any = time.monotonic) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.interval = interval
        self.clock = clock
        self.expected = n_clients
        self.stage: Stage | None = None
        self.answered = 0
        self.opened = clock()
        self._last_line = clock()
        self._live = False

    def _print(self, text: str) -> None:
        if self._live:
            self.stream.write("\r\x1b[K")
            self._live = False
        print(f"[secagg] {text}", file=self.stream, flush=True)

    def status(self, text: str) -> None:
        if self.tty:
            self._print(text)

    def start(self) -> None:
        """The round starts: the first stage opens."""
        self.opened = self._last_line = self.clock()

    def message(self, client_id: int, stage: Stage) -> None:
        del client_id
        if stage != self.stage:
            self.stage, self.answered = stage, 0
        self.answered += 1

    def line(self) -> str:
        label = self.stage.label if self.stage is not None else "waiting"
        return (f"{label:<18} {self.answered:>5}/{self.expected:<5} answered  "
                f"{self.clock() - self.opened:7.1f} s")

    def tick(self) -> None:
        """Called periodically while a stage is open."""
        now = self.clock()
        if self.tty:
            self.stream.write(f"\r\x1b[K[secagg] {self.line()}")
            self.stream.flush()
            self._live = True
        elif now - self._last_line >= self.interval:
            self._last_line = now
            self._print(self.line())

    def stage_closed(self, progress: Any) -> None:
        late = " (deadline)" if progress.deadline_hit else ""
        text = (f"{progress.stage.label:<18} {progress.responded:>5}/{progress.expected:<5} "
                f"answered  {progress.seconds:7.2f} s{late}")
        if self.tty or progress.seconds >= self.interval:
            self._print(text)
        self.expected = max(0, progress.responded)
        self.stage, self.answered = None, 0
        self.opened = self._last_line = self.clock()

    def close(self) -> None:
        if self._live:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._live = False


class Interrupted(FLError):
    """SIGINT or SIGTERM arrived; everything the run started has been stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
RECANCEL_INTERVAL = 0.1
"""Seconds between cancellations of an interrupted run until it has ended."""


class StopSignals:
    """SIGINT and SIGTERM as a fact, not a single cancellation: the first one is recorded
    the moment it arrives (a Python-level handler, which runs even while the event loop is
    busy in synchronous code such as starting the broker), and ``watch`` wakes the loop, which
    cancels the run until it has ended (one ``Task.cancel()`` can be absorbed by a task that
    was finishing at that moment). Later signals change nothing: the stop is under way."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._wake: Any = None

    def record(self, signum: int, frame: Any = None) -> None:
        del frame
        if self.received is None:
            self.received = signum
            # The user asked to stop: the teardown's own noise (lost connections, forced
            # disconnects) is not news; one line says what happened.
            logging.disable(logging.CRITICAL)
        if self._wake is not None:
            self._wake()

    def __enter__(self) -> StopSignals:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self.record)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def watch(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
        """Set ``stop`` on the loop at the first signal (or now, if one came already). The
        loop's own handlers make a signal taken by another thread wake it too; the recording
        handler stays the Python-level one."""
        self._wake = lambda: loop.call_soon_threadsafe(stop.set)
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, self.record, signum)
            signal.signal(signum, self.record)
        if self.received is not None:
            stop.set()

    def unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        self._wake = None
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
            signal.signal(signum, self.record)


async def _run_interruptible(spec: Any, progress: StageDisplay, signals: StopSignals) -> Any:
    """``run_simulation`` that SIGINT and SIGTERM stop (its cleanup stops the workers and
    the broker and removes the temporary files), with a progress ticker. After a signal it
    raises ``Interrupted`` whatever the run returned or raised."""
    from transport import run_simulation

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def status(text: str) -> None:
        if text.endswith("round starts"):
            progress.start()
        progress.status(text)

    async def ticker() -> None:
        while True:
            await asyncio.sleep(0.5 if progress.tty else min(1.0, progress.interval))
            if progress.stage is not None or progress.answered:
                progress.tick()

    signals.watch(loop, stop)
    ticking = asyncio.create_task(ticker())
    stopping = asyncio.create_task(stop.wait())
    run = asyncio.create_task(run_simulation(spec, on_stage=progress.stage_closed,
                                             on_status=status, on_message=progress.message))
    try:
        await asyncio.wait({run, stopping}, return_when=asyncio.FIRST_COMPLETED)
        while not run.done():  # a signal: cancel until the run (and its cleanup) has ended
            run.cancel()
            await asyncio.wait({run}, timeout=RECANCEL_INTERVAL)
    finally:
        for task in (ticking, stopping):
            task.cancel()
        await asyncio.wait({ticking, stopping})
        progress.close()
        signals.unwatch(loop)
    if signals.received is not None:
        # Whatever failed after the signal failed because of it (a connection being torn
        # down, a worker that was stopped); a run that completed anyway was still stopped.
        if not run.cancelled():
            run.exception()  # retrieved
        raise Interrupted(signals.received)
    return run.result()


def _timeouts(config: Config, processes: int) -> Any:
    """The round's deadlines (transport.deadlines.round_timeouts) for this machine: the clients
    compute in ``processes`` workers on the cores this process may use."""
    from transport import round_timeouts

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    colocated = math.ceil(config.num_clients / max(1, min(processes, cores)))
    return round_timeouts(60.0, clients=config.num_clients, dim=config.dim,
                          neighbors=config.neighbors, malicious=config.malicious,
                          colocated=colocated, validated=config.norm_bound is not None)


class _RequestedDrops(logging.Filter):
    """The server's "client N dropped" / "client N aborted" WARNING is news only for a drop
    nobody asked for: for the clients ``--drop-rate`` scheduled it is lowered to INFO."""

    def __init__(self, requested: set[int]) -> None:
        super().__init__()
        self.requested = requested

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if (record.levelno == logging.WARNING and message.startswith("server: client %d ")
                and isinstance(record.args, tuple) and record.args
                and record.args[0] in self.requested):
            record.levelno, record.levelname = logging.INFO, "INFO"
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        return True


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except UsageError as exc:
        print(f"secagg simulate: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from transport import InputSource, SimulationSpec

    ids = _client_ids(args)
    dim = _dim(args, ids)
    config = build_config(args, len(ids), dim)
    processes = min(2, len(ids)) if args.processes is None else args.processes
    if not 1 <= processes <= len(ids):
        raise UsageError(f"--processes {processes}: need 1 to {len(ids)} (the clients)")
    from fl.aggregation import check_broker

    try:
        broker = check_broker(args.broker, kinds=("embedded", "mosquitto"))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    seed = secrets.randbelow(1 << 31) if args.seed is None else args.seed
    drops = drop_schedule(config, ids, args.drop_rate, args.drop_stage, seed)
    source = InputSource(directory=args.inputs, seed=seed)
    if args.inputs is not None:  # checked now, one at a time: never n vectors held here
        for cid in ids:
            try:
                source.load(cid, config)
            except ValueError as exc:
                raise UsageError(f"--inputs: {exc}".replace("norm_bound=", "--norm-bound ")
                                  ) from None
    for path in (args.output, args.report):
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise UsageError(f"{path}: its directory does not exist")

    from transport import keep_large_buffers

    keep_large_buffers()  # the server's frames and sums reuse memory (transport.heap)
    progress = StageDisplay(sys.stderr, len(ids))
    timeouts = _timeouts(config, processes)
    # logical deadlines: the run fails once the server heard nothing for as long as a
    # deployment's client waits before giving up on a silent round
    spec = SimulationSpec(config=config, client_ids=tuple(ids), inputs=source, drops=drops,
                          kill=args.kill, processes=processes, broker=broker,
                          timeouts=timeouts,
                          stall=timeouts.give_up if args.deadlines == "logical" else None)
    progress.status(f"{len(ids)} clients, dim {dim}, {config.bits} bits, threshold "
                    f"{config.threshold}, {config.security}; {len(drops)} scheduled to drop"
                    + (" (killed)" if args.kill else ""))
    interrupted: Interrupted | None = None
    requested = _RequestedDrops(set(drops))
    driver_log = logging.getLogger("transport.server_driver")
    driver_log.addFilter(requested)
    try:
        with StopSignals() as signals:
            outcome = asyncio.run(_run_interruptible(spec, progress, signals))
    except Interrupted as exc:
        interrupted = Interrupted(exc.signum)  # without the traceback that holds the run
    except Exception as exc:  # the broker or the workers could not even start
        logging.getLogger(__name__).debug("simulation failed", exc_info=True)
        print(f"secagg simulate: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        driver_log.removeFilter(requested)
    if interrupted is not None:
        # The run's leftovers (e.g. aiomqtt futures of connections the stop cut) are
        # collected while logging is still off: their "exception was never retrieved" is
        # the teardown's noise, not news.
        gc.collect()
        logging.disable(logging.NOTSET)
        print(f"secagg simulate: interrupted by {interrupted}; the broker and the worker "
              "processes are stopped and the temporary files removed", file=sys.stderr)
        return 128 + interrupted.signum
    report = build_report(args, config, seed, drops, processes, ids, source, outcome)
    if args.report is not None:
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if outcome.result is not None and args.output is not None:
        np.save(args.output, outcome.result.total)
    print(json.dumps(report, indent=2) if args.json else summary(report))
    if outcome.error is not None:
        print(f"secagg simulate: round aborted: {outcome.error}", file=sys.stderr)
        return 1
    if outcome.overrun is not None:
        print(f"secagg simulate: error: {outcome.overrun}", file=sys.stderr)
        return 1
    if not report["correct"]:
        print("secagg simulate: error: the aggregate does not equal the plaintext sum of "
              "the included inputs", file=sys.stderr)
        return 1
    return 0


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def plaintext_sum(source: Any, config: Config, included: Iterable[int]) -> np.ndarray:
    """The sum of the included inputs mod 2**bits in the natural width, loading one input
    at a time (the check holds two vectors, never n)."""
    expected = np.empty(config.dim, dtype=dtype_for_bits(config.bits))
    expected.fill(0)  # written at once: np.zeros' lazy pages fault twice on the adds
    for cid in included:
        np.add(expected, source.load(cid, config), out=expected)  # wraps mod 2**width
    if config.bits < 8 * expected.dtype.itemsize:
        np.bitwise_and(expected, expected.dtype.type((1 << config.bits) - 1), out=expected)
    return expected


def build_report(args: argparse.Namespace, config: Config, seed: int,
                 drops: Mapping[int, Stage], processes: int, ids: Iterable[int],
                 source: Any, outcome: Any) -> dict[str, Any]:
    result = outcome.result
    included = sorted(result.included) if result is not None else []
    correct = False
    if result is not None:
        correct = bool(np.array_equal(plaintext_sum(source, config, included),
                                      result.total))
    ids = sorted(ids)
    reasons = {str(cid): why for cid, why in sorted(outcome.reasons.items())
               if cid not in result.included} if result is not None else {
                   str(cid): why for cid, why in sorted(outcome.reasons.items())}
    bytes_sent = {str(cid): dict(outcome.outcomes.get(cid, {}).get("bytes_sent", {}))
                  for cid in ids}
    return {
        "config": {"clients": config.num_clients, "threshold": config.threshold,
                   "dim": config.dim, "bits": config.bits, "neighbors": config.neighbors,
                   "security": config.security, "norm_bound": config.norm_bound},
        "broker": args.broker,
        "broker_url": outcome.broker_url,
        "processes": processes,
        "seed": seed,
        "kill": bool(args.kill),
        "drop_schedule": {str(c): s.label for c, s in sorted(drops.items())},
        "included": included,
        "dropped": ({str(c): s.label for c, s in sorted(result.dropped.items())}
                    if result is not None else {}),
        "killed": sorted(outcome.killed),
        "refused": ({str(c): why for c, why in sorted(result.refused.items())}
                    if result is not None else {}),
        "correct": correct,
        "error": outcome.error,
        "deadlines": args.deadlines,
        "overrun": outcome.overrun,
        "seconds": {k: round(v, 6) for k, v in outcome.seconds.items()},
        "bytes": bytes_sent,
        "wire_bytes": {str(cid): outcome.outcomes.get(cid, {}).get("wire_bytes", 0)
                       for cid in ids},
        "client_status": {str(cid): outcome.outcomes.get(cid, {}).get("status", "unknown")
                          for cid in ids},
        "transport": {"invalid_payloads": outcome.invalid_payloads,
                      "rejected": outcome.rejected, "resends": outcome.resends,
                      "republished": sum(o.get("republished", 0)
                                         for o in outcome.outcomes.values()),
                      "worker_errors": outcome.worker_errors,
                      "masked_input_chunks": outcome.chunks},
        "reasons": reasons,
    }


def summary(report: Mapping[str, Any]) -> str:
    cfg = report["config"]
    lines = [f"secagg simulate: {cfg['clients']} clients, dim {cfg['dim']}, {cfg['bits']} "
             f"bits, threshold {cfg['threshold']}, {cfg['security']}, broker "
             f"{report['broker']}"]
    if report["error"] is not None:
        lines.append("the round aborted (the reason follows on stderr)")
        return "\n".join(lines)
    by_stage: dict[str, int] = {}
    for stage in report["dropped"].values():
        by_stage[stage] = by_stage.get(stage, 0) + 1
    dropped = ", ".join(f"{s} {k}" for s, k in by_stage.items()) or "none"
    lines.append(f"included {len(report['included'])}/{cfg['clients']}; dropped: {dropped}")
    if cfg.get("norm_bound") is not None:
        refused = ", ".join(report.get("refused", {})) or "none"
        lines.append(f"norm bound {cfg['norm_bound']} (proved in zero knowledge); refused: "
                     f"{refused}")
    reasons = report.get("reasons", {})
    for cid, why in list(reasons.items())[:10]:  # why an honest message was not accepted
        lines.append(f"client {cid} not included: {why}")
    if len(reasons) > 10:
        lines.append(f"... and {len(reasons) - 10} more (--report has every reason)")
    lines.append(f"correct: {'yes' if report['correct'] else 'NO'} (aggregate vs the "
                 "plaintext sum of the included inputs)")
    seconds = report["seconds"]
    stages = ", ".join(f"{k} {v:.2f}" for k, v in seconds.items()
                       if k not in ("setup", "wall", "total"))
    lines.append(f"seconds: {stages}; round {seconds.get('total', 0.0):.2f}, wall "
                 f"{seconds.get('wall', 0.0):.2f}")
    per_stage: dict[str, list[int]] = {}
    for counts in report["bytes"].values():
        for stage, n in counts.items():
            per_stage.setdefault(stage, []).append(n)
    sizes = ", ".join(f"{s} {int(np.median(v))}" for s, v in per_stage.items())
    lines.append(f"bytes sent per client (median): {sizes}")
    return "\n".join(lines)
