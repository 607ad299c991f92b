"""Deterministic Flower apps for the adapter tests (simulation, in-process and deployment).

A node's train reply is a fixed function of its node id and the server round, so a test
can compute the plaintext sum every securely aggregated round must equal. ``dropping``
nodes raise (Flower turns that into an error reply) at the stage a seeded plan picks.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl.flower import RoundReport, RoundSetup, secagg_mod
from fl.flower.client import reply_vector
from fl.flower.records import RECORD, SETUP, stage_of

SHAPES = {"w": (3, 4), "b": (4,)}
STAGES = ("advertise_keys", "share_keys", "masked_input", "unmasking")
EXCLUDING = ("advertise_keys", "share_keys", "masked_input")  # no masked input: not summed
DropPlan = Callable[[int, int], str | None]


def initial_arrays() -> ArrayRecord:
    return ArrayRecord({k: Array(np.zeros(s, dtype=np.float32)) for k, s in SHAPES.items()})


def reply_content(node_id: int, server_round: int) -> RecordDict:
    rng = np.random.default_rng([node_id, server_round])
    arrays = {k: rng.uniform(-1, 1, s).astype(np.float32) for k, s in SHAPES.items()}
    metrics = {"num-examples": 1 + node_id % 7,
               "train_loss": float(rng.uniform(0, 2))}
    return RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                       "metrics": MetricRecord(metrics)})


def random_drops(rate: float, seed: int, stages: Iterable[str] = STAGES) -> DropPlan:
    """Each node drops in a round with probability ``rate``, at a random stage."""
    choices = tuple(stages)

    def plan(node_id: int, server_round: int) -> str | None:
        rng = random.Random(f"{seed}|{node_id}|{server_round}")
        return rng.choice(choices) if rng.random() < rate else None

    return plan


def round_of(msg: Message) -> int:
    record = msg.content.config_records.get(RECORD)
    if record is not None and SETUP in record:
        return RoundSetup.from_bytes(record[SETUP]).server_round
    return int(msg.metadata.group_id)


class Dropout(RuntimeError):
    """A planned dropout."""


def dropout_mod(plan: DropPlan) -> Any:
    def mod(msg: Message, context: Context, call_next: Any) -> Message:
        stage = stage_of(msg) if msg.metadata.message_type == "train" else None
        if stage is not None and plan(msg.metadata.dst_node_id, round_of(msg)) == stage:
            raise Dropout(f"node {msg.metadata.dst_node_id} drops in {stage}")
        return call_next(msg, context)

    return mod


def client_app(plan: DropPlan | None = None, mods: list[Any] | None = None) -> ClientApp:
    app = ClientApp(mods=[dropout_mod(plan or (lambda n, r: None)),
                          *(mods if mods is not None else [secagg_mod])])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        server_round = int(msg.content["config"]["server-round"])
        return Message(reply_content(context.node_id, server_round), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1,
                                                            "eval_loss": 0.5})}),
                       reply_to=msg)

    return app


def expected_total(report: RoundReport) -> np.ndarray:
    """The plaintext sum mod 2**bits of the included nodes' inputs."""
    setup = report.setup
    total = np.zeros(0, dtype=object)
    for node in sorted(report.included):
        vector = reply_vector(setup, reply_content(node, setup.server_round), None)
        total = vector.astype(object) if total.size == 0 else total + vector.astype(object)
    return (total % (1 << setup.bits)).astype(np.uint64)


def expected_included(report: RoundReport, plan: DropPlan) -> frozenset[int]:
    return frozenset(node for node in report.setup.roster
                     if plan(node, report.server_round) not in EXCLUDING)


def weighted_average(nodes: Iterable[int], server_round: int) -> dict[str, np.ndarray]:
    total: dict[str, np.ndarray] = {}
    weight = 0.0
    for node in nodes:
        content = reply_content(node, server_round)
        w = float(content["metrics"]["num-examples"])
        weight += w
        for k, a in content["arrays"].items():
            total[k] = total.get(k, 0) + w * a.numpy().astype(np.float64)
    return {k: v / weight for k, v in total.items()}


def report_to_json(report: RoundReport) -> dict[str, Any]:
    return {"setup": report.setup.to_bytes().hex(), "included": sorted(report.included),
            "dropped": {str(k): v for k, v in report.dropped.items()},
            "total": None if report.total is None else [int(v) for v in report.total],
            "aborted": report.aborted, "seconds": report.seconds}


def report_from_json(data: dict[str, Any]) -> RoundReport:
    total = data["total"]
    return RoundReport(RoundSetup.from_bytes(bytes.fromhex(data["setup"])),
                       included=frozenset(data["included"]),
                       dropped={int(k): v for k, v in data["dropped"].items()},
                       total=None if total is None else np.array(total, dtype=np.uint64),
                       aborted=data["aborted"], seconds=data["seconds"])
