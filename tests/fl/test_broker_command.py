"""``secagg broker``: the quickstart's one-machine try-out works from the docs alone.

The command writes the federation's credentials (a password per party, the embedded
broker's users file and ACL, Mosquitto's files) into a private directory and runs the
embedded broker on them; a coordinator and two sites, each its own process, then train
through it with only ``--broker mqtt://<user>@127.0.0.1:<port> --password-file <file>``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_multiprocess_training import COMMON, READY_TIMEOUT, REPO, Party

from fl.cli import main
from transport.broker.cli import load_acl_file, load_users_file
from transport.credentials import CredentialsError, write_federation
from transport.topics import acl_json

pytestmark = pytest.mark.timeout(180)


def test_the_files_are_private_and_readable_by_the_broker(tmp_path: Path) -> None:
    root = tmp_path / "fed"
    assert main(["broker", "--sites", "1,2,3", "--dir", str(root), "--write-only"]) == 0
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for path in root.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    users = load_users_file(str(root / "users.json"))
    assert sorted(users) == ["server", "site-1", "site-2", "site-3"]
    assert all(u.startswith("$") or "scrypt" in u for u in users.values())  # hashes only
    assert json.loads((root / "acl.json").read_text()) == acl_json([1, 2, 3])
    assert set(load_acl_file(str(root / "acl.json"))) == set(users)
    passwords = {p.name: p.read_text() for p in root.glob("*.pw")}
    again = write_federation(root, [1, 2, 3])  # a second run keeps every password
    assert {p.name: p.read_text() for p in again.passwords.values()} == passwords
    assert "site-1:" in (root / "mosquitto.passwd").read_text()
    assert "topic write secagg/+/server/+/site-2" in (root / "mosquitto.acl").read_text()


def test_a_planted_link_or_a_repeated_site_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "fed"
    root.mkdir(mode=0o700)
    (root / "site-1.pw").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CredentialsError, match="symbolic link"):
        write_federation(root, [1, 2])
    assert not (tmp_path / "elsewhere").exists()
    with pytest.raises(CredentialsError, match="distinct"):
        write_federation(tmp_path / "other", [1, 1, 2])


def test_the_one_machine_try_out_trains_through_it(tmp_path: Path) -> None:
    root, port_file = tmp_path / "fed", tmp_path / "port"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    broker = subprocess.Popen(
        [sys.executable, "-m", "fl.cli", "broker", "--sites", "2", "--dir", str(root),
         "--port", "0", "--port-file", str(port_file)], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    parties: list[Party] = []
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert broker.poll() is None and time.monotonic() < deadline, broker.stdout
            time.sleep(0.05)
        port = port_file.read_text().strip()

        def url(user: str) -> list[str]:
            return ["--broker", f"mqtt://{user}@127.0.0.1:{port}", "--password-file",
                    str(root / f"{user}.pw")]

        report = tmp_path / "report.json"
        coordinator = Party(["--role", "coordinator", "--sites", "2", "--rounds", "2",
                             "--report", str(report), "--join-timeout", "60",
                             "--ready-timeout", READY_TIMEOUT, *url("server"), *COMMON])
        parties.append(coordinator)
        for cid in (1, 2):
            parties.append(Party(["--role", "site", "--site-id", str(cid), "--sites", "2",
                                  "--dp", "none", "--idle-timeout", "60",
                                  *url(f"site-{cid}"), *COMMON]))
        assert coordinator.wait(150) == 0, coordinator.log
        rounds = json.loads(report.read_text())["rounds"]
        assert len(rounds) == 2 and all(sorted(r["included"]) == [1, 2] for r in rounds)
        site = parties[1]
        assert site.wait(60) == 0, site.log
        # the site's log says its policy in words (not a Python dict) and what it summed
        assert "privacy policy: modes none (" in site.log and "{'modes'" not in site.log
        assert "secure aggregations (the training rounds it joined, plus one for the " \
               "feature statistics" in site.log
    finally:
        for party in parties:
            party.kill()
        broker.terminate()
        broker.wait(10)


def test_port_0_prints_the_real_port_and_a_busy_port_names_this_commands_option(
        tmp_path: Path) -> None:
    """``--port 0``: every printed ``--broker`` URL carries the port the broker bound (the
    one in ``--port-file``), printed once it listens. A port in use: one error line naming
    ``secagg broker --port``, and nothing said the broker runs."""
    import socket

    env = dict(os.environ, PYTHONPATH=str(REPO))
    port_file = tmp_path / "port"
    broker = subprocess.Popen(
        [sys.executable, "-m", "fl.cli", "broker", "--sites", "2", "--dir", str(tmp_path / "a"),
         "--port", "0", "--port-file", str(port_file)], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert broker.stdout is not None
        lines = []
        while not lines or not lines[-1].startswith("embedded broker on"):
            line = broker.stdout.readline()
            assert line, broker.stderr.read() if broker.stderr else ""
            lines.append(line.rstrip("\n"))
        port = port_file.read_text().strip()
        urls = [line for line in lines if "--broker" in line]
        assert len(urls) == 3 and all(f"@127.0.0.1:{port} " in u for u in urls), lines
        assert "PORT" not in "\n".join(lines) and lines[-1].endswith(f"127.0.0.1:{port} "
                                                                     "(Ctrl-C stops it)")
    finally:
        broker.terminate()
        broker.wait(timeout=30)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = subprocess.run(
            [sys.executable, "-m", "fl.cli", "broker", "--sites", "2", "--dir",
             str(tmp_path / "b"), "--port", str(taken.getsockname()[1])], cwd=REPO, env=env,
            capture_output=True, text=True, timeout=60)
    assert busy.returncode == 1
    assert busy.stderr.startswith("secagg broker: error: cannot listen on 127.0.0.1:")
    assert "secagg broker --port" in busy.stderr and "port=0" not in busy.stderr
    assert "transport.broker" not in busy.stderr and "embedded broker on" not in busy.stdout
