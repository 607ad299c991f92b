"""The adapter as a Flower user finds it: a strategy that needs each node's update is refused
with the reason, drops show in Flower's own log, and a silent node costs a stage at most the
stage timeout (not Flower's 3,600 s round timeout)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from flwr.app import Message
from flwr.serverapp import strategy as flower

from fl.flower import SecureAggregation
from fl.flower.local import LocalGrid
from fl.flower.server import DEFAULT_STAGE_TIMEOUT
from tests.flower import apps

REFUSED: list[tuple[Callable[[], Any], str]] = [
    (flower.FedMedian, "median"),
    (flower.Krum, "distances between node updates"),
    (flower.MultiKrum, "distances between node updates"),
    (flower.Bulyan, "trimmed mean"),
    (flower.FedTrimmedAvg, "trimmed mean"),
    (lambda: flower.QFedAvg(client_learning_rate=0.1), "loss"),
    (flower.FedXgbBagging, "trees"),
    (lambda: flower.DifferentialPrivacyServerSideFixedClipping(
        flower.FedAvg(), noise_multiplier=1.0, clipping_norm=1.0, num_sampled_clients=4),
     "clip it at the server"),
    (lambda: flower.DifferentialPrivacyClientSideFixedClipping(  # the wrapped one counts
        flower.FedMedian(), noise_multiplier=1.0, clipping_norm=1.0, num_sampled_clients=4),
     "median"),
]


@pytest.mark.parametrize("make, why", REFUSED)
def test_a_strategy_that_needs_each_nodes_update_is_refused_with_the_reason(
        make: Callable[[], Any], why: str) -> None:
    with pytest.raises(ValueError, match=f"needs .*{why}.*silently train a mean"):
        SecureAggregation(make())


@pytest.mark.parametrize("make", [flower.FedAvg, flower.FedProx, flower.FedAvgM,
                                  flower.FedAdam, flower.FedAdagrad, flower.FedYogi])
def test_strategies_whose_rule_applies_to_the_aggregate_are_accepted(
        make: Callable[[], Any]) -> None:
    SecureAggregation(make())


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_drops_are_reported_in_flowers_log() -> None:
    grid = LocalGrid(None, 8)
    drops = {grid.nodes[1]: "share_keys", grid.nodes[4]: "unmasking"}
    grid.app = apps.client_app(lambda node, r, roster: drops.get(node))
    wrapper = SecureAggregation(flower.FedAvg(fraction_evaluate=0.0, min_available_nodes=8),
                                neighbors=None)
    recorder = Recorder()
    logger = logging.getLogger("flwr")
    # earlier tests' simulations (ray) may leave Flower's logger disabled or quieter than
    # Flower's own INFO default: restore what a Flower app runs with
    saved = logger.disabled, logger.level
    logger.disabled = False
    logger.setLevel(logging.INFO)
    logger.addHandler(recorder)
    try:
        wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    finally:
        logger.removeHandler(recorder)
        logger.disabled, logger.level = saved
    (report,) = wrapper.reports
    assert report.dropped == drops
    lines = [r.getMessage() for r in recorder.records if r.levelno == logging.WARNING]
    assert any("secure aggregation round 1: 7 of 8 nodes in the sum, 2 dropped" in line
               and f"share_keys: 1 (nodes [{grid.nodes[1]}])" in line
               and f"unmasking: 1 (nodes [{grid.nodes[4]}])" in line for line in lines), lines


class TimedGrid(LocalGrid):
    """Records the timeout of every exchange."""

    timeouts: list[float | None]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        self.timeouts.append(timeout)
        return super().send_and_receive(messages, timeout=timeout)


def test_a_silent_node_holds_a_stage_for_the_stage_timeout_not_the_round_timeout() -> None:
    grid = TimedGrid(None, 5)
    grid.timeouts = []
    grid.app = apps.client_app()
    grid.silent = lambda node, msg: node == grid.nodes[0] and apps.stage_of(msg) != \
        "advertise_keys"
    wrapper = SecureAggregation(flower.FedAvg(fraction_evaluate=0.0, min_available_nodes=5),
                                neighbors=None)
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=3600)
    assert wrapper.reports[0].dropped == {grid.nodes[0]: "share_keys"}
    # the masked-input request (the nodes train at it) waits for Flower's round timeout
    assert grid.timeouts[2] == 3600
    # the other secure-aggregation stages wait for the stage timeout
    assert grid.timeouts[:2] + grid.timeouts[3:4] == [DEFAULT_STAGE_TIMEOUT] * 3
    assert DEFAULT_STAGE_TIMEOUT <= 120


def test_node_directories_of_earlier_runs_are_removed_once_stale() -> None:
    """Flower's simulation draws new node ids every run, so the default stage directory
    gained one directory per node per run: a node joining a round removes the other nodes'
    directories untouched for a day (their records under their lock), and keeps the rest."""
    import os
    import time

    from fl.flower.guard import STALE_AFTER, default_base, hold

    base = default_base()
    old, recent = base / "node-1", base / "node-2"
    for directory in (old, recent):
        with hold(directory, b"\x07" * 32, 1) as record:
            record.join_round(0, b"advertisement")
    then = time.time() - STALE_AFTER - 60
    for path in (*old.iterdir(), old):
        os.utime(path, (then, then))
    grid = LocalGrid(None, 4)
    grid.app = apps.client_app()
    wrapper = SecureAggregation(flower.FedAvg(fraction_evaluate=0.0, min_available_nodes=4),
                                neighbors=None)
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    assert wrapper.reports[0].aborted is None
    assert not old.exists() and len(list(recent.iterdir())) == 1
    assert all((base / f"node-{node}").is_dir() for node in grid.nodes)


def test_a_torch_models_flower_layout_is_its_parameter_layout() -> None:
    """One layout (fl.vector): the Flower round's layout of a model's ArrayRecord is the
    model's ParameterLayout, and both flatten it to the same vector."""
    torch = pytest.importorskip("torch")
    from flwr.app import ArrayRecord

    from fl.flower.encoding import flatten, layout_of
    from fl.vector import ParameterLayout

    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(),
                                torch.nn.Linear(3, 2).to(torch.float64))
    record = ArrayRecord(model.state_dict())
    layout = ParameterLayout.of(model)
    assert layout_of(record) == layout.arrays().specs
    assert [s.dtype for s in layout.arrays().specs] == ["float32"] * 2 + ["float64"] * 2
    vector = layout.to_vector(model)
    assert (flatten(record, layout.arrays().specs) == vector).all()
    restored = layout.arrays().unflatten(vector)
    assert all((restored[k] == v.numpy()).all() for k, v in model.state_dict().items())
