"""Flower's own SecAgg+ (flwr 1.42 legacy ``SecAggPlusWorkflow`` + ``secaggplus_mod``) vs this
package's Flower adapter (``SecureAggregation`` + ``secagg_mod``): the same app, n, d, graph
degree k, threshold t and dropouts, one run on this machine.

``--runtime local`` (default): :class:`fl.flower.local.LocalGrid`: every message goes
through Flower's protobuf serde both ways and every node's ``Context`` is rebuilt from its
serialised state before each message, as in Flower's runtimes, but in one process, so the
server's and the nodes' CPU can be told apart (Ray's actors would hide the nodes' CPU).
Each row runs in a fresh subprocess, so its peak RSS is that row's alone: the one process
that holds the server, every node's saved ``Context`` and the messages of a stage.
``--runtime simulation``: Flower's simulation engine (``run_simulation``, Ray backend: the
ServerApp in this process, the ClientApps in Ray worker processes); prints the round's
seconds and the peak RSS of the server process and of the largest node process (psutil,
sampled every 0.1 s), no CPU or byte split.

Per protocol and scenario it prints: seconds for the secure train round, its ratio to the
raw cipher floor measured in the same run (``benchmarks/_floor.py``: AES-128-CTR keystream
for every mask of the round, the ``n (k + 1)`` masks at the sum's width, plus the X25519
exchanges), server CPU seconds, mean CPU seconds per node, mean serialised bytes a node
receives / sends (train message included) and the upload over ``d x bits / 8`` (the
masked vector at its natural width; Flower's SecAgg+ masks mod 2^32), the largest
``Context`` a node saved between messages (LocalGrid), peak memory, and how
far the aggregate is from the exact weighted average of the included nodes' updates.

    python benchmarks/bench_flower.py [--nodes 20] [--dim 10000] [--drop-rate 0.1] [--json]
    nice python benchmarks/bench_flower.py --dim 10000000 --nodes 5 --scenario masked_input
    nice python benchmarks/bench_flower.py --dim 10000000 --nodes 5 --runtime simulation
    nice python benchmarks/bench_flower.py --dim 50000000 --nodes 5 --runtime simulation \
        --scenario masked_input --protocols adapter-32

Scenarios: ``masked_input`` (nodes fail when asked for their masked input: both protocols
can finish) and ``share_keys`` (one node fails before its masked input: Flower's round
aborts, docs/architecture.md section 8).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _floor import floor_seconds  # noqa: E402
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.client import NumPyClient  # noqa: E402
from flwr.client.mod import secaggplus_mod  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import (  # noqa: E402
    RECORD_KEY_CONFIGS,
    Key,
)
from flwr.common.secure_aggregation.secaggplus_constants import Stage as LegacyStage  # noqa: E402
from flwr.server import LegacyContext, ServerConfig  # noqa: E402
from flwr.server.strategy import FedAvg as LegacyFedAvg  # noqa: E402
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from fl.flower import NodeOptions, SecureAggregation, make_secagg_mod  # noqa: E402
from fl.flower.client import DIR_ENV, DP_KEY  # noqa: E402
from fl.flower.local import LocalGrid  # noqa: E402
from fl.flower.records import stage_of  # noqa: E402
from secagg import secagg_plus_parameters  # noqa: E402

LEGACY_STAGE = {"advertise_keys": LegacyStage.SETUP, "share_keys": LegacyStage.SHARE_KEYS,
                "masked_input": LegacyStage.COLLECT_MASKED_VECTORS,
                "unmasking": LegacyStage.UNMASK}


def update(node: int, dim: int) -> tuple[np.ndarray, int]:
    rng = np.random.default_rng(node)
    return rng.uniform(-1, 1, dim).astype(np.float32), 1 + node % 7


def _drop_mod(drops: set[int], stage: str, legacy: bool, partitions: str | None = None
              ) -> Any:
    """Nodes whose ``partition-id`` (both runtimes set it) is in ``drops`` fail when asked
    for ``stage``; with ``partitions`` (a directory) each node writes its partition id
    there under its node id, for a ServerApp that cannot see the mapping (simulation)."""
    def mod(msg: Message, context: Context, call_next: Any) -> Message:
        partition = context.node_config.get("partition-id")
        if partitions is not None:
            (Path(partitions) / str(context.node_id)).write_text(str(partition))
        if partition in drops:
            if legacy:
                configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
                now = None if configs is None else configs.get(Key.STAGE)
                if now == LEGACY_STAGE[stage]:
                    raise RuntimeError("planned dropout")
            elif stage_of(msg) == stage:
                raise RuntimeError("planned dropout")
        return call_next(msg, context)

    return mod


class _Legacy(NumPyClient):  # type: ignore[misc]
    def __init__(self, node: int, dim: int) -> None:
        self.node, self.dim = node, dim

    def fit(self, parameters: Any, config: Any) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        values, weight = update(self.node, self.dim)
        return [values], weight, {}


def legacy_app(dim: int, drops: set[int], stage: str, partitions: str | None = None
               ) -> ClientApp:
    return ClientApp(client_fn=lambda context: _Legacy(context.node_id, dim).to_client(),
                     mods=[_drop_mod(drops, stage, True, partitions), secaggplus_mod])


def our_app(dim: int, drops: set[int], stage: str) -> ClientApp:
    # exact sums, as Flower's SecAgg+ computes: the nodes' operators opt in with
    # secagg-dp='none' in their node config (the default policy takes part in
    # distributed-DP rounds only, and an app's own NodeOptions.policy can only tighten it)
    exact = make_secagg_mod(NodeOptions())

    def operator_opt_in(msg: Message, context: Context, call_next: Any) -> Message:
        context.node_config.setdefault(DP_KEY, "none")  # flower-supernode --node-config
        return call_next(msg, context)  # type: ignore[no-any-return]

    app = ClientApp(mods=[_drop_mod(drops, stage, legacy=False), operator_opt_in, exact])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        values, weight = update(context.node_id, dim)
        return Message(RecordDict({"arrays": ArrayRecord({"w": Array(values)}),
                                   "metrics": MetricRecord({"num-examples": weight})}),
                       reply_to=msg)

    return app


class _Timer:
    """Wall and CPU time of a block; ``grid`` (a LocalGrid) splits the nodes' CPU off."""

    def __init__(self, grid: Any) -> None:
        self.grid = grid
        self.seconds = self.server_cpu = self.client_cpu = 0.0
        self.peak = 0

    def _client(self) -> float:
        return sum(getattr(self.grid, "client_cpu", {}).values())

    def __enter__(self) -> _Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.client = self._client()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.wall
        client = self._client() - self.client
        self.server_cpu = time.process_time() - self.cpu - client
        self.client_cpu = client
        # this process's peak RSS up to the end of the round (the checks after it are not
        # the round's memory)
        self.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Peak:
    """Peak RSS of this process and of its largest child (psutil, sampled every 0.1 s)."""

    def __init__(self) -> None:
        self.server = self.node = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            with contextlib.suppress(psutil.Error):
                self.server = max(self.server, me.memory_info().rss)
                for child in me.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        self.node = max(self.node, child.memory_info().rss)
            self._stop.wait(0.1)

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _average(nodes: list[int], dim: int) -> np.ndarray:
    total, weight = np.zeros(dim), 0
    for node in nodes:
        values, w = update(node, dim)
        total += w * values.astype(np.float64)
        weight += w
    return total / weight


