"""Deterministic Flower apps for the adapter tests (simulation, in-process and deployment).

A node's train reply is a fixed function of its node id and the server round, so a test
can compute the plaintext sum every securely aggregated round must equal. ``dropping``
nodes raise (Flower turns that into an error reply) at the stage a plan picks. A plan is a
function of the node id, the server round and the round's roster (Flower draws node ids at
random, so a plan that must hit every stage picks nodes by their position in the roster).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from dp.policy import SitePolicy
from fl.flower import NodeOptions, RoundReport, RoundSetup, make_secagg_mod
from fl.flower.client import reply_vector
from fl.flower.records import RECORD, SETUP, stage_of

SHAPES = {"w": (3, 4), "b": (4,)}
STAGES = ("advertise_keys", "share_keys", "masked_input", "unmasking")
EXCLUDING = ("advertise_keys", "share_keys", "masked_input")  # no masked input: not summed
DropPlan = Callable[[int, int, Sequence[int]], str | None]  # (node, round, roster) -> stage
PLANNED = "test-planned-drop"  # the node's planned stage for the current round, in its state
OPEN = SitePolicy(modes=("none", "distributed"))
"""A node operator's opt-in to exact sums besides distributed DP (the default policy
takes part in distributed-DP rounds only, as ``secagg train --role site`` does)."""

LOOSE = SitePolicy(modes=("none", "distributed"), min_noise_multiplier=0.0, epsilon=None,
                   round_epsilon=None)
"""An operator who sets no noise floor and no budget (explicitly: ``SitePolicy()`` has
both): for tests of the protocol's arithmetic at small noise, not of the node's policy."""


def operated(mod: Any = None, policy: SitePolicy | None = OPEN) -> Any:
    """``mod`` (default: the secagg mod with default options) on a node whose *operator*
    set ``policy`` in its node config (``secagg-policy``, a file), as a hospital does with
    ``flower-supernode --node-config``: the app's own ``NodeOptions.policy`` can only
    tighten it. The file is written under the test's temporary folder."""
    inner = mod or make_secagg_mod(NodeOptions())
    text = json.dumps(None if policy is None else policy.to_json())
    name = f"operator-policy-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"

    def wrapped(msg: Message, context: Context, call_next: Any) -> Message:
        if policy is not None and "secagg-policy" not in context.node_config:
            path = Path(tempfile.gettempdir()) / name
            if not path.exists():
                path.write_text(text)
            context.node_config["secagg-policy"] = str(path)
        return inner(msg, context, call_next)

    return wrapped


open_mod = operated()


def unreleased(start: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """``start(*args, **kwargs)`` (a ``SecureAggregation.start``) of a run in which no round
    releases anything: it must raise :class:`fl.errors.NothingReleased`; its one line."""
    import pytest

    from fl.errors import NothingReleased

    with pytest.raises(NothingReleased) as caught:
        start(*args, **kwargs)
    return str(caught.value)


def initial_arrays() -> ArrayRecord:
    return ArrayRecord({k: Array(np.zeros(s, dtype=np.float32)) for k, s in SHAPES.items()})


def reply_content(node_id: int, server_round: int) -> RecordDict:
    rng = np.random.default_rng([node_id, server_round])
    arrays = {k: rng.uniform(-1, 1, s).astype(np.float32) for k, s in SHAPES.items()}
    metrics = {"num-examples": 1 + node_id % 7,
               "train_loss": float(rng.uniform(0, 2))}
    return RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                       "metrics": MetricRecord(metrics)})


def ranked_drops(per_stage: int, seed: int, stages: Iterable[str] = STAGES) -> DropPlan:
    """In every round, ``per_stage`` nodes drop at each stage; which nodes is a seeded draw of
    positions in the roster (so every stage is hit whatever node ids Flower assigns)."""
    choices = tuple(stages)

    def plan(node_id: int, server_round: int, roster: Sequence[int]) -> str | None:
        ranked = sorted(roster)
        if node_id not in ranked:
            return None
        picked = random.Random(f"{seed}|{server_round}").sample(
            range(len(ranked)), per_stage * len(choices))
        position = ranked.index(node_id)
        return choices[picked.index(position) % len(choices)] if position in picked else None

    return plan


class Dropout(RuntimeError):
    """A planned dropout."""


def dropout_mod(plan: DropPlan) -> Any:
    """Raise at the planned stage. The round's first message carries its setup (and roster):
    the node works out its plan then and keeps it in its state for the later stages."""
    def mod(msg: Message, context: Context, call_next: Any) -> Message:
        if msg.metadata.message_type != "train":
            return call_next(msg, context)
        record = msg.content.config_records.get(RECORD)
        if record is not None and SETUP in record:
            setup = RoundSetup.from_bytes(record[SETUP])
            planned = plan(msg.metadata.dst_node_id, setup.server_round, setup.roster)
            context.state[PLANNED] = ConfigRecord({"stage": planned or ""})
        stage = stage_of(msg)
        saved = context.state.config_records.get(PLANNED)
        if stage is not None and saved is not None and saved["stage"] == stage:
            raise Dropout(f"node {msg.metadata.dst_node_id} drops in {stage}")
        return call_next(msg, context)

    return mod


def client_app(plan: DropPlan | None = None, mods: list[Any] | None = None) -> ClientApp:
    app = ClientApp(mods=[dropout_mod(plan or (lambda n, r, roster: None)),
                          *(mods if mods is not None else [open_mod])])

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
                     if plan(node, report.server_round, report.setup.roster) not in EXCLUDING)


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


RAY_REGISTER_SECONDS = 600
"""How long Ray's raylet waits for a worker process (a simulation actor) to register:
``worker_register_timeout_seconds``, 60 s by default in ray 2.55, a setting
(``_system_config`` or ``RAY_worker_register_timeout_seconds``). A loaded host starts
Python slowly, and the test's own deadlines are logical (the strategy's stage timeouts)."""

RAY_STARTS = 3
"""Attempts at Ray's node start-up. How long ``ray.init`` waits for its raylet to register
with the GCS is not a setting: 30 s, a literal in ``ray/_private/node.py`` (ray 2.55.1),
past which it raises "The current node timed out during startup"; that failed the 50-node
simulation once at load 13. The start-up is retried; the simulation itself is not."""


def simulate(server: Any, client: ClientApp, num_supernodes: int) -> None:
    """``flwr.simulation.run_simulation`` on Ray with two CPUs, Ray started here first (Flower
    keeps a running Ray and starts its own only when none runs: flwr 1.42's RayBackend)
    with the registration wait and the start-up attempts above; Flower shuts Ray down."""
    import ray
    from flwr.simulation import run_simulation

    # as Flower's RayBackend.init_ray passes it: the actors import what this process can
    pythonpath = os.pathsep.join([*sys.path, os.environ.get("PYTHONPATH", "")])
    for attempt in range(1, RAY_STARTS + 1):
        try:
            ray.init(num_cpus=2, include_dashboard=False,
                     runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
                     _system_config={"worker_register_timeout_seconds": RAY_REGISTER_SECONDS})
            break
        except Exception as exc:  # ray raises a bare Exception for this
            ray.shutdown()
            if attempt == RAY_STARTS or "timed out during startup" not in str(exc):
                raise
    assert ray.is_initialized()
    run_simulation(server, client, num_supernodes=num_supernodes,
                   backend_config={"client_resources": {"num_cpus": 1}})
