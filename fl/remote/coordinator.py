"""The coordinator role: :class:`fl.coordinator.Coordinator` whose sites are processes.

The training loop is the simulation's: the same cohorts, budget checks, decode, update,
evaluation and checkpoints. Only :meth:`RemoteCoordinator._aggregate` differs: it puts the
round's :class:`fl.contribution.RoundTask` and the model into a blob, and the sites compute
their inputs themselves. Training is synchronous torch code, so it runs in a worker thread
(``asyncio.to_thread``) while the event loop keeps the federation link; each round goes to
the loop with ``asyncio.run_coroutine_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from dp import MODE_NONE
from fl.aggregation import AggregateOutcome
from fl.contribution import (
    RoundTask,
    SecaggBound,
    decoder,
    round_task,
    scaler_from_sum,
    secagg_bound,
)
from fl.coordinator import Aggregated, Coordinator, RoundFailed
from fl.data import Table, csv_schema, load_csv
from fl.errors import RunFailed
from fl.federation import (
    load_checkpoint,
    load_split,
    make_plan,
    public_scaler,
    report,
    site_charge,
    survival_evaluator,
    tensors,
    uses_scaler,
)
from fl.models import make_model
from fl.plan import idp as fl_idp
from fl.plan import scaler as private_scaler
from fl.plan.privacy import DEFAULT_MAX_UNITS, Plan
from fl.remote.blob import Blob
from fl.remote.channel import CoordinatorChannel, NotEnoughSites, RemoteRound
from fl.remote.inputs import Schema, dataset_schema
from fl.remote.messages import Hello
from fl.settings import TrainSettings
from fl.site.training import Scaler
from fl.vector import ParameterLayout
from secagg import Config, ProtocolAbort, Stage
from transport import Network, TransportError, round_timeouts

Log = Callable[[str], None]


RETRY_FIRST_PAUSE = 2.0
RETRY_MAX_PAUSE = 60.0
"""A failed attempt is retried after a pause that doubles from the first to the most
(2, 4, 8, 16 s with the default five attempts), ended early once every cohort site is online
again: sites that are restarting come back before the attempts run out."""


@dataclass
class RemoteOptions:
    """What the coordinator role adds to :class:`fl.settings.TrainSettings`."""

    site_ids: tuple[int, ...]
    federation: str = "fl"
    eval_csv: str | None = None
    labels: tuple[str, ...] | None = None
    """The federation's label values (sites with their own tables do not announce theirs)."""
    join_timeout: float = 600.0
    ready_timeout: float = 300.0
    stage_timeout: float = 60.0
    max_units: int | None = None
    insecure_verify: bool = False
    peer_keys: Mapping[int, bytes] | None = None
    """Every site's Ed25519 public key (``--peer-keys``, fl/site/identity.py): the rounds then run
    in secagg's malicious mode, as sites with their own peer keys require."""