def legacy_round(grid: Any, run_id: int, n: int, dim: int, k: int, t: int, timer: _Timer
                 ) -> Any:
    """Flower's own SecAgg+ round on ``grid``; the aggregate parameters (None: aborted)."""
    captured: list[Any] = []

    class Recording(LegacyFedAvg):  # type: ignore[misc]
        def aggregate_fit(self, *args: Any, **kwargs: Any) -> Any:
            out = super().aggregate_fit(*args, **kwargs)
            captured.append(out[0])
            return out

    strategy = Recording(fraction_evaluate=0.0, min_available_clients=n, min_fit_clients=n,
                         initial_parameters=ndarrays_to_parameters([np.zeros(dim, np.float32)]))
    context = LegacyContext(context=Context(run_id=run_id, node_id=0, node_config={},
                                            state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=1), strategy=strategy)

    class Timed(SecAggPlusWorkflow):  # type: ignore[misc]
        def __call__(self, grid_: Any, context_: Any) -> None:
            with timer:
                super().__call__(grid_, context_)

    DefaultWorkflow(fit_workflow=Timed(num_shares=k, reconstruction_threshold=t))(grid, context)
    return captured[0] if captured else None


def our_round(grid: Any, n: int, dim: int, bits: int, frac_bits: int, dropout_rate: float,
              timer: _Timer) -> tuple[Any, Any]:
    """The adapter's round on ``grid``; (its RoundReport, the strategy's result)."""
    class Timed(SecureAggregation):
        def secure_round(self, grid_: Any, messages: list[Message], timeout: float | None
                         ) -> list[Message]:
            with timer:
                return super().secure_round(grid_, messages, timeout)

    wrapper = Timed(FedAvg(fraction_evaluate=0.0, min_available_nodes=n,
                           min_train_nodes=n), dropout_rate=dropout_rate, bits=bits,
                    frac_bits=frac_bits, stage_timeout=1800)
    result = wrapper.start(grid, ArrayRecord({"w": Array(np.zeros(dim, np.float32))}),
                           num_rounds=1, timeout=1800)
    (report,) = wrapper.reports
    return report, result


