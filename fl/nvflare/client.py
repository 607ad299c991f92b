"""Client side: the site's executor, around the user's own Client API training script.

The user's script keeps its code (``flare.receive()`` ... ``flare.send()``); NVFlare's
``ClientAPIExecutor`` runs it, registered as a component (default id ``secagg_trainer``),
and :class:`SecAggExecutor` is the executor of the job's train task and of
:data:`fl.nvflare.common.STAGE_TASK`. It is one runtime of the site session
(:mod:`fl.site.session` over :mod:`fl.site.core`: the same policy, ledger, checks, replay and
withdrawal rules as ``secagg train --role site`` and the Flower node). For a train task it:

1. checks the round setup the server sent (:class:`fl.round_setup.RoundSetup`: its run id
   is this job's, its roster names this site, the arrays sent have its layout) and, in
   malicious mode, that it gives this site its own verify key and only enrolled keys;
2. has the site core check the protocol margins and the release against the site's policy
   and charge it, write-ahead, to the site's ledger (a refused round never trains);
3. only then runs the user's training (the inner executor), encodes its result (weighted
   FedAvg with the count, or the distributed-DP encoding with the site's noise share:
   :func:`fl.round_reply.encode_reply`) and answers with its public key advertisement only.

Every later stage goes to the same ``secagg.Client``, kept in this process's memory (the
NVFlare client job process): no snapshot and no secret leaves it, and every reply carries
only secagg wire bytes. A new round's setup erases an unfinished earlier round; a finished
or aborted round is erased.

**The site's own word.** A job's configuration comes from whoever submits the job, so the
site's policy, ledger and identity are read from the site's folder, never from the job:
``$SECAGG_NVFLARE_DIR/<site name>/`` (default ``$XDG_STATE_HOME/secagg/nvflare/<site
name>/``): ``policy.json`` (a :class:`dp.policy.SitePolicy`; absent: ``SitePolicy()``,
distributed DP only), ``ledger.json`` (the write-ahead ledger), and in malicious mode
``signing-key`` (hex Ed25519 private key) and ``trusted-keys.json`` (the enrolled sites'
verify keys, hex). In NVFlare's simulator, unless ``$SECAGG_NVFLARE_DIR`` is set, the ledger
is the run's own instead: ``<simulator workspace>/<site>/<job id>/secagg/ledger.json`` (the
simulator empties its workspace at each start), so one simulation does not spend another's
budget; a deployed site's ledger persists across jobs (the patients are the same). Every
refusal is logged at the site and answered with an error reply, which the server counts as
this site dropping out at that stage.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from nvflare.apis.event_type import EventType
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLMetaKey, ParamsType
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from dp import PolicyRefused, PrivacyError, SitePolicy
from fl.errors import FLError
from fl.nvflare.common import (
    PAYLOAD,
    PROJECT_PACKAGES,
    PROOF,
    REFUSAL_HEADER,
    SESSION,
    SETUP_HEADER,
    STAGE_TASK,
    NVFlareSecAggError,
    run_id,
    site_id,
)
from fl.round_setup import RoundSetup
from fl.site.core import open_site_core, state_directory
from fl.site.session import SiteSession
from fl.vector import ArrayLayout, LayoutError
from secagg import Client, ProtocolAbort, SecAggError, SigningKey, encode

DIR_ENV = "SECAGG_NVFLARE_DIR"
"""Environment variable: the folder of the sites' own configuration (module docstring)."""