async def remote_aggregate(channel: CoordinatorChannel, options: RemoteOptions, *, kind: str,
                           round_number: int, blob: bytes, cohort: Sequence[int],
                           threshold: int, dim: int, bits: int, attempts: int,
                           log: Log, bound: SecaggBound = (None, None)
                           ) -> tuple[RemoteRound, int]:
    """One aggregation with site processes, retried (fresh round) while it cannot finish.

    An attempt that aborts released nothing, so nothing is spent (docs/architecture.md
    section 6).
    """
    from dp import refusal_summary

    label = f"round {round_number}" if kind == "train" else "feature scaling"
    refused: dict[int, str] = {}  # each site's last policy refusal (its Decline's reason)
    for attempt in range(attempts):
        try:
            done = await channel.run_round(
                kind=kind, round_number=round_number, attempt=attempt, blob=blob,
                cohort=cohort, threshold=threshold, dim=dim, bits=bits,
                verify=options.insecure_verify, ready_timeout=options.ready_timeout,
                timeouts=round_timeouts(options.stage_timeout, clients=len(cohort), dim=dim,
                                        malicious=channel.security == "malicious",
                                        validated=bound[0] is not None),
                bound=bound)
        except (ProtocolAbort, NotEnoughSites, TransportError) as exc:
            if channel.lost is not None:
                raise TransportError(f"lost the broker: {channel.lost}") from None
            refused.update(channel.declines)
            summary = refusal_summary(list(channel.declines.values()), len(cohort))
            if summary is not None:  # the rule, how many sites and the fix
                log(f"{label}: {summary}")
            if attempt + 1 < attempts:
                pause = min(RETRY_MAX_PAUSE, RETRY_FIRST_PAUSE * 2 ** attempt)
                log(f"{label}: attempt {attempt + 1} did not complete ({exc}); retrying "
                    f"within {pause:.0f} s, once every cohort site is online")
                await channel.wait_online(cohort, pause)
            else:
                log(f"{label}: attempt {attempt + 1} did not complete ({exc})")
            continue
        return done, attempt + 1
    summary = refusal_summary(list(refused.values()), len(cohort))
    raise RoundFailed(f"{label} failed {attempts} times: "
                      + (summary if summary is not None else
                         "too few sites are online or they keep dropping out (check the "
                         "sites' logs, raise --ready-timeout or --max-attempts)"))


class RemoteCoordinator(Coordinator):
    """See the module docstring; ``channel`` and ``loop`` are the federation link's."""

    def __init__(self, settings: TrainSettings, model: torch.nn.Module,
                 test: tuple[torch.Tensor, torch.Tensor] | None, plan: Plan, *,
                 channel: CoordinatorChannel, loop: asyncio.AbstractEventLoop,
                 options: RemoteOptions, schema: Schema, scaler: Scaler | None,
                 log: Log, evaluator: Any = None) -> None:
        scaler_json = (None if scaler is None else
                       {"mean": scaler.mean.tolist(), "std": scaler.std.tolist()})
        super().__init__(settings, model, {}, test, plan, _NoAggregator(),
                         scaler=scaler_json, log=log, evaluator=evaluator)
        self.site_ids = list(options.site_ids)
        self.channel = channel
        self.loop = loop
        self.options = options
        self.schema = schema
        self.scaler_arrays = None if scaler is None else (scaler.mean, scaler.std)
        self.stopping = threading.Event()

    def wire_task(self, r: int, cohort: list[int]) -> tuple[RoundTask, dict[str, Any]]:
        """Round ``r``'s task and the blob's task map (with the federation's schema)."""
        task = round_task(self.settings, self.plan, r, len(cohort),
                          max_units=self.options.max_units, **self.task_options())
        return task, {"features": list(self.schema.features),
                      "labels": list(self.schema.labels), "model": self.settings.model,
                      **task.to_wire()}

    def _aggregate(self, r: int, cohort: list[int]) -> Aggregated:
        task, body = self.wire_task(r, cohort)
        blob = Blob("train", body, self.layout.to_vector(self.model),
                    self.scaler_arrays, self.strategy.control).encode()
        dim = task.encoded_dim(self.layout.size)
        future = asyncio.run_coroutine_threadsafe(remote_aggregate(
            self.channel, self.options, kind="train", round_number=r, blob=blob,
            cohort=cohort, threshold=self.threshold, dim=dim, bits=task.bits,
            attempts=self.settings.max_attempts, log=self.log,
            bound=secagg_bound(body, dim)), self.loop)
        while True:  # the loop may be stopping (Ctrl-C): never wait on it forever
            try:
                done, attempts = future.result(timeout=0.5)
                break
            except concurrent.futures.TimeoutError:
                if self.stopping.is_set() or self.loop.is_closed():
                    future.cancel()
                    raise RoundFailed(f"round {r}: the coordinator is stopping") from None
        result = done.result
        dropped = {cid: Stage(st).label for cid, st in result.dropped.items()}
        dropped.update(done.absent)
        dropped.update(refused_sites(result.refused, r, self.log))
        outcome = AggregateOutcome(
            total=np.asarray(result.total, dtype=np.uint64), included=result.included,
            dropped=dropped, seconds=done.seconds, bytes_sent=done.bytes_received)
        return Aggregated(outcome, done.config, done.inputs, decoder(task, self.layout.size),
                          {}, attempts)


