"""``secagg train``: federated training across hospitals (docs/architecture.md section 4).

``--role all`` (the default) simulates every site in this process. ``--role coordinator``
and ``--role site`` run the same training across machines: one coordinator process, and one
process per hospital holding only its own data (:mod:`fl.remote`), all meeting at an MQTT
broker (``--broker mqtt(s)://user@host:port``) with an identity each.

Every round is one secure aggregation over the chosen broker (the embedded MQTT broker by
default: nothing to install). Progress goes to stderr, the per-round JSON report to
``--report`` (``round``, ``accuracy``, ``loss``, ``epsilon``, ``delta``, ``included``, plus
``dropped``, ``aggregate_correct``, ...). Training stops before the round that would exceed
the privacy budget and says so. ``--checkpoint DIR`` saves after every round; ``--resume``
continues from it. Torch is imported inside :func:`run` only, so ``secagg simulate`` and
``secagg budget`` work on a core install. The options: :mod:`fl.cli.train_options`; the
settings made from them: :mod:`fl.cli.train_settings`; what a run writes:
:mod:`fl.cli.train_report`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from dp import MODE_NONE, TORCH_EXTRA_INSTALL, PrivacyError
from fl.cli._common import (
    Stopped,
    UsageError,
    parse_sites,
    progress_log,
    setup_logging,
    stop_signals,
)
from fl.cli.train_options import add_parser as add_parser  # every command module has one
from fl.cli.train_report import check_output_paths, finish, finish_failed
from fl.cli.train_settings import settings_from_args, site_policy_from_args
from fl.settings import TrainSettings
from transport import SERVER_USER, LinkLost, MqttNetwork, parse_broker_url, probe, site_name


def default_ledger(site_id: int, data: Any) -> str:
    """``$XDG_STATE_HOME/secagg/ledger-site-<id>-<data fingerprint>.json``: one ledger per
    site and data set, outside any working tree. Nothing the coordinator chooses (broker
    address, federation name) is in the name, so no coordinator can start a site on a fresh
    budget; only changed data (another CSV) starts another ledger (docs/privacy.md)."""
    from fl.site.core import state_directory

    return str(state_directory() / f"ledger-site-{site_id}-{data.fingerprint()[:24]}.json")


def print_plan(args: argparse.Namespace, settings: TrainSettings) -> int:
    """``--plan``: the run's privacy plan, from the functions the run itself calls."""
    from fl.federation import privacy_plan, site_charge

    # --role coordinator: at the figure its sites charge (their own noise share only,
    # unless they know each other's keys: fl.federation.site_charge)
    charged = (site_charge(getattr(args, "peer_keys", None) is not None)
               if args.role == "coordinator" else None)
    plan = privacy_plan(settings, charged)  # a DataError or ValueError: exit 2
    if args.json:
        print(json.dumps(plan))
        return 0
    print(f"privacy plan: {plan['description']}")
    print(f"  mode {plan['mode']}, mechanism {plan['mechanism']}, accountant "
          f"{plan['accountant']}, delta {plan['delta']:g}, secagg threshold "
          f"{plan['secagg_threshold']} of {plan['cohort']} sites, feature scaling "
          f"{plan['feature_scaling']}")
    eps = plan["epsilon_after"]
    if plan["mode"] == MODE_NONE:
        print(f"  {plan['rounds_run']} rounds, no differential privacy")
    else:
        budget = plan["epsilon_budget"]
        print(f"  {plan['rounds_run']} of {plan['rounds_requested']} rounds run"
              + (f" (budget epsilon {budget:g} affords "
                 f"{plan['rounds_affordable'] or 'more than 100000'})" if budget else ""))
        if plan.get("site_weights"):
            print(f"  site weights: {plan['site_weights']}")
        if plan.get("epsilon_before_rounds"):
            before = [what for what, on in (
                ("the noised feature statistics", plan["feature_scaling"].startswith("noised")),
                ("the site weights' histograms", bool(plan.get("site_weights")))) if on]
            print(f"  before round    1: epsilon {plan['epsilon_before_rounds']:.4f} "
                  f"({' and '.join(before)})")
        for r, e in enumerate(eps, 1):
            if r <= 3 or r > len(eps) - 3 or r % max(1, len(eps) // 10) == 0:
                print(f"  after round {r:4d}: epsilon {e:.4f}")
    if plan.get("sources"):
        by: dict[str, list[str]] = {}
        for name, source in plan["sources"].items():
            if name == "noised":
                print(f"  noised releases: {source}")
                continue
            by.setdefault(source.split(" ")[0], []).append(name)
        for kind in ("operator", "public", "noised", "site-local"):
            if by.get(kind):
                print(f"  {kind}{' (declared)' if kind == 'operator' else ''}: "
                      + ", ".join(by[kind]))
    for warning in plan["warnings"]:
        print(f"  warning: {warning}")
    return 0


def broker_settings(args: argparse.Namespace, user: str) -> Any:
    """The ``--broker`` URL of a coordinator or site, with its password from a file or the
    environment (a password in the URL shows in the process list)."""
    if not args.broker.startswith(("mqtt://", "mqtts://")):
        raise ValueError(f"--role {args.role} connects to a broker shared by every party: "
                         "give --broker mqtt(s)://[user[:password]@]host:port")
    settings = parse_broker_url(args.broker)
    password = settings.password
    if args.password_file is not None:
        try:
            password = Path(args.password_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"--password-file: {exc}") from None
    elif password is None and os.environ.get("SECAGG_BROKER_PASSWORD"):
        password = os.environ["SECAGG_BROKER_PASSWORD"]
    username = settings.username
    if username is None and password is not None:
        username = user

    return replace(settings, username=username, password=password,
                   connect_timeout=args.connect_timeout,
                   reconnect_timeout=args.connect_timeout)


def _torch_missing() -> bool:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("opacus") is None:
        print(f"secagg train: this needs torch and opacus: install the extra with "
              f"{TORCH_EXTRA_INSTALL}", file=sys.stderr)
        return True
    return False


VACUOUS_EPSILON = 20.0
"""Above this ``--epsilon`` the guarantee is empty in practice: DP bounds by ``e**epsilon``
how much one patient's records can change the odds of anything the run releases, and
``e**20`` is about 5e8."""


def _warn_vacuous_epsilon(args: argparse.Namespace) -> None:
    epsilon = getattr(args, "epsilon", None)
    if epsilon is not None and epsilon > VACUOUS_EPSILON:
        print(f"secagg train: warning: --epsilon {epsilon:g} protects nothing: differential "
              f"privacy bounds by e^epsilon (here above e^{VACUOUS_EPSILON:g}, about "
              f"{math.exp(VACUOUS_EPSILON):.0e}) how much one patient's records can change "
              "what the run releases, and the noise it buys is negligible; pick epsilon "
              "of a few units (e.g. 1-8), or --dp none for an exact sum said as such",
              file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """``secagg train``. Errors go to the command line's one error path (fl/cli/app.py): a
    ``ValueError`` (bad options, data, checkpoint, policy) exits 2, a runtime failure (a
    round that kept aborting, a lost broker) exits 1, each in one line; SIGINT or SIGTERM
    (also in a process started in the background) stops it with one line and exit
    128 + the signal, as ``secagg simulate``."""
    try:
        with stop_signals():
            return _run(args)
    except Stopped as stopped:
        print(f"secagg train: interrupted by {signal.Signals(stopped.signum).name}",
              file=sys.stderr)
        return 128 + stopped.signum


def _run(args: argparse.Namespace) -> int:
    if _torch_missing():
        return 2
    _warn_vacuous_epsilon(args)
    if args.role != "all" and not (args.plan and args.role == "coordinator"):
        return run_remote(args)
    settings = settings_from_args(args)
    if args.plan:
        return print_plan(args, settings)
    from fl.aggregation import check_broker
    from fl.errors import RunFailed
    from fl.federation import train

    check_broker(settings.broker)
    check_output_paths(args)
    log = progress_log(args, "train")
    setup_logging(args, "train")
    completed: list[dict[str, Any]] = []
    try:
        report = train(settings, log=log, on_failure=completed.append)
    except Exception as exc:
        if not completed or not completed[0]["rounds"]:
            raise  # no round completed: nothing to write, the failure as it is
        finish_failed(args, settings, completed[0])
        raise RunFailed(exc, completed[0], "continue with --resume" if settings.checkpoint
                        else "") from exc
    return finish(args, settings, report)


def run_remote(args: argparse.Namespace) -> int:
    """``--role coordinator`` or ``--role site``: one party of a federation across machines."""
    settings, ids = _remote_settings(args)

    user = site_name(args.site_id) if args.role == "site" else SERVER_USER
    broker = broker_settings(args, user)
    network = MqttNetwork(broker)
    tag = f"site {args.site_id}" if args.role == "site" else "coordinator"
    log = progress_log(args, tag)
    setup_logging(args, tag)
    if args.role == "site":  # the site's own configuration is checked before the network
        return _run_site(args, settings, ids, network, log,
                         probe=lambda: _probe_broker(broker, user, args.connect_timeout))
    _probe_broker(broker, user, args.connect_timeout)
    return _run_coordinator(args, settings, ids, network, log)


def _probe_broker(broker: Any, user: str, timeout: float) -> None:
    """Fail in seconds, with the cause, when nothing accepts connections at ``--broker``'s
    address (a wrong host or port), instead of after the connection's retries."""
    try:
        probe(broker, timeout=min(5.0, timeout))
    except LinkLost as exc:
        raise LinkLost(f"{user}: {exc} (check --broker's host and port; is the broker "
                       "running? `secagg broker` runs one)") from None


def _remote_settings(args: argparse.Namespace) -> tuple[TrainSettings, tuple[int, ...]]:
    """The options of a party across machines, checked before anything connects."""
    if args.role == "site" and args.accountant == "pld":
        raise UsageError("a site's ledger composes each rate group's RDP: --role site plans "
                         "with --accountant rdp")
    if args.max_records_per_patient is not None and args.role == "coordinator":
        raise UsageError("--max-records-per-patient is read by each site (--role site with "
                         "--unit patient-idp), never by the coordinator")
    if args.budget_column is not None and (args.role != "site" or args.csv is None
                                           or args.unit != "patient-idp"):
        raise UsageError("--budget-column is read by each site (--role site with --csv and "
                         "--unit patient-idp), never by the coordinator")
    settings = settings_from_args(args)
    ids = parse_sites(args.sites, args.role)
    if args.role == "site":
        if args.site_id is None or not 1 <= args.site_id < 1 << 32:
            raise UsageError("--role site needs --site-id N (it connects as site-N)")
        if settings.csv is None and not ids:
            raise UsageError("a site of a bundled --dataset needs --sites (the number of "
                             "shards) to pick its shard by --site-id and --seed")
        if (args.signing_key is None) != (args.peer_keys is None):
            raise UsageError("--signing-key and --peer-keys go together: this site's key and "
                             "the federation's public keys (secagg keygen)")
    else:
        if args.site_id is not None:
            raise UsageError("--site-id is for --role site")
        if args.signing_key is not None:
            raise UsageError("--signing-key is a site's (--role site); the coordinator needs "
                             "only --peer-keys")
    if args.drop_rate:
        raise UsageError("--drop-rate simulates dropouts in --role all; across machines stop "
                         "or kill a site instead")
    check_output_paths(args)
    if args.eval_csv is not None and settings.csv is None:
        raise UsageError("--eval-csv goes with --csv (sites with their own tables)")
    from fl.remote.messages import FedTopics

    FedTopics(args.federation)
    return settings, ids


def _site_data(args: argparse.Namespace, settings: TrainSettings, ids: tuple[int, ...]
               ) -> Any:
    from fl.remote.inputs import SiteData, demo_site_data

    if settings.csv is None:
        if args.labels is not None:
            raise UsageError("--labels on a site goes with --csv (a bundled dataset's labels "
                             "are fixed)")
        return demo_site_data(settings, args.site_id, ids)
    labels = None if args.labels is None else [v.strip() for v in args.labels.split(",")]
    return SiteData(args.site_id, csv=settings.csv, patient_column=settings.patient_column,
                    label_column=settings.label_column, labels=labels,
                    budget_column=args.budget_column)


def _run_site(args: argparse.Namespace, settings: TrainSettings, ids: tuple[int, ...],
              network: Any, log: Any, probe: Callable[[], None]) -> int:
    """``--role site``: the hospital's own process, wrapped around its site core; ``probe``
    checks the broker once the site's own configuration has been checked."""
    from fl.remote.site import SiteOptions, SiteProcess
    from fl.site.core import open_site_core
    from fl.site.identity import SiteIdentity, fingerprint

    data = _site_data(args, settings, ids)
    identity = None if args.peer_keys is None else SiteIdentity.load(
        args.site_id, args.signing_key, args.peer_keys)
    ledger = args.ledger or default_ledger(args.site_id, data)
    try:
        guard = open_site_core(policy=site_policy_from_args(args), ledger_path=ledger, log=log)
    except (PrivacyError, OSError) as exc:
        raise UsageError(f"site privacy ledger/policy: {exc}") from None
    try:
        log(f"{guard.ledger.policy.describe()}; ledger {ledger} "
            f"({guard.ledger.releases} releases, epsilon {guard.ledger.epsilon:.4g})")
        if guard.ledger.policy.unit == "patient-idp":
            _site_idp(args, data, guard, log)
        options = SiteOptions(federation=args.federation, insecure_verify=args.insecure_verify,
                              require_dp=args.dp, idle_timeout=args.idle_timeout,
                              stage_timeout=args.stage_timeout, guard=guard,
                              identity=identity)
        if identity is not None:
            log(f"federation roster: {len(identity.peers)} site keys from {args.peer_keys}; "
                f"this site's key {fingerprint(identity.signing_key.public)}; rounds run "
                "authenticated (secagg malicious mode)")
        else:
            log("no --peer-keys: the roster is the coordinator's word, so a distributed "
                "round is charged as if this site's noise share were the only noise")
        site = SiteProcess(data, network, options, log)  # refuses e.g. --insecure-verify
        probe()
        return int(asyncio.run(site.run()))
    finally:
        guard.ledger.close()  # release the ledger's lock


def _site_idp(args: argparse.Namespace, data: Any, guard: Any, log: Any) -> None:
    """The site's own patient-idp rate groups, from its own table and budgets."""
    from fl.site.idp import SitePatients

    policy = guard.ledger.policy
    data.idp = SitePatients(args.site_id, data.table(data.schema.labels),
                            epsilon=policy.epsilon, delta=policy.delta,
                            max_records=args.max_records_per_patient,
                            budget_classes=args.budget_classes)
    log(f"patient-idp: {len(data.idp.groups.sizes)} rate groups from this site's table "
        "(records per patient" + (", --budget-column" if args.budget_column else "")
        + "); each is charged on its own")
    if args.max_records_per_patient is not None:
        groups = data.idp.groups
        log(f"--max-records-per-patient {args.max_records_per_patient}: "
            f"{groups.dropped_records} of {len(groups.record_group)} records dropped "
            "(never sampled)")


def _run_coordinator(args: argparse.Namespace, settings: TrainSettings,
                     ids: tuple[int, ...], network: Any, log: Any) -> int:
    """``--role coordinator``: announces the rounds and runs the server side."""
    from fl.errors import RunFailed
    from fl.remote.coordinator import RemoteOptions, train_coordinator
    from fl.site.identity import load_peer_keys

    labels = tuple(v.strip() for v in args.labels.split(",")) if args.labels else None
    peer_keys = None if args.peer_keys is None else load_peer_keys(args.peer_keys)
    options = RemoteOptions(site_ids=ids, federation=args.federation, labels=labels,
                            eval_csv=args.eval_csv, join_timeout=args.join_timeout,
                            ready_timeout=args.ready_timeout, stage_timeout=args.stage_timeout,
                            max_units=args.max_units, insecure_verify=args.insecure_verify,
                            peer_keys=peer_keys)
    try:
        report = train_coordinator(settings, options, network, log=log)
    except RunFailed as exc:  # (the sites were not sent home)
        finish_failed(args, settings, exc.report)
        raise
    return finish(args, settings, report)