def _exact_sum(report: Any, dim: int) -> bool:
    from fl.flower.encoding import encode_reply, flatten

    expected = np.zeros(dim + 1, dtype=np.uint64)  # uint64 wraps mod 2**64
    for node in sorted(report.included):
        values, weight = update(node, dim)
        np.add(expected, encode_reply(report.setup, flatten(ArrayRecord(
            {"w": Array(values)}), report.setup.arrays), {}, weight, None), out=expected,
            casting="unsafe")
    if report.setup.bits < 64:
        expected &= np.uint64((1 << report.setup.bits) - 1)
    return bool(np.array_equal(report.total, expected))


def _row(name: str, bits: int, n: int, dim: int, timer: _Timer, error: float | None,
         included: int, exact_sum: bool | None, grid: Any = None,
         peak: _Peak | None = None) -> dict[str, Any]:
    local = isinstance(grid, LocalGrid)
    up = sum(grid.bytes_up.values()) / n if local else None
    return {"protocol": name, "bits": bits, "completed": error is not None,
            "included": included, "seconds": timer.seconds,
            "server_cpu": timer.server_cpu if local else None,
            "client_cpu_per_node": timer.client_cpu / n if local else None,
            "bytes_down_per_node": sum(grid.bytes_down.values()) / n if local else None,
            "bytes_up_per_node": up,
            "context_bytes_per_node": max(grid.context_bytes.values()) if local else None,
            "up_over_vector": None if up is None else up / (dim * bits / 8),
            "peak_rss": timer.peak if peak is None else None,
            "peak_server_rss": None if peak is None else peak.server,
            "peak_node_rss": None if peak is None else peak.node,
            "max_abs_error": error, "exact_sum": exact_sum}


def run_legacy(n: int, dim: int, k: int, t: int, drop_positions: list[int], stage: str,
               runtime: str = "local") -> dict[str, Any]:
    drops = set(drop_positions)
    if runtime == "simulation":
        import tempfile

        with tempfile.TemporaryDirectory() as partitions:
            return _simulate(legacy_app(dim, drops, stage, partitions), n, dim, 32,
                             lambda grid, timer: _legacy_result(legacy_round(
                                 grid, int(grid.run.run_id), n, dim, k, t, timer),
                                 _included(Path(partitions), drops), dim))
    grid = LocalGrid(legacy_app(dim, drops, stage), n)
    grid.record = False
    timer = _Timer(grid)
    aggregate = legacy_round(grid, grid.run.run_id, n, dim, k, t, timer)
    included = [node for i, node in enumerate(grid.nodes) if i not in drops]
    error, count = _legacy_result(aggregate, included, dim)
    return _row("Flower legacy SecAgg+", 32, n, dim, timer, error, count, None, grid)


def _included(partitions: Path, drops: set[int]) -> list[int]:
    """The node ids whose partition is not dropped, from the files the nodes wrote."""
    return [int(f.name) for f in partitions.iterdir() if int(f.read_text()) not in drops]


