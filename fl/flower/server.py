"""Server side: secure aggregation for any Message-API strategy (``flwr.serverapp.strategy``).

``SecureAggregation(FedAvg(...))`` is the whole change in a ``ServerApp``. The user's
strategy still samples and configures the nodes (``configure_train``), runs evaluation and
applies its update rule (``aggregate_train``: FedAvg's average, FedAdam's server optimiser,
...). Only the train exchange changes: the wrapper hands the strategy a ``Grid`` whose
``send_and_receive`` runs a secure-aggregation round (:mod:`fl.flower.rounds`) for train
messages, and answers with **one** reply that carries the decoded aggregate: the weighted
average of the arrays (and of the chosen metrics) with the securely summed weight. A
strategy's weighted average of that single reply is the aggregate itself, so its update
rule applies unchanged; strategies that need each node's update (FedMedian, Krum, ...)
cannot be combined with secure aggregation, which exists to hide exactly that.

Protocol choices per round (n = the nodes the strategy sampled): ``neighbors="auto"``
takes SecAgg+'s (k, t) from ``secagg.secagg_plus_parameters(n, dropout_rate,
corrupt_rate)`` (the complete graph when no sparse one is safe); ``neighbors=None`` is
SecAgg over the complete graph with ``threshold`` (default: the protocol's floor).
``security="malicious"`` adds signatures and the consistency check; it needs
``verify_keys`` (Flower node id -> enrolled Ed25519 key), sent to the nodes in the setup,
which each node checks against its own enrolment list (``NodeOptions.trusted_keys``).
``privacy=DistributedDP(...)`` switches the encoding to distributed DP (:mod:`dp`): the
per-node noise comes from ``fl.plan.privacy.distributed_plan`` through
:func:`fl.round_plan.round_plan` (with an ``epsilon``: the least whose rounds fit it as each
node's ledger charges them), the budget is spent at that figure and a round that would
overshoot it is not run.
``norm_bound`` turns on input validation (docs/protocol.md 10): every node proves in zero
knowledge that what it masks is within the bound (a number: the L2 norm of its row
``[w * arrays, w * metrics, w]``; ``"clip"`` under distributed DP: the clip, noise
included); a node whose proof fails is left out of the sum and named
(``RoundReport.input_refused``, Flower's log at WARNING).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.result import Result

from dp import refusal_summary
from fl.errors import NothingReleased
from fl.flower.chunks import DEFAULT_CHUNK_BYTES, chunk_elements
from fl.flower.encoding import decode_sum, encoded_dim, flatten, layout_of, unflatten
from fl.flower.rounds import RoundDriver, RoundReport
from fl.flower.setup import RoundSetup
from fl.plan.privacy import DistributedPlan, make_budget
from fl.round_plan import (
    DistributedDP,
    check_norm_bound,
    fixed_setup,
    protocol_graph,
    round_plan,
    with_distributed_dp,
    with_norm_bound,
)
from fl.round_reply import charged_event, inputs_requested, whose_noise
from secagg import Server

log = logging.getLogger("fl.flower")


DEFAULT_STAGE_TIMEOUT = 120.0
"""Seconds a node has to answer each stage but masked_input. The masked-input request
(it carries the strategy's train message: the user's training runs in it) waits for the
``timeout`` of ``start`` (Flower's round timeout, 3,600 s by default); the other stages are
the node's own crypto on messages of kilobytes to megabytes (milliseconds to seconds) plus a
ClientApp start in deployment, so a silent node costs the round at most two minutes per
stage, not an hour."""

PER_UPDATE = {
    "FedMedian": "the coordinate-wise median of the node updates",
    "FedTrimmedAvg": "a trimmed mean that drops the extreme node updates",
    "MultiKrum": "distances between node updates (Krum, Multi-Krum)",
    "Bulyan": "distances between node updates and a trimmed mean",
    "QFedAvg": "each node's loss to weight its update",
    "FedXgbBagging": "each node's trees",
    "FedXgbCyclic": "one node's model at a time",
    "DifferentialPrivacyServerSideFixedClipping": "each node's update, to clip it at the server",
    "DifferentialPrivacyServerSideAdaptiveClipping": "each node's update, to clip it at the "
                                                     "server",
}
"""Strategies (by class, subclasses included) whose update rule needs each node's update."""


def check_strategy(strategy: Strategy) -> None:
    """Refuse a strategy (or a strategy it wraps) that needs each node's update: secure
    aggregation hands it one reply, the sum, so it would silently train something else."""
    seen: Strategy | None = strategy
    while seen is not None:
        for cls in type(seen).__mro__:
            if cls.__name__ in PER_UPDATE and cls.__module__.startswith("flwr."):
                raise ValueError(
                    f"{type(seen).__name__} needs {PER_UPDATE[cls.__name__]}; secure "
                    "aggregation gives the server only their sum, so it would silently train "
                    "a mean. Use FedAvg, FedProx, FedAvgM, FedAdam, FedAdagrad or FedYogi "
                    "(their update rule applies to the secure aggregate)")
        inner = getattr(seen, "strategy", None)
        seen = inner if isinstance(inner, Strategy) and inner is not seen else None


def _log_outcome(report: RoundReport) -> None:
    """Where Flower users look (Flower's own log): the nodes a secure round dropped, with
    the stage, and an aborted round (the strategy then reports the round without results)."""
    from flwr.common.logger import log as flwr_log

    n = report.setup.num_clients
    for node, reason in sorted(report.input_refused.items()):
        flwr_log(logging.WARNING, "secure aggregation round %d: node %d refused, its input "
                 "proof failed: %s", report.server_round, node, reason)
    refusals = refusal_summary(list(report.refused.values()), n)
    if refusals is not None:  # the rule, how many nodes and the fix, by default
        flwr_log(logging.WARNING, "secure aggregation round %d: %s", report.server_round,
                 refusals)
    if report.aborted is not None:
        flwr_log(logging.WARNING, "secure aggregation round %d aborted: %s (%d of %d nodes "
                 "dropped: %s)", report.server_round, report.aborted, len(report.dropped), n,
                 _by_stage(report.dropped))
    elif report.dropped:
        flwr_log(logging.WARNING, "secure aggregation round %d: %d of %d nodes in the sum, "
                 "%d dropped (%s)", report.server_round, len(report.included), n,
                 len(report.dropped), _by_stage(report.dropped))
    else:
        flwr_log(logging.INFO, "secure aggregation round %d: all %d nodes in the sum",
                 report.server_round, n)


def _by_stage(dropped: Mapping[int, str]) -> str:
    stages: dict[str, list[int]] = {}
    for node, stage in sorted(dropped.items()):
        stages.setdefault(stage, []).append(node)
    return "; ".join(f"{stage}: {len(nodes)} (nodes {nodes[:5]}{'...' if len(nodes) > 5 else ''})"
                     for stage, nodes in stages.items())



class _SecureGrid(Grid):
    """The strategy's grid, with train exchanges replaced by secure rounds."""

    def __init__(self, grid: Grid, owner: SecureAggregation, timeout: float | None) -> None:
        self._grid = grid
        self._owner = owner
        self._timeout = timeout

    def set_run(self, run: Any) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return self._grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        batch = list(messages)
        if batch and all(m.metadata.message_type.split(".")[0] == "train" for m in batch):
            return self._owner.secure_round(self._grid, batch, timeout)
        return self._grid.send_and_receive(batch, timeout=timeout)


class SecureAggregation(Strategy):
    """Wrap a Message-API strategy so its train rounds are securely aggregated.

    ``metrics``: train-reply metrics averaged securely (weighted like the arrays); every
    other metric of a train reply stays on the node (none by default: name them).
    ``stage_timeout``: seconds each stage but masked_input waits for the nodes
    (:data:`DEFAULT_STAGE_TIMEOUT`); masked_input, in which the nodes train, waits for the
    ``timeout`` of :meth:`start`. A strategy that needs each node's update (FedMedian, Krum,
    ...) is refused (:func:`check_strategy`). ``reports`` holds one
    :class:`fl.flower.rounds.RoundReport` per round; each round's drops are also logged to
    Flower's log. ``chunk_bytes``: a node's masked input travels as an ``ArrayRecord`` of
    chunks of this many bytes in the sum's natural width (:mod:`fl.flower.chunks`; default
    4 MiB, one Flower ``ArrayChunk`` each), so no Flower message of the round is larger.
    ``norm_bound``: input validation (module docstring; None: off, the default)."""

    def __init__(self, strategy: Strategy, *, neighbors: int | str | None = "auto",
                 threshold: int | None = None, dropout_rate: float = 0.1,
                 corrupt_rate: float = 0.1, security: str = "semi-honest", bits: int = 64,
                 frac_bits: int = 24, metrics: Sequence[str] = (),
                 privacy: DistributedDP | None = None,
                 stage_timeout: float = DEFAULT_STAGE_TIMEOUT,
                 verify_keys: Mapping[int, bytes] | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 norm_bound: float | str | None = None) -> None:
        if security not in ("semi-honest", "malicious"):
            raise ValueError(f"security={security!r}: use 'semi-honest' or 'malicious'")
        if security == "malicious" and not verify_keys:
            raise ValueError("security='malicious' needs verify_keys: Flower node id -> the "
                             "node's enrolled Ed25519 verification key (32 bytes)")
        if not (neighbors is None or neighbors == "auto" or isinstance(neighbors, int)):
            raise ValueError(f"neighbors={neighbors!r}: use 'auto' (SecAgg+), None (SecAgg) "
                             "or an integer k")
        if privacy is not None and metrics:
            raise ValueError("metrics cannot be averaged under distributed DP (they would "
                             "carry no noise); pass metrics=()")
        if privacy is not None and privacy.epsilon is None and privacy.noise_multiplier is None:
            raise ValueError("DistributedDP needs epsilon (a budget) or a noise_multiplier")
        check_norm_bound(norm_bound, privacy)
        check_strategy(strategy)
        chunk_elements(chunk_bytes, 8, 1)  # a positive size under the gRPC limit
        if stage_timeout is not None and not stage_timeout > 0:
            raise ValueError(f"stage_timeout={stage_timeout!r}: the seconds a node has for a "
                             "secure-aggregation stage but masked_input, where it trains (> 0)")
        self.strategy = strategy
        self.neighbors = neighbors
        self.threshold = threshold
        self.dropout_rate = dropout_rate
        self.corrupt_rate = corrupt_rate
        self.security = security
        self.bits = bits
        self.frac_bits = frac_bits
        self.metrics = tuple(metrics)
        self.privacy = privacy
        self.stage_timeout = stage_timeout
        self.verify_keys = dict(verify_keys or {})
        self.chunk_bytes = chunk_bytes
        self.norm_bound = norm_bound
        self._spent = (None if privacy is None
                       else make_budget(privacy.epsilon, privacy.delta))
        """What each node's ledger holds: the rounds released, as the nodes charge them."""
        self.budget = self._spent if privacy is not None and privacy.epsilon is not None \
            else None
        self.reports: list[RoundReport] = []
        self._plans: dict[tuple[int, int, int, str], DistributedPlan] = {}
        self._round = 0

    # --- the strategy interface: the user's strategy decides ------------------------------

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()
        log.info("secure aggregation: neighbors=%s threshold=%s dropout_rate=%s %s",
                 self.neighbors, self.threshold, self.dropout_rate,
                 "distributed DP" if self.privacy else f"{self.bits}-bit fixed point")

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None
              ) -> Result:
        """The user's strategy's own loop, on a grid whose train exchanges are secure.
        Raises :class:`fl.errors.NothingReleased` (one line: the sites' refusal rule and
        the fix) when no round released an aggregate: an untrained model is no result."""
        before = len(self.reports)
        result = self.strategy.start(_SecureGrid(grid, self, timeout), initial_arrays,
                                     num_rounds=num_rounds, timeout=timeout,
                                     train_config=train_config,
                                     evaluate_config=evaluate_config, evaluate_fn=evaluate_fn)
        ran = self.reports[before:]
        if num_rounds >= 1 and not any(r.total is not None for r in ran):
            last = {node: reason for r in ran for node, reason in r.refused.items()}
            reasons = list(last.values())  # each node's last reason, once
            sites = len({node for r in ran for node in r.setup.roster})
            raise NothingReleased(
                f"no secure-aggregation round released anything in {num_rounds} rounds: "
                + (refusal_summary(reasons, sites) or
                   "every round aborted or was not run (see the log above)"))
        return result

    def _spend(self, setup: RoundSetup, report: RoundReport) -> None:
        """A DP round whose masked inputs may have left the nodes (released or not,
        :func:`fl.round_reply.inputs_requested`): spend the epsilon each node's ledger
        charges for it (:func:`fl.round_reply.charged_event`, the node's own computation;
        the plan fits the budget as charged, :func:`fl.round_plan.round_plan`) and report
        it."""
        assert self.privacy is not None and self._spent is not None
        event = charged_event(setup)
        if event is None:
            return
        report.node_epsilon = self._spent.spend(event)[0]
        if self.privacy.epsilon is not None:
            report.epsilon = report.node_epsilon
        log.warning("round %d: each node's ledger holds epsilon %.4g (%s)",
                    report.server_round, report.node_epsilon, whose_noise(setup))

    # --- one secure round -----------------------------------------------------------------

    def secure_round(self, grid: Grid, messages: list[Message], timeout: float | None
                     ) -> list[Message]:
        """Run a secure round for the strategy's train messages; one aggregate reply."""
        self._round += 1
        nodes = [m.metadata.dst_node_id for m in messages]
        if len(set(nodes)) != len(nodes):
            raise ValueError("the strategy sent one node two train messages in one round")
        if len(nodes) < 2:
            log.warning("round %d: %d node(s) sampled; secure aggregation needs at least 2, "
                        "the round is skipped", self._round, len(nodes))
            return []
        first = messages[0].content
        if len(first.array_records) != 1:
            raise ValueError("secure aggregation needs train messages with exactly one "
                             "ArrayRecord (the arrays the nodes train from)")
        arrays = next(iter(first.array_records.values()))
        if self.privacy is not None and len({
                next(iter(m.content.array_records.values())).object_id
                for m in messages if len(m.content.array_records) == 1}) != 1:
            raise ValueError("distributed DP decodes updates against the arrays sent: the "
                             "strategy must send every node the same ArrayRecord")
        server_round = self._server_round(first)
        try:  # no safe protocol parameters for this many nodes
            setup = self._setup(grid, sorted(nodes), server_round, layout_of(arrays))
        except ValueError as exc:
            log.error("round %d is not run: %s", server_round, exc)
            return []
        if setup is None:
            return []
        server = Server(setup.config(encoded_dim(setup)),
                        roster=range(1, setup.num_clients + 1), context=setup.context(),
                        verify_keys=setup.peer_keys() if setup.verify_keys else None,
                        nonce=setup.round_nonce)
        driver = RoundDriver(grid, setup, server, messages[0].metadata.message_type,
                             self.stage_timeout, train_timeout=timeout,
                             chunk_bytes=self.chunk_bytes)
        report = driver.run(messages)
        self.reports.append(report)
        _log_outcome(report)
        if setup.dp is not None and self.privacy is not None \
                and inputs_requested(report.seconds):  # released or not: the nodes keep it
            self._spend(setup, report)
        if report.total is None:
            return []
        sent = flatten(arrays, setup.arrays)
        aggregate, metrics, weight = decode_sum(setup, report.total, len(report.included),
                                                sent)
        key = next(iter(first.array_records.keys()))
        weight_key = self._weight_key()
        content = RecordDict({
            key: ArrayRecord({name: Array(value) for name, value
                              in unflatten(aggregate, setup.arrays).items()}),
            "metrics": MetricRecord({**metrics, weight_key: weight})})
        return [Message(content, reply_to=messages[0])]

    def _weight_key(self) -> str:
        return str(getattr(self.strategy, "weighted_by_key", "num-examples"))

    def _server_round(self, content: RecordDict) -> int:
        for record in content.config_records.values():
            value = record.get("server-round")
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return self._round

    def _graph(self, n: int) -> tuple[int | None, int | None]:
        return protocol_graph(n, neighbors=self.neighbors, threshold=self.threshold,
                              dropout_rate=self.dropout_rate, corrupt_rate=self.corrupt_rate,
                              security=self.security)

    def _setup(self, grid: Grid, roster: list[int], server_round: int,
               specs: tuple[Any, ...]) -> RoundSetup | None:
        setup = fixed_setup(
            run_id=int(grid.run.run_id), server_round=server_round, roster=roster,
            arrays=specs, metrics=self.metrics, weight_key=self._weight_key(),
            neighbors=self.neighbors, threshold=self.threshold,
            dropout_rate=self.dropout_rate, corrupt_rate=self.corrupt_rate,
            security=self.security, bits=self.bits, frac_bits=self.frac_bits,
            verify_keys=self.verify_keys)
        if self.privacy is not None:
            setup = with_distributed_dp(setup, round_plan(self.privacy, setup, self._plans),
                                        b"flower-rotation|")
            event = charged_event(setup)
            if self.budget is not None and event is not None and not self.budget.can_run(event):
                log.warning("round %d is not run: it would exceed the privacy budget "
                            "(epsilon %.3g of %.3g spent)", server_round,
                            self.budget.spent[0], self.budget.epsilon)
                return None
        return setup if self.norm_bound is None else with_norm_bound(setup, self.norm_bound)
