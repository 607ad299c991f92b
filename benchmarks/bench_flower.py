"""Flower's own SecAgg+ (flwr 1.41 legacy ``SecAggPlusWorkflow`` + ``secaggplus_mod``) vs this
package's Flower adapter (``SecureAggregation`` + ``secagg_mod``): the same app, n, d, graph
degree k, threshold t and dropouts, one run on this machine.

Both run on :class:`fl.flower.local.LocalGrid`: every message goes through Flower's protobuf
serde both ways and every node's ``Context`` is rebuilt from its serialised state before
each message, as in Flower's runtimes, but in one process, so the server's and the nodes'
CPU can be told apart (Ray's actors would hide the nodes' CPU). Per protocol and scenario it
prints: seconds for the secure train round, server CPU seconds, mean CPU seconds per node,
mean serialised bytes a node receives / sends (train message included), and how far the
aggregate is from the exact weighted average of the included nodes' updates.

    python benchmarks/bench_flower.py [--nodes 20] [--dim 10000] [--drop-rate 0.1] [--json]

Scenarios: ``masked_input`` (nodes fail when asked for their masked input: both protocols
can finish) and ``share_keys`` (one node fails before its masked input: Flower's round
aborts, docs/architecture.md section 8).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

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

from dp.policy import SitePolicy  # noqa: E402
from fl.flower import NodeOptions, SecureAggregation, make_secagg_mod  # noqa: E402
from fl.flower.local import LocalGrid  # noqa: E402
from fl.flower.records import stage_of  # noqa: E402
from secagg import secagg_plus_parameters  # noqa: E402

LEGACY_STAGE = {"advertise_keys": LegacyStage.SETUP, "share_keys": LegacyStage.SHARE_KEYS,
                "masked_input": LegacyStage.COLLECT_MASKED_VECTORS,
                "unmasking": LegacyStage.UNMASK}


def update(node: int, dim: int) -> tuple[np.ndarray, int]:
    rng = np.random.default_rng(node)
    return rng.uniform(-1, 1, dim).astype(np.float32), 1 + node % 7


def _drop_mod(drops: set[int], stage: str, legacy: bool) -> Any:
    def mod(msg: Message, context: Context, call_next: Any) -> Message:
        if msg.metadata.dst_node_id in drops:
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


def legacy_app(dim: int, drops: set[int], stage: str) -> ClientApp:
    return ClientApp(client_fn=lambda context: _Legacy(context.node_id, dim).to_client(),
                     mods=[_drop_mod(drops, stage, legacy=True), secaggplus_mod])


def our_app(dim: int, drops: set[int], stage: str) -> ClientApp:
    # exact sums, as Flower's SecAgg+ computes: the nodes' operators opt in (the default
    # policy takes part in distributed-DP rounds only)
    exact = make_secagg_mod(NodeOptions(policy=SitePolicy(modes=("none",))))
    app = ClientApp(mods=[_drop_mod(drops, stage, legacy=False), exact])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        values, weight = update(context.node_id, dim)
        return Message(RecordDict({"arrays": ArrayRecord({"w": Array(values)}),
                                   "metrics": MetricRecord({"num-examples": weight})}),
                       reply_to=msg)

    return app


class _Timer:
    def __init__(self, grid: LocalGrid) -> None:
        self.grid = grid

    def __enter__(self) -> _Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.client = sum(self.grid.client_cpu.values())
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.wall
        client = sum(self.grid.client_cpu.values()) - self.client
        self.server_cpu = time.process_time() - self.cpu - client
        self.client_cpu = client


def _row(name: str, grid: LocalGrid, timer: _Timer, error: float | None, included: int,
         exact_sum: bool | None) -> dict[str, Any]:
    nodes = len(grid.nodes)
    return {"protocol": name, "completed": error is not None, "included": included,
            "seconds": timer.seconds, "server_cpu": timer.server_cpu,
            "client_cpu_per_node": timer.client_cpu / nodes,
            "bytes_down_per_node": sum(grid.bytes_down.values()) / nodes,
            "bytes_up_per_node": sum(grid.bytes_up.values()) / nodes,
            "max_abs_error": error, "exact_sum": exact_sum}


def _average(nodes: list[int], dim: int) -> np.ndarray:
    total, weight = np.zeros(dim), 0
    for node in nodes:
        values, w = update(node, dim)
        total += w * values.astype(np.float64)
        weight += w
    return total / weight


def run_legacy(n: int, dim: int, k: int, t: int, drop_positions: list[int],
               stage: str) -> dict[str, Any]:
    grid = LocalGrid(None, n)
    grid.record = False
    drops = {grid.nodes[i] for i in drop_positions}
    grid.app = legacy_app(dim, drops, stage)
    captured: list[Any] = []

    class Recording(LegacyFedAvg):  # type: ignore[misc]
        def aggregate_fit(self, *args: Any, **kwargs: Any) -> Any:
            out = super().aggregate_fit(*args, **kwargs)
            captured.append(out[0])
            return out

    strategy = Recording(fraction_evaluate=0.0, min_available_clients=n, min_fit_clients=n,
                         initial_parameters=ndarrays_to_parameters([np.zeros(dim, np.float32)]))
    context = LegacyContext(context=Context(run_id=grid.run.run_id, node_id=0, node_config={},
                                            state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=1), strategy=strategy)
    timer = _Timer(grid)

    class Timed(SecAggPlusWorkflow):  # type: ignore[misc]
        def __call__(self, grid_: Any, context_: Any) -> None:
            with timer:
                super().__call__(grid_, context_)

    DefaultWorkflow(fit_workflow=Timed(num_shares=k, reconstruction_threshold=t))(grid, context)
    included = [node for node in grid.nodes if node not in drops]
    error = None
    if captured and captured[0] is not None:
        (aggregate,) = parameters_to_ndarrays(captured[0])
        error = float(np.max(np.abs(aggregate - _average(included, dim))))
    return _row("Flower legacy SecAgg+", grid, timer, error,
                len(included) if error is not None else 0, None)


def run_ours(n: int, dim: int, drop_positions: list[int], stage: str, dropout_rate: float,
             bits: int, frac_bits: int) -> dict[str, Any]:
    grid = LocalGrid(None, n)
    grid.record = False
    drops = {grid.nodes[i] for i in drop_positions}
    grid.app = our_app(dim, drops, stage)
    timer = _Timer(grid)

    class Timed(SecureAggregation):
        def secure_round(self, grid_: Any, messages: list[Message], timeout: float | None
                         ) -> list[Message]:
            with timer:
                return super().secure_round(grid_, messages, timeout)

    wrapper = Timed(FedAvg(fraction_evaluate=0.0, min_available_nodes=n), dropout_rate=dropout_rate,
                    bits=bits, frac_bits=frac_bits)
    result = wrapper.start(grid, ArrayRecord({"w": Array(np.zeros(dim, np.float32))}),
                           num_rounds=1, timeout=60)
    (report,) = wrapper.reports
    error = exact = None
    if report.total is not None:
        included = sorted(report.included)
        error = float(np.max(np.abs(result.arrays["w"].numpy() - _average(included, dim))))
        from fl.flower.encoding import encode_reply, flatten

        expected = sum(encode_reply(report.setup, flatten(ArrayRecord({"w": Array(
            update(node, dim)[0])}), report.setup.arrays), {}, update(node, dim)[1], None
        ).astype(object) for node in included) % (1 << report.setup.bits)
        exact = bool(np.array_equal(report.total.astype(object), expected))
    return _row(f"secagg adapter ({bits}-bit)", grid, timer, error,
                len(report.included), exact)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--dim", type=int, default=10_000)
    parser.add_argument("--drop-rate", type=float, default=0.1,
                        help="fraction of nodes failing at their masked input")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.getLogger("flwr").setLevel(logging.ERROR)
    logging.getLogger("fl.flower").setLevel(logging.ERROR)
    n, dim = args.nodes, args.dim
    params = secagg_plus_parameters(n, max(args.drop_rate, 0.05), 0.0)
    k = params.neighbors or n
    t = params.threshold
    drops = [round(i * n / max(1, round(args.drop_rate * n))) for i in
             range(round(args.drop_rate * n))]
    rows = []
    for stage, positions in (("masked_input", drops), ("share_keys", [1])):
        for row in (run_legacy(n, dim, k, t, positions, stage),
                    run_ours(n, dim, positions, stage, max(args.drop_rate, 0.05), 64, 24),
                    run_ours(n, dim, positions, stage, max(args.drop_rate, 0.05), 32, 16)):
            row.update(scenario=f"{len(positions)} drop(s) at {stage}", n=n, dim=dim, k=k,
                       t=t)
            rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"n={n} d={dim} k={k} t={t} (secagg_plus_parameters(n, {max(args.drop_rate, 0.05)},"
          " 0)); one run, LocalGrid (Flower serde + Context per message)\n")
    print("| scenario | protocol | completed | s / round | server CPU s | node CPU s | "
          "KB down / node | KB up / node | max abs error | integer sum exact |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        error = "aborted" if r["max_abs_error"] is None else f"{r['max_abs_error']:.1e}"
        exact = {None: "n/a", True: "yes", False: "NO"}[r["exact_sum"]]
        print(f"| {r['scenario']} | {r['protocol']} | {'yes' if r['completed'] else 'no'} | "
              f"{r['seconds']:.2f} | {r['server_cpu']:.2f} | {r['client_cpu_per_node']:.3f} | "
              f"{r['bytes_down_per_node'] / 1024:.0f} | {r['bytes_up_per_node'] / 1024:.0f} | "
              f"{error} | {exact} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
