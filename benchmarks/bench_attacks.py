"""Model replacement against FedAvg, with and without validated secure aggregation: the
seed's attack table (docs/results.md section 4, between its markers).

    python benchmarks/bench_attacks.py [--rounds 8] [--out docs/results.md]

10 hospitals (Flower nodes, the in-process grid of ``fl.flower.local``) hold the bundled
breast cancer set (scikit-learn's Wisconsin diagnostic data, 569 patients, split by patient:
20 % held out, the rest over 10 sites, Dirichlet 1.0 over labels) and train a logistic
regression (5 steps of full-batch gradient descent per round, lr 0.5, features standardised
with the pooled training mean and deviation). Site 10 is malicious: it trains on flipped
labels and scales the row it sends (``[w x, w]``: its model weighted by its patients, the
fixed-point input of weighted FedAvg) by the inverse of its weight share times 10 (the
model-replacement attack of Bagdasaryan et al., AISTATS 2020: its model becomes about 90 %
of the average). The attacker is tests/scaling_site.py's site session, run in each round.

Runs, each from the same initial model, main-task accuracy on the held-out patients after
each round: no attacker (validated secure aggregation); plain FedAvg (Flower's own, the
replies in the clear, the attacker's weight inflated); secure aggregation without a bound;
secure aggregation with ``norm_bound`` (the attacker's proof fails: refused and named every
round); and the same bound with the attacker scaling its row down to exactly the bound (it
passes: bounded, not prevented). The bound is 1.5 times the largest honest row of the first
round.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from sections import write_section  # noqa: E402

from dp.policy import SitePolicy  # noqa: E402
from fl.data import breast_cancer, dirichlet_split, split_patients  # noqa: E402
from fl.flower import NodeOptions, SecureAggregation, make_secagg_mod  # noqa: E402
from fl.flower.local import LocalGrid  # noqa: E402
from fl.site.session import SiteSession  # noqa: E402
from secagg import Client, MaskedStream  # noqa: E402
from secagg.validation import norm  # noqa: E402
from tests.scaling_site import ScalingSession, scale_masked_input, scaling  # noqa: E402

SITES = 10
ATTACKER = SITES - 1  # the partition id of the malicious site
BOOST = 10  # the attacker's row is (total weight / its weight) x BOOST times its own
START, END = "<!-- section: attacks -->", "<!-- end section: attacks -->"
OPEN = SitePolicy(modes=("none", "distributed"))


class Data:
    def __init__(self, seed: int) -> None:
        train, test = split_patients(breast_cancer(), 0.2, seed)
        mean, std = train.x.mean(axis=0), train.x.std(axis=0) + 1e-9
        self.sites = [((t.x - mean) / std, t.y.astype(np.float64))
                      for t in dirichlet_split(train, SITES, 1.0, seed)]
        self.test = ((test.x - mean) / std, test.y)
        self.dim = train.x.shape[1]

    def train(self, site: int, w: np.ndarray, b: float, flip: bool) -> tuple[np.ndarray, float]:
        x, y = self.sites[site]
        y = 1 - y if flip else y
        for _ in range(5):
            p = 1 / (1 + np.exp(-(x @ w + b)))
            w = w - 0.5 * x.T @ (p - y) / len(y)
            b = b - 0.5 * float(np.mean(p - y))
        return w, b

    def accuracy(self, w: np.ndarray, b: float) -> float:
        x, y = self.test
        return float(np.mean(((x @ w + b) > 0).astype(np.int64) == y))


def _arrays(w: np.ndarray, b: float) -> ArrayRecord:
    return ArrayRecord({"w": Array(w.astype(np.float32)),
                        "b": Array(np.array([b], dtype=np.float32))})


def _model(arrays: ArrayRecord) -> tuple[np.ndarray, float]:
    return (arrays["w"].numpy().astype(np.float64), float(arrays["b"].numpy()[0]))


def app(data: Data, mod: Any, inflate: float = 1.0, attack: bool = True) -> ClientApp:
    """Every node trains on its partition; with ``attack`` the attacker on flipped labels
    (and, with ``inflate``, reports that many times its weight: plain FedAvg's
    replacement)."""
    client = ClientApp(mods=[] if mod is None else [mod])

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        site = int(context.node_config["partition-id"])
        w, b = _model(next(iter(msg.content.array_records.values())))
        evil = attack and site == ATTACKER
        w, b = data.train(site, w, b, flip=evil)
        weight = float(len(data.sites[site][1])) * (inflate if evil else 1.0)
        return Message(RecordDict({"arrays": _arrays(w, b),
                                   "metrics": MetricRecord({"num-examples": weight})}),
                       reply_to=msg)

    return client


class InBoundSession(ScalingSession):
    """The attacker that scales its row to exactly the round's bound (it passes)."""

    def answer_with_proof(self, client: Client, payload: bytes, charge: int
                          ) -> tuple[bytes | None, Any]:
        reply = client.stream(payload)
        if not isinstance(reply, MaskedStream):
            return None, reply
        cfg = client.config
        assert cfg.norm_bound is not None
        length = math.sqrt(sum(v * v for v in norm.centered(client._secrets.input, cfg.bits)))
        return scale_masked_input(client, reply, cfg.norm_bound / length * (1 - 1e-9))