@dataclass(frozen=True)
class SiteConfig:
    """One site's own configuration, read from its folder (module docstring)."""

    folder: Path
    policy: SitePolicy
    signing_key: SigningKey | None
    trusted_keys: frozenset[bytes]
    ledger: Path | None = None
    """The ledger's path when it is not the folder's ``ledger.json`` (a simulator run's)."""

    @property
    def ledger_path(self) -> str:
        return str(self.ledger or self.folder / "ledger.json")

    @classmethod
    def for_site(cls, site: str, simulation: Path | None = None) -> SiteConfig:
        """``simulation``: the run folder NVFlare's simulator gave this site's job (see
        :func:`simulation_run_dir`); without ``$SECAGG_NVFLARE_DIR`` (the operator's
        explicit folder, which always wins) the ledger lives there, one per simulator run
        (the simulator empties its workspace at each start), so two simulations on one
        machine do not charge the same ledger. The policy and identity are still read
        from the site's folder."""
        base = os.environ.get(DIR_ENV)
        folder = (Path(base) if base else state_directory() / "nvflare") / site
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        ledger = None
        if simulation is not None and not base:
            state = simulation / "secagg"
            state.mkdir(parents=True, exist_ok=True, mode=0o700)
            ledger = state / "ledger.json"
        policy_file = folder / "policy.json"
        policy = SitePolicy.load(policy_file) if policy_file.exists() else SitePolicy()
        key_file, trusted_file = folder / "signing-key", folder / "trusted-keys.json"
        signing = None
        if key_file.exists():
            try:
                signing = SigningKey.from_private_bytes(
                    bytes.fromhex(key_file.read_text().strip()))
            except ValueError as exc:
                raise NVFlareSecAggError(f"{key_file}: not a hex Ed25519 private key "
                                         f"({exc})") from None
        trusted: frozenset[bytes] = frozenset()
        if trusted_file.exists():
            try:
                trusted = frozenset(bytes.fromhex(k) for k in json.loads(
                    trusted_file.read_text()))
            except (ValueError, TypeError) as exc:
                raise NVFlareSecAggError(f"{trusted_file}: expected a JSON list of hex "
                                         f"verify keys ({exc})") from None
        return cls(folder, policy, signing, trusted, ledger)


def simulation_run_dir(fl_ctx: FLContext) -> Path | None:
    """The job's run folder in the site's workspace when NVFlare's simulator runs the site
    (its engine marks every context ``FLContextKey.SIMULATE_MODE``; a deployed client's
    engine does not), else None."""
    if not fl_ctx.get_prop(FLContextKey.SIMULATE_MODE, False):
        return None
    workspace = fl_ctx.get_engine().get_workspace()
    return Path(workspace.get_run_dir(str(fl_ctx.get_job_id())))


