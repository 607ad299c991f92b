"""Server side: :class:`SecureFedAvg`, a ``ModelController`` workflow (NVFlare 2.9's API for
new algorithm code) whose rounds are securely aggregated.

Each round: the sampled sites get the job's train task with the global model and the round
setup (:class:`fl.round_setup.RoundSetup`, in the task header ``secagg_setup``); each site's
:class:`fl.nvflare.client.SecAggExecutor` trains with the user's script and answers with its
key advertisement. Every later protocol stage is one :data:`fl.nvflare.common.STAGE_TASK`
per site carrying the ``secagg.Server``'s message for it, with the stage's deadline from
:func:`transport.deadlines.round_timeouts` (the train stage waits ``train_timeout``). A site
whose task fails, times out or is rejected is dropped at that stage, exactly as the
protocol allows; the round completes while the protocol can, and is skipped (the model
kept) when it cannot. The decoded aggregate is FedAvg's: the weighted average of the
arrays with the securely summed ``NUM_STEPS_CURRENT_ROUND`` (distributed DP: the noisy mean
update over the noisy site count, added to the model sent). With a ``strategy`` other than
``fedavg`` the server optimiser of :mod:`fl.strategies` (FedAdam, FedYogi, FedAdagrad; the
package's one implementation) takes the aggregate minus the model sent as its
pseudo-gradient: post-processing of the released sum, so it reveals nothing more.

:attr:`SecureFedAvg.reports` holds one :class:`fl.flower.rounds.RoundReport`-like
:class:`RoundReport` per round (included and dropped sites with the stage, seconds per
stage, bytes per site) in the server's job process; each is logged and appended as one
JSON line to ``report_path`` (default ``secure_rounds.jsonl`` in the job's run directory,
where a job script finds it). A dropped site is logged at WARNING; a stage that waits logs
which sites it waits for. The saved model carries NVFlare's ``current_round``; a job in
which no round completes saves the initial model with a note.
"""

from __future__ import annotations

import gc
import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from nvflare.apis.controller_spec import ClientTask, Task, TaskCompletionStatus
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.fl_model import FLMetaKey, FLModel, ParamsType
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.utils.fl_model_utils import FLModelUtils
from nvflare.app_common.workflows.model_controller import ModelController

from dp import refusal_summary
from fl.errors import NothingReleased
from fl.nvflare.common import (
    PAYLOAD,
    PROOF,
    REFUSAL_HEADER,
    SESSION,
    SETUP_HEADER,
    STAGE_TASK,
    run_id,
    site_id,
)
from fl.plan.privacy import DistributedPlan, make_budget
from fl.round_plan import (
    DistributedDP,
    check_norm_bound,
    fixed_setup,
    round_plan,
    with_distributed_dp,
    with_norm_bound,
)
from fl.round_reply import charged_event, decode_sum, inputs_requested, whose_noise
from fl.round_setup import RoundSetup, encoded_dim
from fl.strategies import ADAPTIVE, ServerStrategy
from fl.vector import ArrayLayout
from secagg import (
    InputRefused,
    ProtocolAbort,
    ProtocolError,
    Server,
    Stage,
    encode,
)
from transport import round_timeouts

