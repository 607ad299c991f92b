"""Start and stop Flower's SuperLink and SuperNodes as real processes on 127.0.0.1.

Every process is started in its own session; ``stop`` signals it and every descendant
(the SuperExec and ClientApp/ServerApp processes Flower spawns detached), then kills what
is left after a grace period, so a test leaves no process behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.request import urlopen

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def environment(flwr_home: Path, root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["FLWR_HOME"] = str(flwr_home)
    tmp = flwr_home / "tmp"  # the nodes' stage records (fl.flower.guard) stay in the test's dir
    tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(tmp)
    env["XDG_STATE_HOME"] = str(flwr_home / "state")  # the nodes' default privacy ledgers
    return env


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([str(BIN / args[0]), *args[1:]], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_http(port: int, path: str, deadline: float) -> None:
    while True:
        try:
            with urlopen(f"http://127.0.0.1:{port}{path}", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing answered on 127.0.0.1:{port}{path}") from None
            time.sleep(0.3)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def stop(processes: list[subprocess.Popen[bytes]], grace: float = 5.0) -> None:
    pids = []
    for proc in processes:
        pids += [proc.pid, *_descendants(proc.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for proc in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2)