class SecAggExecutor(Executor):
    """The executor of a site in a securely aggregated NVFlare job (module docstring).

    ``trainer_id``: the component id of the executor that runs the user's training
    (NVFlare's ``ClientAPIExecutor``); ``train_task_name``: the job's train task."""

    def __init__(self, trainer_id: str = "secagg_trainer",
                 train_task_name: str = AppConstants.TASK_TRAIN) -> None:
        super().__init__()
        self.trainer_id = trainer_id
        self.train_task_name = train_task_name
        self.trainer: Executor | None = None
        self.site = ""
        self.config: SiteConfig | None = None
        self.rounds: dict[bytes, tuple[Client, int]] = {}
        """The round in progress: its client and its ledger charge id."""

    # --- NVFlare hooks --------------------------------------------------------------------

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_RUN:
            trainer = fl_ctx.get_engine().get_component(self.trainer_id)
            if not isinstance(trainer, Executor):
                self.system_panic(f"SecAggExecutor: no training executor with component id "
                                  f"{self.trainer_id!r} (add ClientAPIExecutor under that "
                                  "id: fl.nvflare.job.secure_fedavg_job)", fl_ctx)
                return
            self.site = fl_ctx.get_identity_name()
            try:
                # the site's check of the job: the train task goes through this session
                self.check_app(fl_ctx.get_prop(FLContextKey.APP_ROOT))
                config = SiteConfig.for_site(self.site, simulation_run_dir(fl_ctx))
            except (FLError, PrivacyError) as exc:  # nothing of the job is trained
                self.system_panic(f"site {self.site}: {exc}", fl_ctx)
                return
            self.trainer, self.config = trainer, config
            self.log_warning(fl_ctx, f"site {self.site}: {self.config.policy.describe()}; "
                                     f"ledger {self.config.ledger_path}")
        elif event_type == EventType.END_RUN:
            self.rounds.clear()

    def check_app(self, app_root: object) -> None:
        """At START_RUN, before anything of the job runs: the job's client app must route
        its train and stage tasks to this executor, installed at the site, and ship none of
        the project's code (:func:`fl.nvflare.job.check_site_app`); a site that cannot
        check it refuses the job."""
        if not isinstance(app_root, str) or not app_root:
            raise NVFlareSecAggError("NVFlare gave no app root: this site cannot check that "
                                     "the job's train task goes through its session; refused")
        check_site_app(self, app_root, self.train_task_name)

    def requires_materialized_task_result(self, task_name: str) -> bool:
        """NVFlare asks: this executor consumes the trainer's result itself (it never
        leaves the site), so an external-process trainer must hand it over in full."""
        return task_name == self.train_task_name

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext,
                abort_signal: Signal) -> Shareable:
        try:
            if task_name == STAGE_TASK:
                return self._continue(shareable, fl_ctx)
            if task_name == self.train_task_name:
                return self._start(task_name, shareable, fl_ctx, abort_signal)
            raise NVFlareSecAggError(f"task {task_name!r} is not part of a secure round; "
                                     "this executor answers only the train task and "
                                     f"{STAGE_TASK!r}")
        except (FLError, PrivacyError, SecAggError, ValueError) as exc:
            self.log_error(fl_ctx, f"site {self.site} refuses {task_name}: "
                                   f"{type(exc).__name__}: {exc}")
            reply = make_reply(ReturnCode.EXECUTION_EXCEPTION)
            public = exc.public if isinstance(exc, PolicyRefused) else str(exc)
            reply.set_header(REFUSAL_HEADER, f"{type(exc).__name__}: {public}"[:1000])
            return reply

    # --- a round ----------------------------------------------------------------------------

    def on_input(self, setup: RoundSetup, vector: np.ndarray) -> None:
        """Called with the site's secagg input once it is encoded (nothing by default)."""

    def session(self, fl_ctx: FLContext) -> SiteSession:
        """The site's session (:mod:`fl.site.session`) over its core and identity."""
        config = self.config
        if config is None:
            raise NVFlareSecAggError("the executor was not started (START_RUN)")
        return SiteSession(
            lambda: open_site_core(policy=config.policy, ledger_path=config.ledger_path,
                                   log=lambda text: self.log_info(fl_ctx, text)),
            runtime="nvflare", signing_key=config.signing_key,
            trusted_keys=config.trusted_keys, log=lambda text: self.log_info(fl_ctx, text))

    def _start(self, task_name: str, shareable: Shareable, fl_ctx: FLContext,
               abort_signal: Signal) -> Shareable:
        if self.trainer is None or self.config is None:
            raise NVFlareSecAggError("the executor was not started (START_RUN)")
        raw = shareable.get_header(SETUP_HEADER)
        if raw is None:
            raise NVFlareSecAggError("the train task carries no secure-aggregation setup: this "
                                     "site sends its update only into a secure sum (run the "
                                     "job with fl.nvflare.server.SecureFedAvg)")
        session = self.session(fl_ctx)
        unfinished = next(iter(self.rounds.values()), None)
        params = FLModelUtils.from_shareable(shareable).params or {}
        joined = session.join(
            raw, run_id=run_id(str(fl_ctx.get_job_id())), node_id=site_id(self.site),
            sent=lambda setup: ArrayLayout(setup.arrays).flatten(params),
            previous=None if unfinished is None else (unfinished[1],
                                                      int(unfinished[0].stage)),
            erase=self.rounds.clear)
        self.rounds.clear()  # an unfinished earlier round is gone
        result = self.trainer.execute(task_name, shareable, fl_ctx, abort_signal)
        if result.get_return_code(ReturnCode.OK) != ReturnCode.OK:
            return result  # the training failed: the site drops out (its charge stays)
        sent = ArrayLayout(joined.setup.arrays).flatten(params)
        vector = session.encode(joined, *self._trained(joined.setup, sent, result))
        client, advertisement = session.advertise(joined, vector)
        self.rounds[client.session_id] = (client, joined.charge)
        self.on_input(joined.setup, vector)
        return _reply(client.session_id, advertisement)

    def _trained(self, setup: RoundSetup, sent: np.ndarray, result: Shareable
                 ) -> tuple[np.ndarray, dict[str, float], float]:
        """The arrays (full, not a difference), averaged metrics and weight of the user's
        training result."""
        model = FLModelUtils.from_shareable(result)
        try:
            arrays = ArrayLayout(setup.arrays).flatten(
                {k: np.asarray(v) for k, v in (model.params or {}).items()})
        except LayoutError as exc:
            raise NVFlareSecAggError(f"the training script sent arrays that do not match the "
                                     f"model it received: {exc}") from None
        if model.params_type == ParamsType.DIFF:
            arrays = sent + arrays
        weight = float((model.meta or {}).get(FLMetaKey.NUM_STEPS_CURRENT_ROUND, 1.0))
        missing = [name for name in setup.metrics if name not in (model.metrics or {})]
        if missing:
            raise NVFlareSecAggError(f"the round averages the train metrics {missing}, which "
                                     "the training script did not send (FLModel.metrics)")
        return arrays, {name: float(model.metrics[name]) for name in setup.metrics}, weight

    def _continue(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        session, payload = shareable.get(SESSION), shareable.get(PAYLOAD)
        entry = self.rounds.get(session) if isinstance(session, bytes) else None
        if entry is None:
            raise NVFlareSecAggError("no secure-aggregation round of that session is in "
                                     "progress on this site (never joined, or ended)")
        if not isinstance(payload, bytes):
            raise NVFlareSecAggError("the stage task carries no secure-aggregation payload")
        client, charge = entry
        try:
            proof, message = self.session(fl_ctx).answer_with_proof(client, payload, charge)
        except ProtocolAbort:
            self.rounds.pop(session, None)  # the round's secrets are erased
            raise
        if client.done:
            self.rounds.pop(session, None)
        return _reply(session, encode(message), proof)


def _reply(session: bytes, payload: bytes, proof: bytes | None = None) -> Shareable:
    reply = Shareable()
    reply[SESSION] = session
    reply[PAYLOAD] = payload
    if proof is not None:  # input validation: checked before the masked input
        reply[PROOF] = proof
    reply.set_return_code(ReturnCode.OK)
    return reply


def check_site_app(executor: Any, app_root: str | Path, train_task_name: str) -> None:
    """The site's check of a job's client app before it trains (raises
    :class:`NVFlareSecAggError`): the train task and the stage task go to ``executor``, a
    :class:`SecAggExecutor` whose classes come from the site's own installation, and the
    app's ``custom/`` folder carries none of :data:`PROJECT_PACKAGES`. ``app_root``: the
    job's app folder at the site (``fl_ctx.get_prop(FLContextKey.APP_ROOT)``)."""
    app_root = Path(app_root)
    custom = (app_root / "custom").resolve()
    shipped = sorted(p for p in PROJECT_PACKAGES
                     if (custom / p).exists() or (custom / f"{p}.py").exists())
    if shipped:
        raise NVFlareSecAggError(
            f"the job ships its own copy of {', '.join(shipped)} in {custom}: this site runs "
            "only the secagg it installed; build the job with SecureScriptRunner (it sets "
            "the project's packages as app packages) and do not replace its app packages")
    if not isinstance(executor, SecAggExecutor):
        raise NVFlareSecAggError(f"the site executor {type(executor).__name__} is not a "
                                 "SecAggExecutor: the train task must go through the session")
    for cls in type(executor).__mro__:
        source = inspect.getsourcefile(cls) if cls.__module__ != "builtins" else None
        if source is not None and Path(source).resolve().is_relative_to(custom):
            raise NVFlareSecAggError(
                f"the job ships its own site executor ({cls.__module__}.{cls.__qualname__} "
                f"in {custom}): this site runs only executors it installed")
    path = f"{type(executor).__module__}.{type(executor).__qualname__}"
    for task in (train_task_name, STAGE_TASK):
        routed = [entry.get("executor", {}).get("path") for entry in _client_executors(app_root)
                  if task in entry.get("tasks", ())]
        if routed != [path]:
            raise NVFlareSecAggError(
                f"the job routes its {task!r} task to {routed or 'no executor'}, not to this "
                f"site's session executor {path}: refused (only SecureScriptRunner's "
                "executor may train)")


def _client_executors(app_root: Path) -> list[dict[str, Any]]:
    """The ``executors`` of the app's ``config_fed_client.json`` (in ``config/`` or the app
    root, as NVFlare looks)."""
    for folder in (app_root / "config", app_root):
        path = folder / "config_fed_client.json"
        if path.is_file():
            try:
                config = json.loads(path.read_text(encoding="utf-8"))
                return list(config.get("executors", []))
            except (OSError, ValueError, AttributeError, TypeError) as exc:
                raise NVFlareSecAggError(f"cannot read {path}: {exc}") from None
    raise NVFlareSecAggError(f"no config_fed_client.json in {app_root}")
