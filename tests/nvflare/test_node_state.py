"""Where a site's privacy ledger lives (issue 27, "per-run node state"): in NVFlare's
simulator each run has its own ledger, so a second simulation on one machine is not charged
with what the first spent; ``$SECAGG_NVFLARE_DIR`` (the operator's explicit folder) wins, and
then the second run is charged on top of the first; a deployed site (no simulator) keeps its
folder's ledger across jobs. Three default sites (no ``policy.json``), one DP round per run,
the tests' numpy script (tests/nvflare/train_script.py). Three simulator runs (the third
in the operator's folder, which holds what the first spent): about 2 minutes on this shared
2-core machine at load 9, hence ``slow``."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("nvflare.apis")  # not the namespace of tests/nvflare/ itself

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from nvflare_sites import EndImportWarmer  # noqa: E402

from dp.ledger import read_charges  # noqa: E402
from fl.nvflare.client import DIR_ENV, SecAggExecutor  # noqa: E402
from fl.nvflare.job import SecureScriptRunner  # noqa: E402
from fl.nvflare.server import SecureFedAvg  # noqa: E402
from fl.site.core import state_directory  # noqa: E402
from tests.nvflare.test_job_hygiene import _Engine, _export, _plain  # noqa: E402

SITES = ["site-1", "site-2", "site-3"]


def _simulate(workspace: Path) -> None:
    """One DP round of the three sites on NVFlare's simulator."""
    from nvflare.app_common.np.np_model_persistor import NPModelPersistor
    from nvflare.fuel.utils.constants import FrameworkType
    from nvflare.job_config.api import FedJob

    job = FedJob(name="secure", min_clients=len(SITES))
    job.to_server(SecureFedAvg(num_rounds=1, neighbors=None,
                               dp={"clip_norm": 1.0, "epsilon": 8.0, "rounds": 4},
                               report_path=str(workspace.parent / "reports.jsonl")))
    job.to_server(NPModelPersistor(), id="persistor")
    job.to_server(EndImportWarmer(), id="end_import_warmer")  # nvflare_sites: 4-9 s a run
    job.to_clients(SecureScriptRunner(str(HERE / "train_script.py"),
                                      framework=FrameworkType.NUMPY))
    assert job.simulator_run(str(workspace), clients=SITES, threads=len(SITES)) == 0


def _spent(path: Path) -> list[float]:
    return [c.epsilon_after for c in read_charges(path)] if path.exists() else []


@pytest.fixture
def sites_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv(DIR_ENV, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(HERE.parents[1]), str(HERE), os.environ.get("PYTHONPATH", "")]))
    return state_directory() / "nvflare"  # the sites' own folders by default


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_simulations_do_not_share_ledgers_unless_the_folder_is_explicit(
        sites_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    workspace = tmp_path / "ws"  # the same workspace twice, as the example's default
    explicit = tmp_path / "operator"
    runs = []
    for _ in range(2):
        _simulate(workspace)
        runs.append({s: _spent(workspace / s / "simulate_job" / "secagg" / "ledger.json")
                     for s in SITES})
        if not explicit.exists():  # the operator's folder: holding what the first run spent
            for site in SITES:
                (explicit / site).mkdir(parents=True)
                shutil.copy(workspace / site / "simulate_job" / "secagg" / "ledger.json",
                            explicit / site / "ledger.json")
    for spent in runs:  # each run: one charge per site, in the run's own folder
        assert all(len(v) == 1 and v[0] > 0 for v in spent.values()), runs
    assert runs[0] == runs[1]  # the second started from zero
    assert not list(sites_env.rglob("ledger.json"))  # nothing in the sites' folders

    # the operator names that folder: it wins, and the third run is charged on top of what
    # the first spent there (tests/flower/test_node_state.py names the first run's folder)
    monkeypatch.setenv(DIR_ENV, str(explicit))
    _simulate(tmp_path / "ws2")
    for site in SITES:
        spent = _spent(explicit / site / "ledger.json")
        assert len(spent) == 2 and spent[1] > spent[0] == runs[0][site][0]
        assert not (tmp_path / "ws2" / site / "simulate_job" / "secagg").exists()


def test_a_deployed_site_keeps_its_folders_ledger_across_jobs(
        sites_env: Path, tmp_path: Path) -> None:
    """NVFlare's START_RUN of two jobs at a deployed site (its engine does not mark the
    context as the simulator's): both open the ledger in the site's own folder."""
    from nvflare.apis.event_type import EventType
    from nvflare.apis.fl_constant import FLContextKey, ReservedKey
    from nvflare.apis.fl_context import FLContext

    paths = []
    for job in ("a", "b"):
        ctx = FLContext()
        ctx.set_prop(ReservedKey.ENGINE, _Engine(_plain()), private=True, sticky=False)
        ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-1", private=False, sticky=False)
        ctx.set_prop(FLContextKey.APP_ROOT, str(_export(tmp_path / job)), private=True,
                     sticky=False)
        executor = SecAggExecutor()
        executor.handle_event(EventType.START_RUN, ctx)
        assert executor.config is not None
        paths.append(executor.config.ledger_path)
    assert paths == [str(sites_env / "site-1" / "ledger.json")] * 2
