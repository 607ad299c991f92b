"""The tests' site executor and a dishonest server.

The site executor: :class:`fl.nvflare.client.SecAggExecutor` that records each
round's plaintext secagg input (so a test can check the aggregate against the plaintext
sum) and fails or stalls at the stages a plan names (drops at chosen stages)."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.shareable import make_reply
from nvflare.app_common.np.np_model_persistor import NPModelPersistor

from fl.nvflare.client import DIR_ENV, SecAggExecutor
from fl.nvflare.common import SETUP_HEADER, STAGE_TASK
from fl.nvflare.job import SecureScriptRunner
from fl.nvflare.server import SecureFedAvg
from fl.round_setup import RoundSetup

HERE = Path(__file__).resolve().parent

PLAN_ENV = "SECAGG_TEST_PLAN"
"""A JSON file: {"record": dir, "zero_round": round, "drops": {site: {round: [stage label,
"fail" | "kill" | "stall", seconds]}}, "scaling": [site, ...], "workspace": dir, "report":
path}: the scaling sites run the attacker's session (tests/scaling_site.py). A stalled site
is silent for ``seconds`` or until the server has reported the round (``report``: the
server's ``report_path``, searched under ``workspace`` when relative), whichever comes
first: its late answer still cannot be taken, and the simulator, which ends a job only
once every site's task has returned, does not wait out the rest of the stall (20 s of
35 in tests/nvflare/test_nvflare_user.py's dead site)."""

STAGES = ("advertise_keys", "share_keys", "masked_input", "consistency_check", "unmasking")


class RecordingExecutor(SecAggExecutor):
    def __init__(self, trainer_id: str = "secagg_trainer", train_task_name: str = "train"
                 ) -> None:
        super().__init__(trainer_id=trainer_id, train_task_name=train_task_name)
        self._round = -1
        self._stage = 0
        self._security = "semi-honest"

    def _plan(self) -> dict[str, Any]:
        return json.loads(Path(os.environ[PLAN_ENV]).read_text())

    def session(self, fl_ctx: Any) -> Any:
        session = super().session(fl_ctx)
        if self.site in self._plan().get("scaling", []):
            from tests.scaling_site import scaling

            return scaling(session)
        return session

    def on_input(self, setup: RoundSetup, vector: np.ndarray) -> None:
        record = Path(self._plan()["record"])
        np.save(record / f"{self.site}-r{setup.server_round}.npy", vector)

    def execute(self, task_name: str, shareable: Any, fl_ctx: Any, abort_signal: Any) -> Any:
        if task_name == STAGE_TASK:
            self._stage += 1
            if self._security != "malicious" and self._stage == 3:
                self._stage = 4  # no consistency check in semi-honest mode
        else:
            setup = RoundSetup.from_bytes(shareable.get_header(SETUP_HEADER))
            self._round, self._stage, self._security = setup.server_round, 0, setup.security
        drop = self._plan()["drops"].get(self.site, {}).get(str(self._round))
        if drop is not None and drop[0] == STAGES[self._stage]:
            if drop[1] == "kill":  # the whole site dies mid-round: its client and job process
                os.kill(os.getppid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            if drop[1] == "stall":
                _stall(self._plan(), self._round, float(drop[2]))
            else:
                return make_reply(ReturnCode.EXECUTION_EXCEPTION)  # the task failed
        return super().execute(task_name, shareable, fl_ctx, abort_signal)


def _reported(plan: dict[str, Any], server_round: int) -> bool:
    """Whether the server has written its report of ``server_round``."""
    if not plan.get("report"):
        return False
    report = Path(plan["report"])
    paths = [report] if report.is_absolute() else Path(plan["workspace"]).rglob(report.name)
    for path in paths:
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    if json.loads(line).get("server_round") == server_round:
                        return True
    return False


def _stall(plan: dict[str, Any], server_round: int, seconds: float) -> None:
    """Silent for ``seconds``, or until the server has reported ``server_round``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not _reported(plan, server_round):
        time.sleep(0.2)


class ZeroNoiseFedAvg(SecureFedAvg):
    """A server that announces distributed DP but sets every site's noise to 0 in the
    plan's ``zero_round`` (the attack the site policy's noise floor refuses). (NVFlare
    rebuilds a workflow from its ``__init__`` arguments, so the round comes from the plan.)"""

    def _setup(self, sites: list[str], server_round: int, specs: tuple[Any, ...]
               ) -> RoundSetup | None:
        setup = super()._setup(sites, server_round, specs)
        zero_round = json.loads(Path(os.environ[PLAN_ENV]).read_text()).get("zero_round")
        if setup is not None and setup.dp is not None and server_round == zero_round:
            return replace(setup, dp=replace(setup.dp, noise_stddev=0.0))
        return setup


def inputs(record: Path, server_round: int, sites: list[str]) -> list[np.ndarray]:
    """The secagg inputs ``sites`` recorded for ``server_round``."""
    return [np.load(record / f"{s}-r{server_round}.npy") for s in sites]


def plain_sum(vectors: list[np.ndarray], bits: int) -> list[int]:
    """The modular sum, in Python integers (exact)."""
    return [sum(int(v[i]) for v in vectors) % (1 << bits) for i in range(len(vectors[0]))]


def poc_project(folder: Path, clients: list[str], use_he: bool = False) -> str:
    """A POC project file like NVFlare's default (``PocEnv(project_conf_path=...)``) whose
    server listens on two free loopback ports instead of 8002/8003, so POC deployments of
    parallel runs on one machine do not answer each other's connections."""
    import socket

    from nvflare.tool.poc import poc_commands as poc

    folder.mkdir(parents=True, exist_ok=True)
    config = poc.load_yaml(poc.gen_project_config_file(str(folder)))
    config = poc.update_server_name(config)
    config = poc.update_clients(clients, len(clients), config)
    config = poc.add_he_builder(use_he, config)
    sockets = [socket.socket() for _ in range(2)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    (server,) = [p for p in config["participants"] if p["type"] == "server"]
    server["fed_learn_port"], server["admin_port"] = ports
    poc.save_project_config(config, str(folder / "project.yml"))
    return str(folder / "project.yml")


class EndImportWarmer(FLComponent):
    """On the server: imports, while the sites start, the module NVFlare 2.9 imports when
    a workflow ends (``WFCommServer.finalize_run`` imports
    ``nvflare.app_opt.pt.tensor_downloader``, hence torch, whenever torch is installed).
    Measured in a 1-round job of 3 sites: 4-9 s between "finalizing" and END_RUN, every
    run, a server otherwise idle waiting for its sites. Changes nothing else."""

    def handle_event(self, event_type: str, fl_ctx: Any) -> None:
        if event_type == EventType.START_RUN:
            threading.Thread(target=_import_quietly, daemon=True,
                             args=("nvflare.app_opt.pt.tensor_downloader",)).start()


def _import_quietly(module: str) -> None:
    """As NVFlare itself does: without torch the module is not there, and that is fine."""
    with contextlib.suppress(ImportError):
        importlib.import_module(module)


class MetaPersistor(NPModelPersistor):
    """NVFlare's numpy persistor that also keeps the saved model's metadata, as a persistor
    of a framework model does (``<result root>/models/saved_meta.jsonl``, one line per save)."""

    def save_model(self, model_learnable: Any, fl_ctx: Any) -> None:
        super().save_model(model_learnable, fl_ctx)
        folder = Path(fl_ctx.get_engine().get_workspace().get_result_root(
            fl_ctx.get_job_id())) / self.model_dir
        with open(folder / "saved_meta.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(model_learnable.get("meta") or {}) + "\n")


_LOST = re.compile(r"(?:Communication error with|Subprocess died for) client ([^:,\s]+)")


def lost_at_start(ws: Path) -> str | None:
    """A site NVIDIA FLARE's simulator lost before the site's worker process started: the
    simulator's log says it lost the site and the site's workspace has no log, which the
    worker writes first thing. (Seen under a CPU hog on both cores, once in each of two
    suite runs: "Communication error with client site-2: [Errno 104] Connection reset by
    peer" 0.1 s after the simulator launched the worker, too soon for the worker to listen
    on its port; the site then never runs and every round waits out its deadlines without
    it.) A site killed later by a test's plan has written its log, so it is not matched."""
    with contextlib.suppress(OSError):
        for name in _LOST.findall((ws / "server" / "log.txt").read_text(errors="replace")):
            if not (ws / name / "log.txt").exists():
                return str(name)
    return None


def _stop_simulator(ws: Path) -> None:
    """Kill the simulator and its site workers (each started in a session of its own)."""
    import psutil

    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(str(ws) in arg for arg in proc.cmdline()):
                proc.kill()


def _watch(ws: Path, done: threading.Event, lost: list[str]) -> None:
    """Until ``done``: a site lost at start (appended to ``lost``) stops the simulator."""
    while not done.wait(0.5):
        site = lost_at_start(ws)
        if site is not None:
            lost.append(site)
            _stop_simulator(ws)
            return


def run_job(tmp: Path, monkeypatch: Any, server: Any, sites: dict[str, dict],
            drops: dict[str, dict[str, list[Any]]], zero_round: int = -1,
            script: str = "train_script.py", persistor: Any = None,
            scaling: tuple[str, ...] = ()) -> Path:
    """Run a job of ``server`` on the simulator: ``sites``: site name -> its policy JSON,
    ``drops`` the plan's, ``script`` the training script here; returns the workspace
    (``run_job.status``: the simulator's exit status). A job whose site the simulator lost
    before the site started (:func:`lost_at_start`, NVIDIA FLARE's fault, not the
    package's) is stopped at once and run again from the same start, once."""
    from nvflare.fuel.utils.constants import FrameworkType
    from nvflare.job_config.api import FedJob

    for name, policy in sites.items():
        (tmp / "sites" / name).mkdir(parents=True, exist_ok=True)
        (tmp / "sites" / name / "policy.json").write_text(json.dumps(policy))
    start = tmp / "sites-at-start"  # what a second run starts from
    shutil.rmtree(start, ignore_errors=True)
    shutil.copytree(tmp / "sites", start)
    monkeypatch.setenv(PLAN_ENV, str(tmp / "plan.json"))
    monkeypatch.setenv(DIR_ENV, str(tmp / "sites"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(HERE.parents[1]), str(HERE), os.environ.get("PYTHONPATH", "")]))
    ws = tmp / "ws"
    for attempt in (1, 2):
        record = tmp / "record"
        record.mkdir()
        (tmp / "plan.json").write_text(json.dumps({"record": str(record), "drops": drops,
                                                   "zero_round": zero_round,
                                                   "scaling": list(scaling),
                                                   "workspace": str(ws),
                                                   "report": server.report_path}))
        job = FedJob(name="secure", min_clients=len(sites))
        job.set_app_packages(["nvflare_sites"])  # the sites' own test harness, never shipped
        job.to_server(server)
        job.to_server(persistor or NPModelPersistor(), id="persistor")
        job.to_server(EndImportWarmer(), id="end_import_warmer")
        job.to_clients(SecureScriptRunner(str(HERE / script), framework=FrameworkType.NUMPY,
                                          executor=RecordingExecutor()))
        done, lost = threading.Event(), []
        watcher = threading.Thread(target=_watch, args=(ws, done, lost), daemon=True)
        watcher.start()
        run_job.status = job.simulator_run(  # type: ignore[attr-defined]
            str(ws), clients=sorted(sites), threads=len(sites))  # the simulator's exit
        done.set()
        watcher.join()
        if not lost or attempt == 2:
            break
        print(f"the simulator lost {lost[0]} before it started; the job runs again")
        for folder in (record, ws, tmp / "sites"):
            shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(start, tmp / "sites")
        if server.report_path and Path(server.report_path).is_absolute():
            Path(server.report_path).unlink(missing_ok=True)
    return ws
