"""``python -m transport.broker`` as an operator runs it: TLS with client certificates,
plaintext refused off loopback, password hashes in the users file, one-line errors."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import aiomqtt
import pytest
from certs import make_pki

from transport.broker import hash_password

ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package


def broker_cli(*argv: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "transport.broker", *argv], cwd=cwd,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_port(proc: subprocess.Popen[str], port_file: Path) -> int:
    deadline = time.monotonic() + 15
    while not port_file.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return int(port_file.read_text())


def test_plaintext_off_loopback_is_refused_in_one_line(tmp_path: Path) -> None:
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"server": hash_password("pw", log2_n=4)}))
    proc = broker_cli("--host", "0.0.0.0", "--users-file", str(users), cwd=tmp_path)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--allow-plaintext" in lines[0] and "TLS" in lines[0]


@pytest.mark.parametrize(("argv", "hint"), [
    (["--require-certificate", "--certfile", "c.pem"], "--cafile"),
    (["--cafile", "ca.pem"], "--certfile"),
    ([], "--users-file"),
])
def test_bad_tls_options_exit_2_with_a_hint(tmp_path: Path, argv: list[str],
                                             hint: str) -> None:
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"server": hash_password("pw", log2_n=4)}))
    extra = [] if not argv else ["--users-file", str(users)]
    proc = broker_cli(*argv, *extra, cwd=tmp_path)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and hint in err and len(err.strip().splitlines()) == 1


def test_hash_password_prints_a_hash_the_broker_accepts(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "transport.broker", "hash-password",
                          "--log2-n", "4"], input="s3cret\n", capture_output=True, text=True,
                         env=ENV, cwd=tmp_path, timeout=20, check=True).stdout.strip()
    assert out.startswith("$scrypt$ln=4,") and "s3cret" not in out
    from transport.broker.auth import Authenticator

    auth = Authenticator({"site-1": out})
    assert auth.verify("site-1", b"s3cret") and not auth.verify("site-1", b"secret")


def test_mutual_tls_from_the_command_line(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", ["site-1"])
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"site-1": hash_password("pw-1", log2_n=4)}))
    port_file = tmp_path / "port"
    proc = broker_cli("--host", "127.0.0.1", "--users-file", str(users), "--port-file",
                      str(port_file), "--certfile", str(pki.broker.cert), "--keyfile",
                      str(pki.broker.key), "--cafile", str(pki.ca.cert),
                      "--require-certificate", "--log-level", "WARNING", cwd=tmp_path)
    try:
        port = wait_port(proc, port_file)

        def context(with_cert: bool) -> ssl.SSLContext:
            ctx = ssl.create_default_context(cafile=str(pki.ca.cert))
            if with_cert:
                ctx.load_cert_chain(pki.clients["site-1"].cert, pki.clients["site-1"].key)
            return ctx

        async def attempt(with_cert: bool) -> bool:
            try:
                async with aiomqtt.Client("localhost", port, username="site-1",
                                          password="pw-1", tls_context=context(with_cert),
                                          timeout=5) as client:
                    await client.subscribe("t", qos=1)
                    await client.publish("t", b"mtls", qos=1)
                    async for message in client.messages:
                        return bytes(message.payload) == b"mtls"  # type: ignore[arg-type]
            except aiomqtt.MqttError:
                return False
            return False

        assert asyncio.run(asyncio.wait_for(attempt(True), 20)) is True
        assert asyncio.run(asyncio.wait_for(attempt(False), 20)) is False
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_broker_modules_form_no_cycle_and_the_bus_does_not_load_the_cli() -> None:
    import ast

    import transport.broker as package

    root = Path(package.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                deps.add(node.module)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "transport.broker."):
                deps.add(node.module.rsplit(".", 1)[1])  # type: ignore[union-attr]
        graph[path.stem] = deps
    done: set[str] = set()

    def visit(name: str, stack: tuple[str, ...]) -> None:
        assert name not in stack, f"import cycle: {' -> '.join((*stack, name))}"
        if name in done:
            return
        for dep in graph.get(name, ()):
            visit(dep, (*stack, name))
        done.add(name)

    for name in graph:
        visit(name, ())
    code = ("import sys, transport.memory, transport.broker; "
            "sys.exit('transport.broker.cli' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], env=ENV, timeout=60).returncode == 0


def test_port_in_use_is_a_runtime_error_in_one_line(tmp_path: Path) -> None:
    import socket

    users = tmp_path / "users.json"
    users.write_text(json.dumps({"server": hash_password("pw", log2_n=4)}))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = broker_cli("--port", str(port), "--users-file", str(users), cwd=tmp_path)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "cannot listen" in lines[0]
