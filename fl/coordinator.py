"""The coordinator: a cohort per round, one secure aggregation, decode, update, evaluate.

Per round (McMahan et al. 2017, FedAvg, with the privacy modes of docs/privacy.md):

1. draw the cohort (seeded: public) and ask the budget whether the round fits; the round
   that would exceed it is not run and training stops (docs/architecture.md section 6).
   Otherwise its cost is spent and checkpointed *before* aggregation (write-ahead: a crash
   after unmasking never leaves a released round uncounted);
2. every cohort site computes its update and encodes it with its sample count
   (:mod:`fl.codec`); only that vector goes to secure aggregation (:mod:`fl.aggregation`);
3. if the protocol aborts (fewer than ``threshold`` sites survived) the round is retried with
   fresh inputs: nothing was released, so the one charge covers the retries;
4. decode the sum, average, update the global model, evaluate on the held-out set, write
   a checkpoint.

In simulation the coordinator can also see every site's encoded input (they live in this
process), and with ``verify`` it checks each aggregate against the plaintext modular sum of
the included inputs. A real coordinator cannot: that is the point of secure aggregation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dp import MODE_NONE, PrivacyBudget, event_to_json
from fl import checkpoint as ckpt
from fl.aggregation import AggregateOutcome, Aggregator
from fl.contribution import (
    Decoder,
    RoundTask,
    adapt_clip,
    decoder,
    round_task,
    secagg_bound,
    site_input,
)
from fl.plan.privacy import (
    DistributedPlan,
    Plan,
    make_budget,
    release_record,
    restore_budget,
)
from fl.progress import Progress
from fl.settings import TrainSettings
from fl.site.training import Site
from fl.strategies import ServerStrategy
from fl.vector import ParameterLayout
from secagg import Config, ProtocolAbort, Stage

from .errors import FLError

U64 = npt.NDArray[np.uint64]
DROP_STAGES = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASKING)


class AggregateMismatch(FLError, RuntimeError):
    """The secure aggregate differs from the plaintext sum of the included inputs."""


STALLED = 1e-6
"""A round whose step is at most this share of the model's norm did not move it (a zero sum
decodes to the fixed-point encoding's rounding, ~1e-6 in norm for 6,000 parameters): the log
says so (``step_norm`` in every round's report row), never silently."""
STALLED_TEXT = ("the sites' summed update is (nearly) zero. Verified aggregates mean it was "
                "not lost on the way: the sites' local training fits their data exactly (with "
                "far more parameters than records a softmax saturates in float32 and its "
                "gradient becomes exactly 0), so rounds repeat the same model; lower --lr or "
                "--local-epochs, or use fewer features")


class RoundFailed(FLError, RuntimeError):
    """A round aborted ``max_attempts`` times in a row (too many dropouts)."""


@dataclass
class RoundCapture:
    """What a round put into secure aggregation (for tests and verification)."""

    round: int
    config: Config
    inputs: dict[int, U64]
    total: U64
    included: frozenset[int]
    counts: dict[int, int] = field(default_factory=dict)


@dataclass
class Aggregated:
    """A round's secure aggregation: the outcome and how to decode it.

    ``inputs`` are the sites' encoded vectors when the coordinator can know them
    (simulation, or sites that opted into ``--insecure-verify``), else None.
    """

    outcome: AggregateOutcome
    config: Config
    inputs: dict[int, U64] | None
    decode: Callable[[U64, int], tuple[Any, float]]
    counts: dict[int, int]
    attempts: int


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Accuracy and mean cross-entropy on a held-out set."""
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = float(torch.nn.functional.cross_entropy(logits, y))
        acc = float((logits.argmax(dim=1) == y).float().mean())
    return acc, loss


Evaluator = Callable[[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]], dict[str, Any]]
"""``(model, test set) -> metrics`` of a round's row (``loss`` and ``accuracy`` or
``c_index``, ...)."""


def classification_metrics(model: torch.nn.Module,
                           test: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    acc, loss = evaluate(model, *test)
    return {"accuracy": acc, "loss": loss}


def drop_schedule(cohort: list[int], rate: float, seed: int, round_number: int,
                  attempt: int) -> dict[int, Stage]:
    """Each cohort site drops with probability ``rate`` at a uniformly random stage.

    Simulation only (seeded, public): which hospital's server crashes when.
    """
    rng = np.random.default_rng([seed, 0xD209, round_number, attempt])
    drops = {}
    for cid in cohort:
        if rng.random() < rate:
            drops[cid] = DROP_STAGES[int(rng.integers(len(DROP_STAGES)))]
    return drops


class Coordinator:
    """Runs the rounds of one training; see the module docstring."""

    def __init__(self, settings: TrainSettings, model: torch.nn.Module, sites: Mapping[int, Site],
                 test: tuple[torch.Tensor, torch.Tensor] | None, plan: Plan,
                 aggregator: Aggregator,
                 *, scaler: dict[str, list[float]] | None = None,
                 log: Callable[[str], None] | None = None,
                 on_capture: Callable[[RoundCapture], None] | None = None,
                 evaluator: Evaluator | None = None) -> None:
        self.settings = settings
        self.model = model
        self.layout = ParameterLayout.of(model)
        self.sites = dict(sites)
        self.site_ids = sorted(self.sites)
        self.test = test
        self.plan = plan
        self.aggregator = aggregator
        self.scaler = scaler
        self.log = log or (lambda text: None)
        self.on_capture = on_capture
        self.strategy = ServerStrategy.of(settings, self.layout.size)
        self.evaluator = evaluator or classification_metrics
        self.controls: dict[int, Any] = {}
        """SCAFFOLD: each site's proposed control variate of the round being aggregated."""
        self.history: list[dict[str, Any]] = []
        self.progress = Progress(settings.rounds)
        self.events: list[dict[str, Any]] = []
        self.round = 0
        self.stopped: str | None = None
        self.charged: int | None = None
        """The round whose cost is written ahead and that has not completed yet."""
        self.clipper = plan.clipper() if isinstance(plan, DistributedPlan) else None
        """Distributed DP with ``--adaptive-clip``: the clip's state, moved by each round's
        noised count only (:func:`fl.contribution.adapt_clip`)."""
        self.weights: dict[int, float] | None = None
        self.weight_units: float | None = None
        """``--site-weights``: each site's weight and the noised patient count, both from
        the DP releases (:func:`fl.plan.weights.release_and_weigh`)."""
        self.releases: list[dict[str, Any]] = []
        """Audit records of releases made before the rounds (the site weights')."""
        self.budget: PrivacyBudget | None = None
        if plan.mode != MODE_NONE:  # always accounted; capped only by --epsilon
            self.budget = make_budget(settings.epsilon, settings.delta,
                                      settings.release_accountant)
        cohort = settings.cohort_size
        self.secagg = Config(num_clients=cohort, dim=1, bits=64, security=settings.security)
        self.threshold = self.secagg.threshold

    # -- checkpoints ---------------------------------------------------------------------
    def restore(self, saved: ckpt.Checkpoint) -> None:
        ckpt.check_fingerprint(saved.fingerprint, self.settings.fingerprint())
        try:
            self.model.load_state_dict(saved.model)
        except RuntimeError as exc:  # missing/unexpected keys or shapes
            raise ckpt.CheckpointError(f"the checkpoint's model does not fit: {exc}") from None
        self.round = saved.round
        self.history = list(saved.history)
        self.events = list(saved.events)
        self.stopped = saved.stopped
        if saved.server is not None:
            try:
                self.strategy.restore(saved.server)
            except ValueError as exc:
                raise ckpt.CheckpointError(str(exc)) from None
        if saved.charged is not None and saved.charged > saved.round:
            self.log(f"round {saved.charged} was charged to the privacy budget but did not "
                     "complete before the run stopped: its charge stays, and running it again "
                     "charges it again (conservative)")
        if self.budget is not None:
            self.budget = restore_budget(self.settings.epsilon, self.settings.delta,
                                         self.events, self.settings.release_accountant)

    def save(self) -> None:
        if self.settings.checkpoint is None:
            return
        ckpt.save(self.settings.checkpoint, ckpt.Checkpoint(
            round=self.round, model=self.model.state_dict(),
            fingerprint=self.settings.fingerprint(), history=self.history,
            events=self.events, scaler=self.scaler, stopped=self.stopped,
            server=self.strategy.state(), charged=self.charged))

    # -- training ------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        """Rounds ``round + 1 .. settings.rounds``; stops early when the budget is spent."""
        self.progress = Progress(self.settings.rounds, self.round)
        while self.round < self.settings.rounds and self.stopped is None:
            if not self.run_round(self.round + 1):
                break
        return self.history

    def cohort(self, round_number: int) -> list[int]:
        ids = self.site_ids
        if self.settings.cohort_size == len(ids):
            return list(ids)
        rng = np.random.default_rng([self.settings.seed, 0xC0, round_number])
        return sorted(int(c) for c in rng.choice(ids, self.settings.cohort_size, replace=False))

    def run_round(self, r: int) -> bool:
        """Run round ``r``; False if the budget does not afford it (it is then not run)."""
        s = self.settings
        event = self.plan.event()
        if self.budget is not None and event is not None and not self.budget.can_run(event):
            after = self.budget.epsilon_after(event)
            self.stopped = (f"round {r} not run: it would bring epsilon to {after:.4g} > "
                            f"budget {self.budget.epsilon:g} (spent "
                            f"{self.budget.spent[0]:.4g} after {r - 1} rounds)")
            self.log(f"budget spent: {self.stopped}")
            self.save()
            return False
        started = time.perf_counter()
        cohort = self.cohort(r)
        spent_before = self.budget.spent[0] if self.budget is not None else None
        if self.budget is not None and event is not None:
            # Write-ahead: the round's cost is on record (checkpoint) before any sum can be
            # released; a crash after unmasking cannot leave it uncounted.
            self.budget.spend(event)
            self.events.append(event_to_json(event))
            self.charged = r
            self.save()
        done = self._aggregate(r, cohort)
        outcome, config, inputs = done.outcome, done.config, done.inputs
        correct = None
        if s.verify and inputs is not None and outcome.included <= set(inputs):
            expected = np.zeros(config.dim, dtype=np.uint64)
            for cid in outcome.included:
                np.add(expected, inputs[cid], out=expected)  # wraps mod 2**64
            if config.bits < 64:
                expected &= np.uint64((1 << config.bits) - 1)
            correct = bool(np.array_equal(expected, outcome.total))
            if not correct:
                raise AggregateMismatch(f"round {r}: the secure aggregate differs from the "
                                        "plaintext sum of the included sites' inputs")
        if self.on_capture is not None and inputs is not None:
            self.on_capture(RoundCapture(r, config, inputs, outcome.total, outcome.included,
                                         done.counts))
        update, count = done.decode(outcome.total, len(outcome.included))
        clip = None
        if self.clipper is not None:  # the server's only input: the round's noised sums
            assert isinstance(self.plan, DistributedPlan)  # the only plan with a clipper
            clip = self.clipper.clip_norm
            units = (count if self.weight_units is None
                     else self.weight_units * self.plan.sample_rate)
            adapt_clip(self.clipper, outcome.total, len(outcome.included), units)
        before = self.layout.to_vector(self.model)
        vector = self.strategy.step(before, update)
        self.layout.load(self.model, vector)
        moved = float(np.linalg.norm(vector - before))
        if moved <= STALLED * max(float(np.linalg.norm(before)), 1.0):
            self.log(f"warning: round {r} did not move the model (its step has norm "
                     f"{moved:.3g}): {STALLED_TEXT}")
        for cid in outcome.included:  # SCAFFOLD: only an included site's c_k moved c
            if self.controls.get(cid) is not None:
                self.sites[cid].commit_control(self.controls[cid])
        epsilon, delta = self.budget.spent if self.budget is not None else (None, None)
        metrics: dict[str, Any] = ({"accuracy": None, "loss": None} if self.test is None
                                   else self.evaluator(self.model, self.test))
        acc, loss = metrics.get("accuracy"), metrics["loss"]
        row = {"round": r, **metrics, "epsilon": epsilon, "delta": delta,
               "included": sorted(outcome.included),
               "dropped": {str(c): st for c, st in sorted(outcome.dropped.items())},
               "attempts": done.attempts, "aggregate_correct": correct,
               "count": count, "clip_norm": clip, "step_norm": moved,
               "seconds": time.perf_counter() - started,
               "bytes_per_site": (int(np.median(list(outcome.bytes_sent.values())))
                                  if outcome.bytes_sent else 0),
               "release": release_record(self.plan, r, sorted(outcome.included), event,
                                         spent_before, epsilon, done.attempts)}
        self.history.append(row)
        self.round = r
        self.charged = None
        self.save()
        eps = f"  epsilon {epsilon:.3f}" if epsilon is not None else ""
        dropped = ", ".join(f"{c}@{st}" for c, st in row["dropped"].items()) or "none"
        quality = (f"accuracy {acc:.4f}  loss {loss:.4f}" if acc is not None and loss is not None
                   else f"c_index {metrics['c_index']:.4f}  loss {loss:.4f}"
                   if metrics.get("c_index") is not None
                   else "accuracy n/a (no evaluation data)")
        self.log(f"round {r:3d}/{s.rounds}  {quality}{eps}  "
                 f"included {len(outcome.included)}/{len(cohort)} (dropped: {dropped})"
                 + ("  aggregate verified" if correct else "")
                 + f"  [{self.progress(r)}]")
        return True

    def _aggregate(self, r: int, cohort: list[int]) -> Aggregated:
        """One secure aggregation of the cohort's inputs, retried while the protocol aborts.

        In this process the coordinator computes every site's input itself (simulation);
        :class:`fl.remote.coordinator.RemoteCoordinator` overrides this to let site processes do it.
        """
        s = self.settings
        for attempt in range(s.max_attempts):
            drops = drop_schedule(cohort, s.drop_rate, s.seed, r, attempt)
            inputs, decode, counts = self._inputs(r, cohort)
            dim = len(next(iter(inputs.values())))
            bound, weight = secagg_bound(self.task(r, cohort).to_wire(), dim)
            config = Config(num_clients=len(cohort), dim=dim, bits=self._bits(),
                            norm_bound=bound, weight_index=weight)
            try:
                outcome = self.aggregator.aggregate(config, inputs, drops)
            except ProtocolAbort as exc:
                self.log(f"round {r}: aggregation aborted ({exc}); {len(drops)} of "
                         f"{len(cohort)} sites dropped; retrying")
                continue
            return Aggregated(outcome, config, inputs, decode, counts, attempt + 1)
        raise RoundFailed(f"round {r} aborted {s.max_attempts} times: too many sites drop "
                          "out; lower --drop-rate or raise --max-attempts")

    def _bits(self) -> int:
        if isinstance(self.plan, DistributedPlan):
            return self.plan.params.bits
        return 64

    def task(self, r: int, cohort: list[int]) -> RoundTask:
        """What round ``r`` asks of each cohort site (:mod:`fl.contribution`)."""
        return round_task(self.settings, self.plan, r, len(cohort), **self.task_options())

    def task_options(self) -> dict[str, Any]:
        """The round task's state-dependent options: the adaptive clip's current value and
        the site weights (distributed DP)."""
        return {"clip_norm": None if self.clipper is None else self.clipper.clip_norm,
                "weights": self.weights}

    def _inputs(self, r: int, cohort: list[int]) -> tuple[dict[int, U64], Decoder,
                                                          dict[int, int]]:
        """Each cohort site's encoded vector, and how to decode the sum into an update."""
        task = self.task(r, cohort)
        inputs: dict[int, U64] = {}
        counts: dict[int, int] = {}
        self.controls = {}
        for cid in cohort:
            given = site_input(self.sites[cid], self.model, task, cid,
                               control=self.strategy.control)
            inputs[cid], counts[cid] = given.vector, given.count
            self.controls[cid] = given.control
        return inputs, decoder(task, self.layout.size), counts