def _legacy_result(aggregate: Any, included: list[int], dim: int
                   ) -> tuple[float | None, int]:
    if aggregate is None:
        return None, 0
    (values,) = parameters_to_ndarrays(aggregate)
    return float(np.max(np.abs(values - _average(included, dim)))), len(included)


def run_ours(n: int, dim: int, drop_positions: list[int], stage: str, dropout_rate: float,
             bits: int, frac_bits: int, runtime: str = "local") -> dict[str, Any]:
    app = our_app(dim, set(drop_positions), stage)
    name = f"secagg adapter ({bits}-bit)"

    def round_(grid: Any, timer: _Timer) -> tuple[float | None, int, bool | None]:
        report, result = our_round(grid, n, dim, bits, frac_bits, dropout_rate, timer)
        if report.total is None:
            return None, 0, None
        included = sorted(report.included)
        error = float(np.max(np.abs(result.arrays["w"].numpy() - _average(included, dim))))
        return error, len(included), _exact_sum(report, dim)

    if runtime == "simulation":
        return _simulate(app, n, dim, bits, round_, name)
    grid = LocalGrid(app, n)
    grid.record = False
    timer = _Timer(grid)
    error, included, exact = round_(grid, timer)
    return _row(name, bits, n, dim, timer, error, included, exact, grid)


def _simulate(app: ClientApp, n: int, dim: int, bits: int, body: Any,
              name: str = "Flower legacy SecAgg+") -> dict[str, Any]:
    """``body(grid, timer)`` as the ServerApp of ``run_simulation`` over ``n`` nodes."""
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    server = ServerApp()
    timer = _Timer(None)
    out: list[Any] = []

    @server.main()
    def main(grid: Any, context: Context) -> None:
        out.append(body(grid, timer))

    with _Peak() as peak:
        run_simulation(server, app, num_supernodes=n,
                       backend_config={"client_resources": {"num_cpus": 1},
                                       "init_args": {"num_cpus": 2,
                                                     "include_dashboard": False}})
    error, included, *exact = out[0] if out else (None, 0)
    return _row(name, bits, n, dim, timer, error, included, exact[0] if exact else None,
                peak=peak)


PROTOCOLS = {"flower": ("legacy", 32), "adapter-64": ("ours", 64), "adapter-32": ("ours", 32)}
"""The rows' protocols (``--protocols``): Flower's SecAgg+, the adapter at 64 and 32 bits."""


