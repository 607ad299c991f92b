"""README and docs/architecture.md section 2: the state machines never do I/O, never read a
clock and never start a thread, and the layers import one way only.

The rounds run in a child process that, before importing ``secagg``, installs an audit
hook (files, sockets, processes) and replaces every clock of ``time`` and every way to
start a thread with recorders; then real ``Client`` and ``Server`` objects run whole rounds
(semi-honest and malicious, complete graph and SecAgg+, dropouts, junk bytes, an abort, a
snapshot and restore), once to import what is imported lazily, then again recorded:
anything recorded the second time fails the test.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import sys, time, threading, _thread
    events = []
    armed = [False]

    def record(what):
        if armed[0]:
            events.append(what)

    def hook(event, args):
        if event in ("open", "socket.__new__", "socket.connect", "socket.bind",
                     "subprocess.Popen", "os.system", "os.fork", "os.exec", "os.posix_spawn",
                     "os.startfile", "shutil.copyfile", "os.listdir", "os.scandir"):
            record(f"{event} {args[:1]!r}")

    sys.addaudithook(hook)
    for name in ("time", "monotonic", "perf_counter", "process_time", "thread_time",
                 "time_ns", "monotonic_ns", "perf_counter_ns", "process_time_ns"):
        original = getattr(time, name)
        def clock(*a, _name=name, _original=original):
            record(f"time.{_name}()")
            return _original(*a)
        setattr(time, name, clock)
    start = threading.Thread.start
    def thread_start(self, *a, **k):
        record("threading.Thread.start")
        return start(self, *a, **k)
    threading.Thread.start = thread_start
    new_thread = _thread.start_new_thread
    def start_new_thread(*a, **k):
        record("_thread.start_new_thread")
        return new_thread(*a, **k)
    _thread.start_new_thread = start_new_thread

    sys.path.insert(0, "tests/secagg")
    from harness import Round, replace
    from secagg import Client, Config, ProtocolError, ProtocolAbort, Stage, encode
    from secagg.messages import KeyList, Ciphertexts, MaskedInput, UnmaskRequest

    rounds = [Config(num_clients=7, dim=64, bits=16),
              Config(num_clients=7, dim=64, bits=32, security="malicious"),
              Config(num_clients=12, dim=64, bits=24, neighbors=7, threshold=4,
                     dropout_rate=0.1, corrupt_rate=0.0)]
    def scenario():
        for config in rounds:
            rnd = Round(config, context=b"sans-io")
            rnd.run_until(Ciphertexts)
            rnd.step(stop=[7])                       # a dropout before its masked input
            try:                                     # junk bytes at a client and the server
                rnd.clients[1].handle(b"junk")
            except ProtocolError:
                pass
            try:
                rnd.server.receive(2, b"junk")
            except ProtocolError:
                pass
            snap = rnd.clients[2].snapshot(b"k" * 32)
            Client.restore(snap, config=config, client_id=2, context=b"sans-io",
                           roster=rnd.roster, key=b"k" * 32,
                           signing_key=rnd.signing.get(2), verify_keys=rnd.verify_keys)
            rnd.run_until(UnmaskRequest)
            rnd.step(stop=[6])                       # a dropout at unmasking
            result = rnd.finish()
            assert sorted(result.included) == [c for c in rnd.roster if c != 7], result.included
            assert list(result.total) == rnd.expected(result.included)
        aborting = Round(rounds[0], context=b"sans-io")
        aborting.run_until(KeyList)
        try:
            aborting.clients[1].handle(encode(replace(aborting.decoded(1),  # another session
                                                      session_id=bytes(32))))
        except ProtocolError:
            pass
        assert aborting.clients[1].aborted is not None

    scenario()           # once to import lazily imported modules
    armed[0] = True
    scenario()
    armed[0] = False
    print("EVENTS", events)
""")


def test_client_and_server_do_no_io_read_no_clock_and_start_no_thread() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("EVENTS"))
    assert line == "EVENTS []", line


def _imports(folder: str) -> dict[str, set[str]]:
    """Top-level module names each file of ``folder`` imports (absolute imports)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


def test_the_layers_import_one_way() -> None:
    """secagg imports nothing from the folders above it (no asyncio, no sockets, no torch);
    transport imports secagg only; dp never imports fl or transport (docs/architecture.md
    section 2)."""
    upper = {"transport", "dp", "fl", "benchmarks", "tests"}
    for path, names in _imports("secagg").items():
        assert not names & (upper | {"asyncio", "socket", "ssl", "threading", "torch",
                                     "opacus", "aiomqtt", "subprocess"}), (path, names)
    for path, names in _imports("transport").items():
        assert not names & {"dp", "fl", "torch", "opacus"}, (path, names)
    for path, names in _imports("dp").items():
        assert not names & {"fl", "transport"}, (path, names)


def _generator_uses(folder: str) -> list[tuple[str, str]]:
    """Every use of numpy's or Python's random generators in ``folder`` (file, what)."""
    uses: list[tuple[str, str]] = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if (node.value.id, node.attr) in {("np", "random"), ("numpy", "random"),
                                                  ("torch", "randn"), ("torch", "rand"),
                                                  ("torch", "normal")}:
                    uses.append((path.name, f"{node.value.id}.{node.attr}"))
                if node.value.id == "random":
                    uses.append((path.name, f"random.{node.attr}"))
            elif isinstance(node, ast.ImportFrom) and (
                    node.module in {"random", "numpy.random"}
                    or (node.module == "numpy" and any(a.name == "random" for a in node.names))):
                uses.append((path.name, f"from {node.module} import"))
    return uses


def test_secrets_never_come_from_numpy_or_python_generators() -> None:
    """docs/architecture.md section 3: masks, keys, seeds and Shamir coefficients come from
    ``os.urandom`` and AES-CTR, never ``random`` or numpy's generators. The one use of
    ``random`` is the public, deterministic order of the subsets reconstruction tries
    (docs/protocol.md section 8, step 5.3)."""
    assert _generator_uses("secagg") == [("unmasking.py", "random.Random")]


def test_privacy_noise_and_sampling_never_come_from_numpy_or_python_generators() -> None:
    """docs/privacy.md sections 2 and 6: noise and the patients' sampling coins come from
    ``os.urandom`` (``dp.randomness``), never numpy's, Python's or torch's generators."""
    assert _generator_uses("dp") == []
