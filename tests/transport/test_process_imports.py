"""What each process of ``secagg simulate`` imports at its start (issue 32: imports were
most of the command's CPU). The embedded broker's process (``python -m transport.broker``)
imports the broker alone: not numpy, secagg or the MQTT client library."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("numpy", "secagg", "paho", "aiomqtt", "cryptography")


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=120)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_embedded_broker_process_imports_only_the_broker() -> None:
    loaded = _modules_after("import transport.broker.cli")
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
    assert heavy == [], heavy
    assert "transport.broker.broker" in loaded


def test_the_front_door_still_exports_every_name_on_first_use() -> None:
    loaded = _modules_after("import transport\nassert transport.SERVER_USER == 'server'\n"
                            "from transport import Topics, run_simulation, broker_main\n"
                            "assert transport.MqttNetwork.__module__ == 'transport.mqtt'")
    assert {"transport.runner", "transport.mqtt", "transport.broker.cli"} <= loaded


PRELOADED = ("numpy.random", "secagg.client", "transport.client_driver", "transport.workers")


def _report_loaded(conn: Any) -> None:
    conn.send([m for m in PRELOADED if m in sys.modules])
    conn.close()


def test_workers_start_from_a_fork_server_that_imported_their_code() -> None:
    """A ``secagg simulate`` worker starts with the sites' code already imported (forked
    from the fork server, which imported it once), not importing it again as a spawned
    process would: this test's own module imports none of it."""
    import multiprocessing

    from transport.workers import START_METHOD, worker_context

    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork server on this platform: workers are spawned")
    assert START_METHOD == "forkserver"
    ctx = worker_context()
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_report_loaded, args=(send,))
    proc.start()
    send.close()
    try:
        assert receive.poll(60), "the process did not report"
        assert receive.recv() == list(PRELOADED)
    finally:
        proc.join(30)