def _rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (scenario, protocol) row, each in a fresh subprocess unless --in-process."""
    n, dim = args.nodes, args.dim
    rate = max(args.drop_rate, 0.05)
    params = secagg_plus_parameters(n, rate, 0.0)
    k, t = params.neighbors or n, params.threshold
    count = round(args.drop_rate * n)
    drops = [round(i * n / max(1, count)) for i in range(count)]
    scenarios = {"masked_input": drops, "share_keys": [1]}
    chosen = list(scenarios) if args.scenario == "both" else [args.scenario]
    rows = []
    for stage in chosen:
        for spec in [PROTOCOLS[name] for name in args.protocols]:
            call = {"kind": spec[0], "bits": spec[1], "n": n, "dim": dim, "k": k, "t": t,
                    "drops": scenarios[stage], "stage": stage, "rate": rate,
                    "runtime": args.runtime}
            row = _run_row(call) if args.in_process else _subprocess_row(call)
            row.update(scenario=f"{len(scenarios[stage])} drop(s) at {stage}", n=n, dim=dim,
                       k=k, t=t)
            rows.append(row)
    return rows


def _run_row(call: dict[str, Any]) -> dict[str, Any]:
    if call["kind"] == "legacy":
        return run_legacy(call["n"], call["dim"], call["k"], call["t"], call["drops"],
                          call["stage"], call["runtime"])
    return run_ours(call["n"], call["dim"], call["drops"], call["stage"], call["rate"],
                    call["bits"], 24 if call["bits"] == 64 else 16, call["runtime"])


def _subprocess_row(call: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, "--row", json.dumps(call)],
                          capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the {call['kind']} {call['bits']}-bit row failed "
                         f"(exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return dict(json.loads(lines[-1]))


def _floors(rows: list[dict[str, Any]], n: int, dim: int, k: int) -> dict[int, float]:
    """The raw cipher floor of one round at each width the rows use: the ``n (k + 1)``
    masks (each node's k - 1 pairwise and one self mask, the server's self masks) as
    AES-128-CTR keystream with an in-place add, and each node's 2 (k - 1) X25519."""
    return {bits: floor_seconds(n * (k + 1), dim, 2 * n * (k - 1), itemsize=bits // 8)
            for bits in sorted({r["bits"] for r in rows})}


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--dim", type=int, default=10_000)
    parser.add_argument("--drop-rate", type=float, default=0.1,
                        help="fraction of nodes failing at their masked input")
    parser.add_argument("--scenario", choices=("both", "masked_input", "share_keys"),
                        default="both")
    parser.add_argument("--runtime", choices=("local", "simulation"), default="local")
    parser.add_argument("--protocols", nargs="+", choices=tuple(PROTOCOLS),
                        default=list(PROTOCOLS), help="the rows to run (default: all three)")
    parser.add_argument("--in-process", action="store_true",
                        help="run every row in this process (no per-row peak memory)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # one row, for the subprocess
    args = parser.parse_args(argv)
    own = DIR_ENV not in os.environ
    if own:  # the nodes' ledgers: this run's own (its row subprocesses inherit it)
        import tempfile

        os.environ[DIR_ENV] = tempfile.mkdtemp(prefix="bench-flower-ledgers-")
    try:
        return _report(args)
    finally:
        if own:
            del os.environ[DIR_ENV]


def _report(args: argparse.Namespace) -> int:
    logging.getLogger("flwr").setLevel(logging.ERROR)
    logging.getLogger("fl.flower").setLevel(logging.ERROR)
    if args.row:
        print(json.dumps(_run_row(json.loads(args.row))))
        return 0
    rows = _rows(args)
    n, dim, k, t = args.nodes, args.dim, rows[0]["k"], rows[0]["t"]
    floors = _floors(rows, n, dim, k)
    for r in rows:
        r["floor_seconds"] = floors[r["bits"]]
        r["over_floor"] = r["seconds"] / floors[r["bits"]]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"n={n} d={dim} k={k} t={t} (secagg_plus_parameters(n, {max(args.drop_rate, 0.05)},"
          f" 0)); one run, runtime {args.runtime}"
          + (" (LocalGrid: Flower serde + Context per message, one process per row)"
             if args.runtime == "local" else " (run_simulation, Ray)"))
    print("floor (AES-CTR keystream of the round's masks + X25519): "
          + ", ".join(f"{b}-bit {s:.2f} s" for b, s in floors.items()) + "\n")
    print("| scenario | protocol | completed | s / round | x floor | server CPU s | node CPU s "
          "| MB down / node | MB up / node | up / (d bits/8) | node Context KB | "
          "peak RSS MiB | max abs error | integer sum exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        error = "aborted" if r["max_abs_error"] is None else f"{r['max_abs_error']:.1e}"
        exact = {None: "n/a", True: "yes", False: "NO"}[r["exact_sum"]]
        peak = (_fmt(r["peak_rss"], ".0f", 2**20) if r["peak_rss"] is not None else
                f"server {_fmt(r['peak_server_rss'], '.0f', 2**20)}, "
                f"node {_fmt(r['peak_node_rss'], '.0f', 2**20)}")
        print(f"| {r['scenario']} | {r['protocol']} | {'yes' if r['completed'] else 'no'} | "
              f"{r['seconds']:.2f} | {r['over_floor']:.1f} | {_fmt(r['server_cpu'], '.2f')} | "
              f"{_fmt(r['client_cpu_per_node'], '.3f')} | "
              f"{_fmt(r['bytes_down_per_node'], '.2f', 1e6)} | "
              f"{_fmt(r['bytes_up_per_node'], '.2f', 1e6)} | "
              f"{_fmt(r['up_over_vector'], '.2f')} | "
              f"{_fmt(r.get('context_bytes_per_node'), '.1f', 1e3)} | {peak} | {error} | "
              f"{exact} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