def attacker_mod(session_type: type[ScalingSession], scale: float) -> Any:
    class Evil(NodeOptions):
        def session(self, context: Any) -> SiteSession:
            evil = scaling(super().session(context))
            evil.__class__ = session_type
            evil.scale = scale
            return evil

    honest, bad = make_secagg_mod(NodeOptions(policy=OPEN)), make_secagg_mod(Evil(policy=OPEN))

    def mod(msg: Message, context: Context, call_next: Any) -> Message:
        context.node_config.setdefault("secagg-dp", "none")  # the operator's opt-in
        evil = int(context.node_config["partition-id"]) == ATTACKER
        return (bad if evil else honest)(msg, context, call_next)

    return mod


def honest_mod() -> Any:
    mod = make_secagg_mod(NodeOptions(policy=OPEN))

    def wrapped(msg: Message, context: Context, call_next: Any) -> Message:
        context.node_config.setdefault("secagg-dp", "none")
        return mod(msg, context, call_next)

    return wrapped


def run(data: Data, rounds: int, client: ClientApp, secure: dict[str, Any] | None
        ) -> dict[str, Any]:
    grid = LocalGrid(client, SITES)
    grid.record = False
    accuracy: list[float] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        accuracy.append(data.accuracy(*_model(arrays)))
        return MetricRecord({"accuracy": accuracy[-1]})

    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=SITES)
    runner: Any = strategy if secure is None else SecureAggregation(
        strategy, neighbors=None, **secure)
    started = time.perf_counter()
    runner.start(grid, _arrays(np.zeros(data.dim), 0.0), num_rounds=rounds, timeout=600,
                 evaluate_fn=evaluate)
    refused = ([sorted(r.input_refused) for r in runner.reports]
               if secure is not None else [])
    return {"accuracy": accuracy, "seconds": time.perf_counter() - started,
            "refused_rounds": sum(1 for r in refused if r)}


def measure(rounds: int, seed: int) -> dict[str, Any]:
    data = Data(seed)
    sizes = [len(y) for _, y in data.sites]
    share = sizes[ATTACKER] / sum(sizes)
    boost = BOOST / share
    # the operator's bound: 1.5 x the largest honest row [w x, w] after one round
    rows = [n * math.sqrt(float(np.sum(w * w)) + b * b + 1) for n, (w, b) in
            ((len(data.sites[s][1]), data.train(s, np.zeros(data.dim), 0.0, False))
             for s in range(SITES) if s != ATTACKER)]
    bound = round(1.5 * max(rows), 1)
    runs = {
        "no attacker, validated secure aggregation": run(
            data, rounds, app(data, honest_mod(), attack=False), {"norm_bound": bound}),
        "plain FedAvg (Flower, updates in the clear)": run(
            data, rounds, app(data, None, inflate=boost), None),
        "secure aggregation, no bound": run(
            data, rounds, app(data, attacker_mod(ScalingSession, boost)), {}),
        "validated secure aggregation (norm_bound)": run(
            data, rounds, app(data, attacker_mod(ScalingSession, boost)),
            {"norm_bound": bound}),
        "validated, attacker scaled to the bound": run(
            data, rounds, app(data, attacker_mod(InBoundSession, 1.0)),
            {"norm_bound": bound}),
    }
    return {"rounds": rounds, "seed": seed, "bound": bound, "boost": boost,
            "attacker_share": share, "runs": runs}


def render(result: dict[str, Any]) -> str:
    rounds = result["rounds"]
    head = "| run | " + " | ".join(str(r) for r in range(1, rounds + 1)) + " | refused in |"
    lines = [START, "", "## 4. A site that replaces the model (model replacement, 10 sites)",
             "", "Generated by `python benchmarks/bench_attacks.py` (its docstring says what "
             f"runs). Seed {result['seed']}; the attacker holds {result['attacker_share']:.1%}"
             f" of the patients and scales its row by {result['boost']:.0f} (the inverse of "
             f"its weight share times {BOOST}); `norm_bound` = {result['bound']} (1.5 times "
             "the largest honest row of the first round). Main-task accuracy on the held-out "
             "patients after each round:", "", head,
             "|---|" + "---|" * rounds + "---|"]
    for name, run_ in result["runs"].items():
        cells = " | ".join(f"{a:.3f}" for a in run_["accuracy"][1:rounds + 1])
        refused = (f"{run_['refused_rounds']} of {rounds} rounds"
                   if "validated" in name and "no attacker" not in name else "-")
        lines.append(f"| {name} | {cells} | {refused} |")
    lines += ["", "Without a bound the attacker's model replaces the average, whether the "
              "updates are in the clear or masked; with it, the scaled row's proof fails and "
              "the site is left out and named in every round, and the accuracy is the other "
              "sites' model's. An attacker that scales its row to the bound instead is "
              "accepted: its row is then at most the bound, 1.5 times the largest honest "
              "row, so it pulls the model down round by round instead of replacing it "
              "(bounded, not prevented; docs/security.md).", "", END]
    return "\n".join(lines) + "\n"


def write(out: Path, section: str) -> None:
    """Put ``section`` between its markers in ``out`` (appended the first time)."""
    write_section(out, section, START, END)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results.md"))
    args = ap.parse_args()
    # the nodes' ledgers and stage records in a folder of this run, not the user's
    os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="bench-attacks-")
    tempfile.tempdir = os.environ["XDG_STATE_HOME"]
    logging.getLogger("flwr").setLevel(logging.ERROR)
    logging.getLogger("fl.flower").setLevel(logging.ERROR)
    result = measure(args.rounds, args.seed)
    section = render(result)
    print(section)
    for name, run_ in result["runs"].items():
        print(f"{name}: {run_['seconds']:.1f} s", file=sys.stderr)
    write(Path(args.out), section)


if __name__ == "__main__":
    main()