def refused_sites(refused: Mapping[int, str], r: int, log: Log) -> dict[int, str]:
    """Input validation (``--norm-bound``): each site whose proof failed, named in the log
    and in the round's ``dropped`` (``refused: why``); left out of the sum."""
    for cid, why in sorted(refused.items()):
        log(f"round {r}: site {cid} refused and left out: {why}")
    return {cid: f"refused: {why}" for cid, why in refused.items()}


class _NoAggregator:
    """The base class's aggregator slot: remote rounds go through the channel."""

    name = "remote"

    def aggregate(self, *args: object) -> AggregateOutcome:
        raise RuntimeError("a remote coordinator aggregates through its channel")


def federation_schema(hellos: Mapping[int, Hello], known: Schema | None,
                      options: RemoteOptions, settings: TrainSettings) -> Schema:
    """The columns every site must share and the federation's labels: the bundled
    dataset's, or ``--labels`` and ``--eval-csv``'s (sites never announce their labels)."""
    features = known.features if known is not None else hellos[min(hellos)].features
    for cid, hello in sorted(hellos.items()):
        if hello.features != features:
            raise ValueError(f"site {cid}'s columns {list(hello.features)[:6]}... differ from "
                             f"{list(features)[:6]}...: every site needs the same columns in "
                             "the same order")
    labels = set(options.labels or ())
    if options.eval_csv is not None:
        eval_features, eval_labels = csv_schema(options.eval_csv,
                                                patient_column=settings.patient_column or "",
                                                label_column=settings.label_column or "")
        if eval_features != features:
            raise ValueError(f"--eval-csv's columns differ from the sites' "
                             f"{list(features)[:6]}...")
        labels |= set(eval_labels)
    if known is not None and known.labels:
        if labels - set(known.labels):
            raise ValueError(f"--labels {sorted(labels)} are not the dataset's "
                             f"{list(known.labels)}")
        return Schema(tuple(features), known.labels)
    if len(labels) < 2:
        raise ValueError("sites with their own tables do not announce their label values: "
                         "give the federation's labels with --labels A,B[,...] (or an "
                         "--eval-csv holding every label)")
    return Schema(tuple(features), tuple(sorted(labels)))


async def _remote_scaler(channel: CoordinatorChannel, options: RemoteOptions,
                         settings: TrainSettings, schema: Schema, threshold: int,
                         log: Log, noised: private_scaler.ScalerPlan | None = None
                         ) -> tuple[Scaler, list[int]]:
    """Federation-wide feature mean and std from one secure sum of the sites' feature sums
    (:func:`fl.federation.secure_scaler` with the sites in their own processes); with
    ``noised`` the bounded, noised statistics of :mod:`fl.site.private_scaler`, which each site's
    own policy judges and charges (the caller charged the coordinator's budget)."""
    f = len(schema.features)
    ids = options.site_ids
    if noised is not None:
        p = noised.params
        noised_blob = Blob("scaler", {"features": list(schema.features),
                                      "labels": list(schema.labels), "dim": p.encoded_dim,
                                      "bits": p.bits, "noised": private_scaler.to_wire(noised)})
        done, _ = await remote_aggregate(channel, options, kind="scaler", round_number=0,
                                         blob=noised_blob.encode(), cohort=list(ids),
                                         threshold=max(threshold, p.threshold),
                                         dim=p.encoded_dim, bits=p.bits,
                                         attempts=settings.max_attempts, log=log)
        included = sorted(done.result.included)
        log(f"feature scaling from a noised secure sum over sites {included}")
        return private_scaler.from_sum(noised, np.asarray(done.result.total, dtype=np.uint64),
                                       len(included)), included
    blob = Blob("scaler", {"features": list(schema.features), "labels": list(schema.labels),
                           "dim": 2 * f + 1, "bits": 64}).encode()
    done, _ = await remote_aggregate(channel, options, kind="scaler", round_number=0,
                                     blob=blob, cohort=list(ids), threshold=threshold,
                                     dim=2 * f + 1, bits=64, attempts=settings.max_attempts,
                                     log=log)
    log(f"feature scaling from a secure sum over sites {sorted(done.result.included)}")
    return (scaler_from_sum(np.asarray(done.result.total, dtype=np.uint64), f, len(ids)),
            sorted(done.result.included))


