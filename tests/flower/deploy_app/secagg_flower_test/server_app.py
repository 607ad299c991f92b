"""The test ServerApp: FedAvg under SecureAggregation; writes every round report as JSON
to the run config's ``report-path`` for the test to check."""

from __future__ import annotations

import json
import time

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fl.flower import SecureAggregation
from tests.flower import apps

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    nodes = int(context.run_config["num-nodes"])
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_train_nodes=nodes,
                                       min_available_nodes=nodes),
                                neighbors=None, metrics=("train_loss",), stage_timeout=90,
                                # 3 elements per chunk: each masked input crosses
                                # Flower's gRPC transport as 6 ArrayRecord entries
                                chunk_bytes=24)
    started = time.perf_counter()
    result = wrapper.start(grid, apps.initial_arrays(),
                           num_rounds=int(context.run_config["num-server-rounds"]),
                           timeout=90)
    out = {"seconds": time.perf_counter() - started,
           "arrays": {k: v.numpy().tolist() for k, v in result.arrays.items()},
           "reports": [apps.report_to_json(r) for r in wrapper.reports]}
    with open(str(context.run_config["report-path"]), "w") as f:
        json.dump(out, f)