DEFAULT_TRAIN_TIMEOUT = 600.0
"""Seconds the train stage waits for a site (a dead site costs a round this much, not
NVFlare's hour); a job whose local training takes longer sets ``train_timeout``."""
DEFAULT_REPORT_PATH = "secure_rounds.jsonl"
"""Where the round reports go: a relative path is in the server's run directory of the job
(``<workspace>/<job id>/``, the folder NVFlare keeps for the job; in the simulator
``<workspace>/server/simulate_job/``)."""
NO_ROUND_NOTE = "secagg_note"
"""Model metadata key: why the model saved is the initial one (no secure round completed)."""
NOT_WITH_A_SECURE_SUM = {
    "aggregator": "the server sees only the secure sum, and the aggregate is the weighted "
                  "average decoded from it (strategy= picks a server optimiser)",
    "aggregation_weights": "each site's weight is its own securely summed "
                           "NUM_STEPS_CURRENT_ROUND; a weight per site name would need the "
                           "server to see each site's update",
    "exclude_vars": "every array is in the masked vector; leave a variable out of the model "
                    "the script sends",
    "stop_cond": "early stopping is not implemented here; set num_rounds",
    "patience": "early stopping is not implemented here; set num_rounds",
    "enable_tensor_disk_offload": "the sites' replies are masked vectors summed as they "
                                  "arrive, there are no tensors to offload",
    "fedprox_mu": "put FedProx's proximal term in the training script",
    "save_filename": "the model is saved by the job's persistor (job.to_server(PTModel(...)) "
                     "or NPModelPersistor())",
}
"""NVFlare ``FedAvg`` arguments that a secure sum cannot honour, with the reason; accepted at
their defaults so a FedAvg job's arguments carry over."""


@dataclass
class RoundReport:
    """What one secure round did, by NVFlare site name: ``included`` (in the sum),
    ``dropped`` (site -> the stage it dropped in), ``seconds`` per stage, ``bytes_up`` /
    ``bytes_down`` (secagg payload bytes each site sent / was sent; the train task's model
    is not counted), ``total`` (the modular sum, None if the round aborted), ``epsilon``
    (the budget spent after the round, distributed DP with a budget), ``node_epsilon``
    (distributed DP: the epsilon each site's ledger holds after the job's rounds whose
    masked inputs may have left the sites, released or not,
    :func:`fl.round_reply.charged_event`; the budget is planned and spent at that figure, so
    ``epsilon`` equals it), ``metrics`` (the train
    metrics averaged securely, ``metrics=[...]``), ``skipped`` (why a round was not run),
    and the round's protocol: ``security``, ``mode`` (the privacy mode, ``none`` or
    ``distributed``: :data:`fl.round_setup.SETUP_MODES`), ``bits``, ``threshold``,
    ``neighbors`` (None: the complete graph);
    ``input_refused``: with input validation, site -> why its input proof failed (left out
    of the sum and named; an honest site never is)."""

    server_round: int
    sites: tuple[str, ...]
    included: tuple[str, ...] = ()
    dropped: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    bytes_up: dict[str, int] = field(default_factory=dict)
    bytes_down: dict[str, int] = field(default_factory=dict)
    total: np.ndarray | None = None
    aborted: str | None = None
    epsilon: float | None = None
    node_epsilon: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    skipped: str | None = None
    security: str = ""
    mode: str = ""
    bits: int = 0
    threshold: int = 0
    neighbors: int | None = None
    input_refused: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "total"}
        out["total"] = None if self.total is None else [int(x) for x in self.total]
        return out


