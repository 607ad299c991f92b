"""``kill -9`` of ``secagg train --role all`` or ``secagg simulate``: nothing they started
runs on, and the broker's private folder (its users and ACL files) does not stay.

A SIGKILLed process runs no cleanup, so its children stop by themselves: the embedded broker
and every ``secagg simulate`` worker watch their parent (``transport.lifeline``); the broker
removes its folder first. Before, the broker ran on, orphaned, with its folder, every time.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_cli_simulate import SIGNAL_POINTS, _processes_of, _start_cli
from transport.workers import FORK_SERVER_ENV, SOCKET_PATH_MAX

pytestmark = [pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc"),
              pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[1]
GONE_WITHIN = 3.0
"""Seconds from the SIGKILL: the children poll their parent every 0.2 s, and the broker
removes its folder before it stops."""


def _wait_until(predicate: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return bool(predicate())  # type: ignore[operator]


def _kill_and_check(proc: subprocess.Popen[str], tmp: Path) -> None:
    before = _processes_of(proc.pid, str(tmp))
    assert len(before) >= 2, before  # the command and what it started
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert _wait_until(lambda: _processes_of(proc.pid, str(tmp)) == [], GONE_WITHIN), \
        _processes_of(proc.pid, str(tmp))
    assert _wait_until(lambda: list(tmp.iterdir()) == [], GONE_WITHIN), list(tmp.iterdir())


def test_kill_9_of_train_role_all_leaves_no_broker_and_no_folder(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fl.cli", "train", "--role", "all", "--sites", "3",
         "--rounds", "2000", "--dataset", "breast-cancer", "--seed", "0"],
        cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert _wait_until(lambda: list(tmp.glob("secagg-broker-*/port")), 60), \
            "the embedded broker never listened"
        (folder,) = tmp.glob("secagg-broker-*")
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert {p.name for p in folder.iterdir()} >= {"users", "acl"}
        _kill_and_check(proc, tmp)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _fork_server_folders(pids: list[int]) -> set[Path]:
    """The socket folders of the fork servers among ``pids`` (from their environment)."""
    found = set()
    for pid in pids:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(FORK_SERVER_ENV.encode() + b"="):
                found.add(Path(entry.split(b" ", 1)[1].decode()))
    return found


@pytest.mark.parametrize("point", ["workers-starting", "round-running"])
def test_kill_9_of_simulate_leaves_no_worker_broker_or_folder(tmp_path: Path,
                                                              point: str) -> None:
    proc = _start_cli(tmp_path, "--clients", "6", "--dim", "4000000", "--processes", "2")
    tmp = tmp_path / "tmp"
    try:
        assert _wait_until(lambda: SIGNAL_POINTS[point](tmp), 60), f"{point} not reached"
        _kill_and_check(proc, tmp)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_a_tmpdir_too_long_for_a_socket_runs_and_leaves_no_socket_folder(
        tmp_path: Path) -> None:
    """A ``TMPDIR`` whose fork-server socket path would pass the Unix limit (a test runner's
    nested folder): the command ran no worker and exited 1 with "AF_UNIX path too long".
    The socket's folder goes to a short folder, and is removed after a SIGKILL too."""
    deep = tmp_path / ("nested-" * 12)
    deep.mkdir()
    tmp = deep / "tmp"
    assert len(os.fsencode(tmp)) + 32 > SOCKET_PATH_MAX
    proc = _start_cli(deep, "--clients", "6", "--dim", "4000000", "--processes", "2")
    try:
        assert _wait_until(lambda: SIGNAL_POINTS["round-running"](tmp), 60), \
            proc.poll() and proc.communicate()
        folders = _fork_server_folders(_processes_of(proc.pid, str(tmp)))
        assert len(folders) == 1, folders
        folder = folders.pop()
        assert folder.is_dir() and len(os.fsencode(folder)) + 18 <= SOCKET_PATH_MAX
        _kill_and_check(proc, tmp)
        assert _wait_until(lambda: not folder.exists(), GONE_WITHIN), list(folder.iterdir())
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_watch_parent_fires_only_once_the_parent_is_gone() -> None:
    import threading

    from transport.lifeline import watch_parent

    ours, other = threading.Event(), threading.Event()
    watch_parent(os.getppid(), ours.set, interval=0.01)
    watch_parent(os.getpid(), other.set, interval=0.01)  # not our parent: "already gone"
    assert other.wait(2.0)
    assert not ours.wait(0.3)
    with pytest.raises(ValueError, match="parent_pid"):
        watch_parent(0, ours.set)


def test_the_broker_refuses_remove_if_orphaned_without_parent_pid(tmp_path: Path) -> None:
    from transport.broker.cli import main

    assert main(["--users-file", str(tmp_path / "u"), "--remove-if-orphaned",
                 str(tmp_path)]) == 2
    assert tmp_path.exists()
