"""A site whose privacy ledger's disk is full: it refuses every round in one line each,
naming the ledger file, with no traceback (without ``-v``); the federation goes on without it
and nothing of the site is released uncharged."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from pathlib import Path

import pytest

from dp.policy import SitePolicy
from fl.remote.site import SiteOptions
from fl.settings import TrainSettings
from fl.site.core import open_site_core
from tests.fl.site_cores import site_core
from tests.fl.test_remote_roles import IDS, CountingNetwork, _federation

pytestmark = pytest.mark.timeout(120)


def test_a_full_ledger_disk_gives_one_line_per_round_and_no_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = tmp_path / "ledger-3.json"
    guard = open_site_core(policy=SitePolicy(modes=("none",)), ledger_path=str(ledger))
    import dp.ledger

    real_write = dp.ledger._write_at

    def full_disk(fd: int, data: bytes, offset: int) -> None:  # site 3's ledger only
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(ledger)):
            raise OSError(errno.ENOSPC, "No space left on device", str(ledger))
        real_write(fd, data, offset)

    monkeypatch.setattr(dp.ledger, "_write_at", full_disk)
    settings = TrainSettings(sites=3, rounds=3, dataset="breast-cancer", seed=0)
    logs: list[str] = []
    options = {cid: SiteOptions(federation="fed", idle_timeout=30, insecure_verify=True,
                                require_dp="none", guard=guard if cid == 3 else site_core())
               for cid in IDS}
    caplog.set_level(logging.WARNING)
    try:
        report, codes = asyncio.run(_federation(settings, CountingNetwork(), options, logs))
    finally:
        guard.ledger.close()
    text = "\n".join(logs)
    assert codes == [0, 0, 0], text
    site3 = [line for line in logs if line.startswith("[site 3]")
             and "refusing the round" in line]
    assert len(site3) == 4, text  # feature scaling and rounds 1-3: one line each
    for line in site3:  # the coordinator hears the rule; the site's log has the file
        assert "cannot write its privacy ledger" in line and str(ledger) not in line
    detail = [line for line in logs if line.startswith("[site 3]")
              and f"cannot write the privacy ledger {ledger}: No space left on device" in line]
    assert len(detail) == 4, text
    assert [line.split(":")[0] for line in site3] == [
        "[site 3] feature scaling", "[site 3] round 1", "[site 3] round 2", "[site 3] round 3"]
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    assert "Traceback" not in text and "Traceback" not in caplog.text
    for row in report["rounds"]:
        assert row["included"] == [1, 2] and row["aggregate_correct"] is True
    # nothing was written: at most the empty file the append opened
    assert (not ledger.exists() or ledger.stat().st_size == 0) and not list(
        tmp_path.glob("*.tmp"))
