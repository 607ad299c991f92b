"""What a Flower node keeps between messages (issue 32): its saved ``Context`` after the
setup and share-keys stages (and after masking) is a few KB whatever the model's size, since
the node trains at the masked-input request and keeps no input or masked vector, and the
aggregate is still the exact sum. Through the public runtime: ``SecureAggregation`` over
:class:`fl.flower.local.LocalGrid`, which serialises each node's Context after every
message as a SuperNode does."""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from fl.flower import SecureAggregation
from fl.flower.client import reply_vector
from fl.flower.local import LocalGrid
from fl.flower.records import stage_of
from tests.flower import apps

NODES = 3


def _content(node: int, dim: int) -> RecordDict:
    rng = np.random.default_rng([node, dim])
    return RecordDict({
        "arrays": ArrayRecord({"w": Array(rng.uniform(-1, 1, dim).astype(np.float32))}),
        "metrics": MetricRecord({"num-examples": 1 + node % 5})})


def _app(dim: int, trained: list[int]) -> ClientApp:
    app = ClientApp(mods=[apps.open_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        trained.append(context.node_id)
        return Message(_content(context.node_id, dim), reply_to=msg)

    return app


def _round(dim: int) -> tuple[dict[str, int], Any, int]:
    """One exact-sum round at ``dim``: the largest saved Context (bytes) after each stage's
    message, the round's report, and how many times a node trained."""
    trained: list[int] = []
    grid = LocalGrid(_app(dim, trained), NODES)
    grid.record = False
    largest: dict[str, int] = {}
    deliver = grid.deliver

    def measured(message: Message) -> Message | None:
        stage = stage_of(message) or "other"
        reply = deliver(message)
        size = grid.contexts[message.metadata.dst_node_id].ByteSize()
        largest[stage] = max(largest.get(stage, 0), size)
        return reply

    grid.deliver = measured  # type: ignore[method-assign]
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=NODES),
                                neighbors=None, bits=32, frac_bits=16)
    initial = ArrayRecord({"w": Array(np.zeros(dim, dtype=np.float32))})
    wrapper.start(grid, initial, num_rounds=1, timeout=60)
    (report,) = wrapper.reports
    return largest, report, len(trained)


def test_a_nodes_context_holds_a_few_kb_whatever_the_model_size_and_the_sum_is_exact(
        ) -> None:
    sizes = {}
    for dim in (1_000, 100_000):
        largest, report, trainings = _round(dim)
        sizes[dim] = largest
        assert report.aborted is None and len(report.included) == NODES
        assert trainings == NODES  # each node trained once, at the masked-input request
        expected = sum(reply_vector(report.setup, _content(node, dim), None).astype(object)
                       for node in report.included) % (1 << report.setup.bits)
        assert report.total is not None
        assert report.total.tolist() == [int(v) for v in expected]
    print("largest saved Context bytes after each stage's message:", sizes)
    for dim, largest in sizes.items():
        for stage in ("advertise_keys", "share_keys", "masked_input"):
            assert largest[stage] < 8192, (dim, largest)
    for stage in ("advertise_keys", "share_keys", "masked_input"):
        # independent of d: 100x the model adds no byte of it to the node's state
        assert abs(sizes[100_000][stage] - sizes[1_000][stage]) < 256, sizes
