"""docs/flower.md's own examples, run from the docs' text (issue 27, "One epsilon a user can
trust"): each Python block that configures a node policy or a server is executed as it is
written (a ledger path under /var/lib is moved to the test's folder), against nodes on the
in-process grid (Flower's serde, a Context rebuilt per message), and must train.

The task: each node holds 50 points x ~ N(0, 1) labelled x > 0 and trains a one-weight
logistic model from the arrays sent (its update clipped by DistributedDP). The initial model
(w = 0) predicts one class: accuracy about 0.5; a released round moves w along the sum of
the nodes' clipped updates, so the accuracy is 1 when w > 0. Client-level DP at the docs'
budgets needs many nodes (docs/flower.md): with each default node counting only its own
noise share, one round's noisy sum is 200 +- 4.04 sqrt(200) = 200 +- 57 here, so w <= 0
has probability below 3e-4; the hospital's pair (epsilon 4 over 2 rounds) 200 +- 51.
"""

from __future__ import annotations

import ast
import contextlib
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from dp.ledger import read_charges
from dp.policy import DEFAULT_ROUND_EPSILON
from fl.errors import NothingReleased
from fl.flower.local import LocalGrid

DOC = Path(__file__).resolve().parents[2] / "docs" / "flower.md"
NODES = 200


def block(marker: str) -> str:
    """The docs' Python block containing ``marker`` (exactly one)."""
    found = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
             if marker in b]
    assert len(found) == 1, (marker, len(found))
    return found[0]


def run_block(code: str) -> dict[str, Any]:
    space: dict[str, Any] = {"ClientApp": ClientApp, "FedAvg": FedAvg}
    exec(compile(code, str(DOC), "exec"), space)  # the docs' own code
    return space


def with_task(app: ClientApp) -> ClientApp:
    """The user's train function on the docs' ClientApp."""

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        sent = next(iter(msg.content.array_records.values()))["w"].numpy()
        rng = np.random.default_rng(int(context.node_config["partition-id"]))
        x = rng.standard_normal(50)
        y = (x > 0).astype(np.float64)
        w = float(sent[0])
        for _ in range(5):  # large steps: the update is clipped to the clip norm
            w -= 10.0 * float(np.mean((1 / (1 + np.exp(-w * x)) - y) * x))
        return Message(RecordDict({
            "arrays": ArrayRecord({"w": Array(np.array([w], dtype=np.float32))}),
            "metrics": MetricRecord({"num-examples": 50})}), reply_to=msg)

    return app


def initial() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros(1, dtype=np.float32))})


def accuracy(arrays: ArrayRecord) -> float:
    x = np.random.default_rng(99).standard_normal(2000)
    w = float(arrays["w"].numpy()[0])
    return float(np.mean(((w * x) > 0) == (x > 0)))


def grid(app: ClientApp, n: int, tmp_path: Path) -> LocalGrid:
    """``n`` nodes, each with its own ledger file (its operator's ``secagg-ledger``)."""
    return LocalGrid(app, n, node_config=lambda node: {
        "secagg-ledger": str(tmp_path / f"ledger-{node}.json")})


def ledgers(g: LocalGrid, tmp_path: Path) -> list[list[Any]]:
    return [read_charges(tmp_path / f"ledger-{node}.json") for node in g.nodes]


def test_the_two_line_change_trains_on_default_nodes(tmp_path: Path) -> None:
    """The docs' two-line change against nodes nobody configured: the server plans its
    noise as the nodes charge it, so every node accepts, the model trains, and the epsilon
    the server reports is each node's ledger figure (before: every round refused on
    [round_epsilon], NothingReleased)."""
    space = run_block(block("app = ClientApp(mods=[secagg_mod])"))
    strategy = space["strategy"]
    g = grid(with_task(space["app"]), NODES, tmp_path)
    assert accuracy(initial()) < 0.6
    result = strategy.start(g, initial(), num_rounds=1, timeout=60)
    (report,) = strategy.reports
    assert report.aborted is None and len(report.included) == NODES and not report.refused
    assert accuracy(result.arrays) > 0.95
    assert report.epsilon is not None and report.epsilon == report.node_epsilon
    assert 0 < report.epsilon <= DEFAULT_ROUND_EPSILON  # the default node's cap per round
    for charges in ledgers(g, tmp_path):
        (charge,) = charges
        assert charge.epsilon_after == pytest.approx(report.epsilon, rel=1e-9)