def train_coordinator(settings: TrainSettings, options: RemoteOptions, network: Network, *,
                      log: Log | None = None) -> dict[str, Any]:
    """Run (or resume) training with site processes; returns the ``--role all`` report."""
    return asyncio.run(train_coordinator_async(settings, options, network,
                                               log or (lambda text: None)))


async def train_coordinator_async(settings: TrainSettings, options: RemoteOptions,
                                  network: Network, say: Log) -> dict[str, Any]:
    """:func:`train_coordinator` on the running event loop (training in a worker thread)."""
    torch.manual_seed(settings.seed)
    saved = load_checkpoint(settings, say)
    ids = tuple(sorted(options.site_ids))
    known: Schema | None = None
    test_table: Table | None = None
    evaluator = None
    needs_scaler = settings.scaling == "secure"
    max_units = options.max_units
    if settings.csv is None:
        # A bundled (public) dataset: the coordinator holds its test split for evaluation.
        split = load_split(replace(settings, sites=len(ids)))
        known = dataset_schema(split.train.num_features, split.train.num_classes)
        test_table = split.test
        needs_scaler = uses_scaler(settings, split.train)
        if settings.survival:  # the pooled test set's C-index, as --role all reports it
            evaluator = survival_evaluator(split.site_tests,
                                           settings.model == "discrete-time")
    elif settings.scaling == "auto":
        # A user's table is not on a public scale; in the DP modes an exact sum is never
        # released (docs/privacy.md section 1).
        needs_scaler = settings.dp == MODE_NONE
    # The modulus is sized for a public bound (--max-units or the default), never a
    # site's real patient count: bits is published.
    max_units = max_units or settings.max_units or DEFAULT_MAX_UNITS
    options = replace(options, site_ids=ids, max_units=max_units)
    security = settings.security
    if (options.peer_keys is None) != (security == "semi-honest"):
        raise ValueError("the sites' public keys (--peer-keys) and malicious-mode rounds "
                         "(TrainSettings.security) go together")
    unkeyed = sorted(set(ids) - set(options.peer_keys or ids))
    if unkeyed:
        raise ValueError(f"--peer-keys has no site-<id>.pub for sites {unkeyed[:10]}")
    everyone = Config(num_clients=len(ids), dim=1, security=security).threshold
    async with CoordinatorChannel(network, options.federation, ids, say,
                                  verify_keys=options.peer_keys) as channel:
        say(f"coordinator of federation {options.federation!r}; waiting for sites "
            f"{list(ids)}")
        hellos = await channel.wait_for_sites(options.join_timeout, everyone)
        missing = sorted(set(ids) - set(hellos))
        say(f"{len(hellos)} of {len(ids)} sites online"
            + (f" (not yet: {missing})" if missing else ""))
        schema = federation_schema(hellos, known, options, settings)
        channel.features = schema.features
        say(f"schema: {len(schema.features)} features, labels {list(schema.labels)[:10]}")
        if options.eval_csv is not None:
            test_table = load_csv(options.eval_csv, patient_column=settings.patient_column or "",
                                  label_column=settings.label_column or "",
                                  labels=list(schema.labels))
        scaler: Scaler | None = None
        if saved is not None and saved.scaler is not None:
            scaler = Scaler(np.asarray(saved.scaler["mean"]), np.asarray(saved.scaler["std"]))
        elif settings.scaler_file is not None:
            scaler = public_scaler(settings, len(schema.features))
        elif needs_scaler:
            scaler, _ = await _remote_scaler(channel, options, settings, schema, everyone, say)
        # the sites charge their own noise share only unless they know each other's keys:
        # the rounds and the noised statistics are planned, spent and reported at that
        charged = site_charge(options.peer_keys is not None)
        noised = private_scaler.scaler_plan(settings, None, len(schema.features),
                                            charged=charged)
        released = None
        if scaler is None and noised is not None:
            spent = private_scaler.charge(noised, settings, saved, len(schema.features),
                                          len(schema.labels))
            scaler, included = await _remote_scaler(channel, options, settings, schema,
                                                    everyone, say, noised)
            released = spent.released(scaler, included)
        model = make_model(settings.model, len(schema.features), len(schema.labels),
                           settings.seed)
        dim = ParameterLayout.of(model).size
        threshold = settings.secagg_threshold
        plan = make_plan(settings, None, dim, threshold, max_units=max_units,
                         prior=() if noised is None else (noised.event(),), charged=charged)
        say(f"{len(ids)} site processes, test "
            + (f"{len(test_table)} records" if test_table is not None else "none (no "
               "--eval-csv: accuracy is not measured)")
            + f", model {settings.model} ({dim} parameters), threshold {threshold}")
        idp = settings.unit == "patient-idp"
        say(f"privacy: {fl_idp.REMOTE_DESCRIPTION if idp else plan.describe()}")
        coordinator = RemoteCoordinator(
            settings, model, None if test_table is None else tensors(test_table, scaler), plan,
            channel=channel, loop=asyncio.get_running_loop(), options=options, schema=schema,
            scaler=scaler, log=say, evaluator=evaluator)
        if idp:  # each site's ledger charges and caps its own rate groups (fl/site/idp.py)
            coordinator.budget = None
        if released is not None:
            coordinator.scaler = released.scaler_json()
        elif saved is not None and saved.scaler is not None:
            coordinator.scaler = saved.scaler  # keeps the record of how it was released
        if saved is not None:
            coordinator.restore(saved)
            say(f"resumed from {settings.checkpoint} after round {saved.round}")
        if released is not None:  # the feature statistics' release is on the budget
            released.attach(coordinator)
        failure: Exception | None = None
        try:
            await asyncio.to_thread(coordinator.run)
        except Exception as exc:  # the rounds so far are reported below, then it is raised
            failure = exc
        finally:
            coordinator.stopping.set()  # a cancelled run: its worker thread stops waiting
            finished = failure is None and (coordinator.stopped is not None
                                            or coordinator.round >= settings.rounds)
            with contextlib.suppress(Exception):
                if finished:  # only a run that is over sends the sites home
                    await asyncio.wait_for(channel.finish(
                        coordinator.round, coordinator.stopped
                        or f"{coordinator.round} rounds"), 30)
                else:  # they wait for this run's --resume (or a new run)
                    await asyncio.wait_for(channel.pause(
                        "the coordinator stopped after round "
                        f"{coordinator.round}" + (f" ({failure})" if failure else "")), 30)
    if coordinator.stopped is None and coordinator.round >= settings.rounds:
        say(f"done: {coordinator.round} rounds")
    out = report(settings, plan, threshold, dim, coordinator, model,
                 in_features=len(schema.features), labels=schema.labels)
    out["role"] = "coordinator"
    out["site_ids"] = list(ids)
    out = fl_idp.remote_report(out) if settings.unit == "patient-idp" else out
    if failure is not None:
        out["failed"] = str(failure)
        raise RunFailed(failure, out, "the sites were not sent home: restart the coordinator, "
                        "with --resume to continue its --checkpoint") from failure
    return out