class SecureFedAvg(ModelController):
    """FedAvg whose every round is one secure sum (module docstring).

    NVFlare ``FedAvg``'s names: ``num_rounds``, ``num_clients`` (sites sampled per round;
    ``min_clients`` is the same setting, all sites when 0), ``start_round``, ``task_name``
    (the train task), ``model`` (an initial model instead of the persistor's),
    ``memory_gc_rounds``, ``persistor_id``; FedAvg's other arguments only at their defaults
    (:data:`NOT_WITH_A_SECURE_SUM` says why). Protocol:
    ``neighbors`` (``"auto"``: SecAgg+'s (k, t) for ``dropout_rate``/``corrupt_rate``,
    None: SecAgg on the complete graph), ``threshold``, ``security`` (``"semi-honest"`` or
    ``"malicious"``, which needs ``verify_keys``: site name -> hex Ed25519 verify key),
    ``bits``/``frac_bits`` (fixed point); ``metrics``: train metrics averaged securely;
    ``stage_timeout`` (seconds per stage for the network, plus the modelled work),
    ``train_timeout`` (the train stage, :data:`DEFAULT_TRAIN_TIMEOUT`),
    ``progress_interval`` (seconds between "waiting for" log lines of a stage). ``dp``:
    client-level distributed DP, a dict of :class:`fl.round_plan.DistributedDP`'s fields
    (``clip_norm``, ``epsilon``, ``delta``, ``rounds``, ``noise_multiplier``,
    ``granularity_bits``); with an ``epsilon`` the noise is planned and the budget spent as
    each site's ledger charges the rounds, and a round that would overshoot it is not run.
    ``report_path``: a JSON-lines file of the round
    reports, relative to the job's run directory on the server (:data:`DEFAULT_REPORT_PATH`;
    "" writes none). ``task_request_interval``: seconds a site with no task waits before it
    asks again (:meth:`add_to_fed_job` sets it for the server).
    ``strategy``: the server's step from the secure aggregate, ``"fedavg"`` (the weighted
    average, moved by ``server_lr``) or a server optimiser of :mod:`fl.strategies`
    (``"fedadam"``, ``"fedyogi"``, ``"fedadagrad"``: Reddi et al. 2021 with ``server_lr``,
    ``server_beta1``, ``server_beta2``, ``server_tau``; None: its defaults), its state kept
    across the job's rounds. ``norm_bound``: input validation (docs/protocol.md 10), each
    site proves in zero knowledge that what it masks is within the bound (a number: the L2
    norm of its row ``[w * arrays, w * metrics, w]``; ``"clip"`` with ``dp``: the clip,
    noise included); a site whose proof fails is left out of the sum and named in the
    round's report (``input_refused``) and the log."""

    def __init__(self, *, num_rounds: int = 1, min_clients: int = 0,
                 num_clients: int | None = None, start_round: int = 0,
                 task_name: str = AppConstants.TASK_TRAIN, model: Any = None,
                 memory_gc_rounds: int = 0,
                 neighbors: int | str | None = "auto", threshold: int | None = None,
                 dropout_rate: float = 0.1, corrupt_rate: float = 0.1,
                 security: str = "semi-honest", bits: int = 64, frac_bits: int = 24,
                 metrics: list[str] | None = None, dp: dict[str, Any] | None = None,
                 stage_timeout: float = 60.0, train_timeout: float = DEFAULT_TRAIN_TIMEOUT,
                 verify_keys: dict[str, str] | None = None,
                 report_path: str = DEFAULT_REPORT_PATH,
                 task_request_interval: float = 0.1, strategy: str = "fedavg",
                 server_lr: float = 1.0, server_beta1: float | None = None,
                 server_beta2: float | None = None, server_tau: float | None = None,
                 persistor_id: str = AppConstants.DEFAULT_PERSISTOR_ID,
                 progress_interval: float = 30.0, norm_bound: float | str | None = None,
                 **fedavg_only: Any) -> None:
        super().__init__(persistor_id=persistor_id, ignore_result_error=True,
                         task_check_period=0.05)
        for name, value in fedavg_only.items():
            if name not in NOT_WITH_A_SECURE_SUM:
                raise TypeError(f"SecureFedAvg got an unexpected keyword argument {name!r}")
            if value not in (None, False, {}, "", 0, "FL_global_model.pt"):
                raise ValueError(f"FedAvg's {name}={value!r} is not available with a secure "
                                 f"sum: {NOT_WITH_A_SECURE_SUM[name]}")
        if num_clients is not None:
            if min_clients not in (0, num_clients):
                raise ValueError(f"num_clients={num_clients} (NVFlare's name) and min_clients="
                                 f"{min_clients} are the same setting: pass one")
            min_clients = num_clients
        if start_round < 0 or memory_gc_rounds < 0:
            raise ValueError("start_round and memory_gc_rounds are >= 0")
        if security not in ("semi-honest", "malicious"):
            raise ValueError(f"security={security!r}: use 'semi-honest' or 'malicious'")
        if security == "malicious" and not verify_keys:
            raise ValueError("security='malicious' needs verify_keys: site name -> the site's "
                             "enrolled Ed25519 verify key (hex)")
        if dp is not None and metrics:
            raise ValueError("metrics cannot be averaged under distributed DP (they would "
                             "carry no noise); pass metrics=None")
        try:
            self.privacy = DistributedDP(**dp) if dp is not None else None
        except TypeError as exc:
            raise ValueError(f"dp takes the fields of fl.round_plan.DistributedDP: {exc}"
                             ) from None
        if self.privacy is not None and self.privacy.epsilon is None \
                and self.privacy.noise_multiplier is None:
            raise ValueError("dp needs an epsilon (a budget) or a noise_multiplier")
        check_norm_bound(norm_bound, self.privacy)
        if strategy not in ("fedavg", *ADAPTIVE):
            raise ValueError(f"strategy={strategy!r}: use one of "
                             f"{', '.join(('fedavg', *ADAPTIVE))}")
        if not stage_timeout > 0 or not train_timeout > 0:
            raise ValueError("stage_timeout and train_timeout are seconds (> 0)")
        self.num_rounds = num_rounds
        self.min_clients = min_clients
        self.num_clients = num_clients
        self.start_round = start_round
        self.task_name = self.train_task_name = task_name
        self.model = model
        self.memory_gc_rounds = memory_gc_rounds
        self.progress_interval = progress_interval
        self.neighbors = neighbors
        self.threshold = threshold
        self.dropout_rate = dropout_rate
        self.corrupt_rate = corrupt_rate
        self.security = security
        self.bits = bits
        self.frac_bits = frac_bits
        self.metrics = list(metrics or [])
        self.dp = dict(dp) if dp is not None else None
        self.stage_timeout = stage_timeout
        self.train_timeout = train_timeout
        self.verify_keys = dict(verify_keys or {})
        self.report_path = report_path
        self.task_request_interval = task_request_interval
        self.strategy = strategy
        self.norm_bound = norm_bound
        # (NVFlare's job export reads each __init__ argument back from the attribute of its name)
        self.server_lr, self.server_beta1 = server_lr, server_beta1
        self.server_beta2, self.server_tau = server_beta2, server_tau
        given = {"lr": server_lr, "beta1": server_beta1, "beta2": server_beta2,
                 "tau": server_tau}  # None: ServerStrategy's default
        self.optimizer_args = {k: v for k, v in given.items() if v is not None}
        self.optimizer: ServerStrategy | None = None
        self._spent = (None if self.privacy is None
                       else make_budget(self.privacy.epsilon, self.privacy.delta))
        """What each site's ledger holds: the rounds released, as the sites charge them."""
        self.budget = (self._spent if self.privacy is not None
                       and self.privacy.epsilon is not None else None)
        self.reports: list[RoundReport] = []
        self._refusals: dict[int, dict[str, str]] = {}
        """Per round, each refusing site's public reason (its error reply's header)."""
        self._last_setup: RoundSetup | None = None
        self._plans: dict[tuple[int, int, int, str], DistributedPlan] = {}
        self._lock = threading.Lock()

    def add_to_fed_job(self, job: Any, ctx: Any, **kwargs: Any) -> Any:
        """Added as the job's workflow, with the server's ``task_request_interval`` (how
        long a site that found no task waits before asking again; NVFlare's default is 2 s)
        set to this workflow's: a secure round is 4-5 exchanges, each started right after
        the sites answered the previous one."""
        result = super().add_to_fed_job(job, ctx, **kwargs)
        job.add_params({"server": {"task_request_interval": self.task_request_interval}}, ctx)
        return result

    # --- the workflow ------------------------------------------------------------------------

    def run(self) -> None:
        if self.model is not None:  # NVFlare's FedAvg(model=...): instead of the persistor's
            given = self.model
            model = given if isinstance(given, FLModel) else FLModel(params=dict(given))
        else:
            model = self.load_model()
        if model is None:
            return
        params = {k: np.asarray(v) for k, v in (model.params or {}).items()}
        saved = False
        for r in range(self.start_round, self.start_round + self.num_rounds):
            if self.abort_signal.triggered:
                return
            sites = sorted(self.sample_clients(self.min_clients or None))
            report = self.secure_round(r, params, sites)
            if self.memory_gc_rounds and (r - self.start_round + 1) % self.memory_gc_rounds == 0:
                gc.collect()
            if report.total is None:
                self._publish(report)
                continue
            sent = ArrayLayout.of(params).flatten(params)
            setup = self._last_setup
            assert setup is not None  # set by the round that produced the total
            aggregate, report.metrics, weight = decode_sum(setup, report.total,
                                                           len(report.included), sent)
            self._publish(report)
            if self.optimizer is None:
                self.optimizer = ServerStrategy(self.strategy, sent.size, **self.optimizer_args)
            params = ArrayLayout.of(params).unflatten(self.optimizer.step(sent, aggregate - sent))
            self.save_model(self._model(params, r, report.metrics,
                                        {FLMetaKey.NUM_STEPS_CURRENT_ROUND: weight}))
            saved = True
        if not saved:
            note = (f"no secure round of {self.num_rounds} completed: the model saved is the "
                    f"initial model, unchanged (the round reports say why)")
            self.warning(note)
            self.save_model(self._model(params, None, {}, {NO_ROUND_NOTE: note}))
        self._check_released()

    def _model(self, params: dict[str, np.ndarray], server_round: int | None,
               metrics: dict[str, float], meta: dict[str, Any]) -> FLModel:
        """The model to save, its metadata as NVFlare's FedAvg writes it (``current_round``:
        the round that made it, None for the initial model; ``total_rounds``)."""
        return FLModel(params_type=ParamsType.FULL, params=params, metrics=metrics,
                       current_round=server_round, total_rounds=self.num_rounds,
                       meta={FLMetaKey.CURRENT_ROUND: server_round,
                             FLMetaKey.TOTAL_ROUNDS: self.num_rounds, **meta})

    def _check_released(self) -> None:
        """A run in which no round released anything ends in a typed error (one line: the
        sites' refusal rule and the fix), never as a success: the initial model saved beside it
        says it is untrained."""
        if self.num_rounds < 1 or any(r.total is not None for r in self.reports):
            return
        last = {site: reason for rs in self._refusals.values() for site, reason in rs.items()}
        reasons = list(last.values())  # each site's last reason, once
        sites = len({site for r in self.reports for site in r.sites})
        message = (f"no secure round released anything in {self.num_rounds} rounds: "
                   + (refusal_summary(reasons, sites) or
                      "every round aborted or was not run (see the log above)"))
        self.system_panic(message, self.fl_ctx)
        raise NothingReleased(message)

    def secure_round(self, server_round: int, params: dict[str, np.ndarray],
                     sites: list[str]) -> RoundReport:
        """One secure round over ``sites`` from the global ``params``; the report."""
        report = RoundReport(server_round, tuple(sites))
        if len(sites) < 2:
            report.skipped = f"{len(sites)} site(s); secure aggregation needs at least 2"
            return report
        try:
            setup = self._setup(sites, server_round, ArrayLayout.of(params).specs)
        except ValueError as exc:
            report.skipped = str(exc)
            return report
        if setup is None:
            report.skipped = (f"the round would exceed the privacy budget (epsilon "
                              f"{self.budget.spent[0]:.3g} of {self.budget.epsilon:.3g} spent)"
                              if self.budget else "no setup")
            return report
        self._last_setup = setup
        report.security, report.mode, report.bits = setup.security, setup.mode, setup.bits
        report.threshold, report.neighbors = setup.threshold, setup.neighbors
        names = {site_id(s): s for s in sites}
        server = Server(setup.config(encoded_dim(setup)), roster=range(1, setup.num_clients + 1),
                        context=setup.context(), nonce=setup.round_nonce,
                        verify_keys=setup.peer_keys() if setup.verify_keys else None)
        deadlines = round_timeouts(self.stage_timeout, clients=setup.num_clients,
                                   dim=encoded_dim(setup), neighbors=setup.neighbors,
                                   malicious=setup.security == "malicious",
                                   validated=setup.norm_bound is not None)
        model = FLModel(params_type=ParamsType.FULL, params=params, current_round=server_round,
                        total_rounds=self.num_rounds)
        train = FLModelUtils.to_shareable(model)
        train.set_header(SETUP_HEADER, setup.to_bytes())
        train.set_header(AppConstants.CURRENT_ROUND, server_round)
        train.set_header(AppConstants.NUM_ROUNDS, self.num_rounds)
        for s in sites:
            report.bytes_down[s] = len(setup.to_bytes())

        def site_of(cid: int) -> str:
            return names[setup.node_of(cid)]

        try:
            self._exchange(server, setup, report, Stage.ADVERTISE_KEYS,
                           {s: train for s in sites}, self.train_timeout, self.train_task_name)
            while True:
                to_send = server.advance()
                if server.finished:
                    break
                stage = server.stage
                out: dict[str, Shareable] = {}
                for cid, message in sorted(to_send.items()):
                    payload = encode(message)
                    task = Shareable()
                    task[SESSION] = server.session_id
                    task[PAYLOAD] = payload
                    out[site_of(cid)] = task
                    report.bytes_down[site_of(cid)] = (report.bytes_down.get(site_of(cid), 0)
                                                       + len(payload))
                deadline = deadlines.per_stage.get(stage.label, deadlines.stage)
                self._exchange(server, setup, report, stage, out, deadline, STAGE_TASK)
        except ProtocolAbort as exc:
            report.aborted = str(exc)
        report.dropped = {site_of(cid): st.label for cid, st in server.dropped.items()}
        report.input_refused = {site_of(cid): reason for cid, reason in server.refused.items()}
        result = server.result
        if result is not None and report.aborted is None:
            report.total = result.total
            report.included = tuple(sorted(site_of(c) for c in result.included))
        event = charged_event(setup)
        if self._spent is not None and event is not None and inputs_requested(report.seconds):
            # released or not: a site whose masked input left keeps the round's charge
            report.node_epsilon = self._spent.spend(event)[0]
            if self.budget is not None:
                report.epsilon = report.node_epsilon
            self.warning(f"round {server_round}: each site's ledger holds epsilon "
                         f"{report.node_epsilon:.4g} ({whose_noise(setup)})")
        return report

    def _exchange(self, server: Server, setup: RoundSetup, report: RoundReport, stage: Stage,
                  out: dict[str, Shareable], timeout: float, task_name: str) -> None:
        """Send each site its task of ``stage`` and wait until every one is answered or the
        deadline passed; each answer goes to the secagg server as it arrives."""
        started = time.perf_counter()

        answered: set[str] = set()

        def received(client_task: ClientTask, fl_ctx: FLContext) -> None:
            name = client_task.client.name
            answered.add(name)
            result = client_task.result
            client_task.result = None
            if result is None or result.get_return_code(ReturnCode.OK) != ReturnCode.OK:
                reason = None if result is None else result.get_header(REFUSAL_HEADER)
                self.warning(f"site {name} dropped in {stage.label} of round "
                             f"{report.server_round}: its task failed ("
                             f"{None if result is None else result.get_return_code()})"
                             + (f": {reason}" if reason else ""))
                if isinstance(reason, str):
                    with self._lock:
                        self._refusals.setdefault(report.server_round, {})[name] = reason
                return
            payload = result.get(PAYLOAD)
            if not isinstance(payload, bytes):
                self.warning(f"site {name} dropped in {stage.label} of round "
                             f"{report.server_round}: its answer carries no payload")
                return
            proof = result.get(PROOF)
            with self._lock:
                report.bytes_up[name] = report.bytes_up.get(name, 0) + len(payload)
                try:
                    if isinstance(proof, bytes):  # input validation: before the masked input
                        report.bytes_up[name] += len(proof)
                        server.receive(setup.client_id(site_id(name)), proof)
                    server.receive(setup.client_id(site_id(name)), payload)
                except InputRefused as exc:
                    self.warning(f"site {name} refused in {stage.label} of round "
                                 f"{report.server_round}: its input proof failed: {exc}")
                except (ValueError, ProtocolError) as exc:
                    self.warning(f"site {name} dropped in {stage.label} of round "
                                 f"{report.server_round}: its answer was rejected: {exc}")

        tasks = []
        for name, data in out.items():
            task = Task(name=task_name, data=data, timeout=max(1, math.ceil(timeout)),
                        result_received_cb=received)
            self.broadcast(task=task, fl_ctx=self.fl_ctx, targets=[name], min_responses=1)
            tasks.append(task)
        next_progress = started + self.progress_interval
        while any(t.completion_status is None for t in tasks):
            if self.abort_signal is not None and self.abort_signal.triggered:
                for t in tasks:
                    self.cancel_task(t, TaskCompletionStatus.ABORTED, self.fl_ctx)
                raise ProtocolAbort("the job was aborted")
            now = time.perf_counter()
            if now >= next_progress:
                waiting = sorted(set(out) - answered)
                self.info(f"round {report.server_round}, {stage.label}: waiting for "
                          f"{', '.join(waiting)} ({now - started:.0f} s of the stage's "
                          f"{timeout:.0f} s deadline; {len(answered)} of {len(out)} answered)")
                next_progress = now + self.progress_interval
            time.sleep(0.02)
        for name in sorted(set(out) - answered):
            self.warning(f"site {name} dropped in {stage.label} of round {report.server_round}: "
                         f"no answer within the stage's {timeout:.0f} s deadline")
        report.seconds[stage.label] = round(time.perf_counter() - started, 4)

    def _publish(self, report: RoundReport) -> None:
        self.reports.append(report)
        refusals = refusal_summary(list(self._refusals.get(report.server_round, {}).values()),
                                   len(report.sites))
        if refusals is not None:  # the rule, how many sites and the fix, by default
            self.warning(f"secure round {report.server_round}: {refusals}")
        if report.skipped:
            self.warning(f"secure round {report.server_round} not run: {report.skipped}")
        elif report.aborted:
            self.warning(f"secure round {report.server_round} aborted: {report.aborted}; "
                         f"dropped {report.dropped}")
        else:
            self.info(f"secure round {report.server_round}: in the sum {list(report.included)}, "
                      f"dropped {report.dropped}, seconds {report.seconds}, bytes up "
                      f"{report.bytes_up}")
        if self.report_path:
            path = os.path.join(self.get_run_dir(), self.report_path)  # absolute: kept
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(report.to_json()) + "\n")

    # --- the round's parameters ----------------------------------------------------------------

    def _setup(self, sites: list[str], server_round: int, specs: tuple[Any, ...]
               ) -> RoundSetup | None:
        setup = fixed_setup(
            run_id=run_id(str(self.fl_ctx.get_job_id())), server_round=server_round,
            roster=[site_id(s) for s in sites], members=sites, arrays=specs,
            metrics=tuple(self.metrics), weight_key=FLMetaKey.NUM_STEPS_CURRENT_ROUND,
            neighbors=self.neighbors, threshold=self.threshold,
            dropout_rate=self.dropout_rate, corrupt_rate=self.corrupt_rate,
            security=self.security, bits=self.bits, frac_bits=self.frac_bits,
            verify_keys={name: bytes.fromhex(key) for name, key in self.verify_keys.items()})
        if self.privacy is not None:
            setup = with_distributed_dp(setup, round_plan(self.privacy, setup, self._plans),
                                        b"nvflare-rotation|")
            event = charged_event(setup)
            if self.budget is not None and event is not None and not self.budget.can_run(event):
                return None
        return setup if self.norm_bound is None else with_norm_bound(setup, self.norm_bound)