def test_the_hospital_policy_and_its_server_train(tmp_path: Path) -> None:
    code = block("min_noise_multiplier=0.5, min_threshold=5")
    assert 'ledger="/var/lib/secagg/ledger.json"' in code  # each node's, moved to tmp_path
    space = run_block(code.replace("/var/lib/secagg/ledger.json",
                                   str(tmp_path / "app-ledger.json")))
    strategy, policy = space["strategy"], space["policy"]
    g = grid(with_task(space["app"]), NODES, tmp_path)
    result = strategy.start(g, initial(), num_rounds=1, timeout=60)
    (report,) = strategy.reports
    assert report.aborted is None and len(report.included) == NODES and not report.refused
    assert report.setup.threshold >= policy.min_threshold
    assert accuracy(result.arrays) > 0.95
    for charges in ledgers(g, tmp_path):
        (charge,) = charges
        assert charge.epsilon_after == pytest.approx(report.epsilon, rel=1e-9)
    assert report.epsilon is not None and report.epsilon < policy.epsilon


@pytest.mark.parametrize(("n", "rule"), [(10, "min_threshold"), (30, "budget")])
def test_the_hospital_nodes_refuse_the_two_line_server_naming_the_rule(
        n: int, rule: str, tmp_path: Path) -> None:
    """What docs/flower.md says of the mismatched pair: below about 30 nodes SecAgg+'s
    threshold is under the hospital's min_threshold; above, the epsilon-8 plan passes the
    hospital's epsilon 4 at delta 1e-6 within three rounds."""
    nodes = run_block(block("min_noise_multiplier=0.5, min_threshold=5").replace(
        "/var/lib/secagg/ledger.json", str(tmp_path / "app-ledger.json")))
    server = run_block(block("app = ClientApp(mods=[secagg_mod])"))["strategy"]
    g = grid(with_task(nodes["app"]), n, tmp_path)
    with contextlib.suppress(NothingReleased):  # the 10-node run releases nothing
        server.start(g, initial(), num_rounds=3, timeout=60)
    refusals = [r for report in server.reports for r in report.refused.values()]
    assert refusals and all(f"[{rule}]" in r for r in refusals), refusals[:3]


def test_an_apps_own_opt_in_does_not_open_exact_sums(tmp_path: Path) -> None:
    """The docs' app-side "opt-in" (NodeOptions.policy) only tightens the node's policy:
    an exact-sum server, ``SecureAggregation(FedAvg())`` as the docs name it, is refused by
    every node naming [exact-release], nothing trained."""
    from fl.flower import SecureAggregation

    assert "`SecureAggregation(FedAvg())`" in DOC.read_text()
    space = run_block(block('SitePolicy(modes=("none", "distributed"))'))
    g = grid(with_task(space["app"]), 3, tmp_path)
    strategy = SecureAggregation(FedAvg())
    with pytest.raises(NothingReleased, match=r"\[exact-release\] 3"):
        strategy.start(g, initial(), num_rounds=1, timeout=60)
    assert all(charges == [] for charges in ledgers(g, tmp_path))


def test_the_readmes_flower_lines_are_the_docs_two_lines() -> None:
    """README.md's Flower example is the two-line change tested above, statement for
    statement (so the README's pair trains as the docs' does)."""

    def assignments(code: str) -> list[str]:
        return [ast.dump(node) for node in ast.parse(code).body if isinstance(node, ast.Assign)]

    readme = [b for b in re.findall(r"```python\n(.*?)```",
                                    (DOC.parents[1] / "README.md").read_text(), re.S)
              if "secagg_mod" in b]
    assert len(readme) == 1
    docs = assignments(block("app = ClientApp(mods=[secagg_mod])"))
    assert len(docs) == 2 and assignments(readme[0]) == docs
