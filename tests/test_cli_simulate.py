"""``secagg simulate`` end to end: real worker processes, a real broker, real dropouts; the
aggregate is checked here against the plaintext sum of the inputs."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

import fl.cli.simulate  # noqa: F401  (compiled before any test starts a thread)
import transport.runner  # noqa: F401
from secagg import Stage
from tests.pace import slowdown
from transport.broker import EmbeddedBroker
from transport.mosquitto import mosquitto_available

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent
STAGES = {"advertise_keys", "share_keys", "masked_input", "consistency_check", "unmasking"}
HAS_TRAIN = importlib.util.find_spec("fl.cli.train") is not None


@pytest.fixture(autouse=True)
def _cli_without_train(monkeypatch: pytest.MonkeyPatch) -> None:
    """fl.cli imports every subcommand; stand in for ``train`` until it exists."""
    if not HAS_TRAIN:
        stub = types.ModuleType("fl.cli.train")
        stub.add_parser = lambda sub: sub.add_parser("train")  # type: ignore[attr-defined]
        stub.run = lambda args: 0  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "fl.cli.train", stub)


def cli(*argv: str) -> int:
    from fl.cli import main

    return main(["simulate", *argv])


def write_inputs(directory: Path, ids: list[int], dim: int, bits: int = 32,
                 seed: int = 0) -> dict[int, np.ndarray]:
    directory.mkdir()
    rng = np.random.default_rng(seed)
    inputs = {}
    for cid in ids:
        vec = rng.integers(0, 1 << bits, dim, dtype=np.uint64)
        np.save(directory / f"{cid}.npy", vec)
        inputs[cid] = vec
    return inputs


def plaintext_sum(inputs: dict[int, np.ndarray], included: list[int], bits: int) -> np.ndarray:
    total = 0
    for cid in included:
        total = total + inputs[cid].astype(object)  # exact integers, no wrap-around
    return (np.asarray(total, dtype=object) % (1 << bits)).astype(np.uint64)


def check_report(report: dict, ids: list[int]) -> None:
    assert set(report) >= {"included", "dropped", "correct", "seconds", "bytes"}
    assert set(report["included"]) <= set(ids)
    assert set(report["dropped"].values()) <= STAGES
    assert report["seconds"]["total"] > 0
    assert set(report["seconds"]) >= {"advertise_keys", "share_keys", "masked_input",
                                      "unmasking", "total"}
    assert set(report["bytes"]) == {str(c) for c in ids}
    for cid in report["included"]:
        sent = report["bytes"][str(cid)]
        assert sent["masked_input"] > 0 and sent["advertise_keys"] > 0


def test_inputs_output_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ids = [3, 5, 8, 13, 21, 34, 55, 89]
    inputs = write_inputs(tmp_path / "in", ids, dim=50)
    out, rep = tmp_path / "sum.npy", tmp_path / "report.json"
    rc = cli("--inputs", str(tmp_path / "in"), "--output", str(out), "--report", str(rep),
             "--drop-rate", "0.25", "--drop-stage", "share-keys", "--seed", "3")
    assert rc == 0
    report = json.loads(rep.read_text())
    check_report(report, ids)
    assert report["correct"] is True
    assert len(report["dropped"]) == 2
    assert set(report["dropped"].values()) == {"share_keys"}
    assert set(report["included"]) == set(ids) - {int(c) for c in report["dropped"]}
    total = np.load(out)
    assert total.dtype == np.uint32  # the natural width of a 32-bit sum
    assert np.array_equal(total, plaintext_sum(inputs, report["included"], 32))
    stdout = capsys.readouterr().out
    assert "correct: yes" in stdout and "included 6/8" in stdout


def test_random_inputs_malicious_with_sigkill(tmp_path: Path) -> None:
    rep, out = tmp_path / "r.json", tmp_path / "s.npy"
    rc = cli("--clients", "9", "--dim", "40", "--bits", "20", "--security", "malicious",
             "--drop-rate", "0.2", "--kill", "--processes", "2", "--seed", "11",
             "--report", str(rep), "--output", str(out))
    assert rc == 0
    report = json.loads(rep.read_text())
    check_report(report, list(range(1, 10)))
    assert report["correct"] is True
    assert len(report["killed"]) == 2
    assert all(report["client_status"][str(c)] == "killed" for c in report["killed"])
    # the documented input generator: below 2**bits from (seed, id), in the natural width
    inputs = {c: np.random.default_rng([11, c]).integers(0, 1 << 20, 40, dtype=np.uint32)
              for c in range(1, 10)}
    assert np.array_equal(np.load(out), plaintext_sum(inputs, report["included"], 20))


def test_norm_bound_round_is_validated_and_exact(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """--norm-bound: every site proves its (random, in-bound) input; the aggregate is the
    exact sum, nobody is refused, and the proof travels in masked_input."""
    pytest.importorskip("py_arkworks_bls12381")
    rep, out = tmp_path / "r.json", tmp_path / "s.npy"
    rc = cli("--clients", "4", "--dim", "64", "--norm-bound", "50000", "--seed", "5",
             "--drop-rate", "0.25", "--drop-stage", "unmasking",
             "--report", str(rep), "--output", str(out))
    assert rc == 0
    report = json.loads(rep.read_text())
    check_report(report, [1, 2, 3, 4])
    assert report["correct"] is True and report["refused"] == {}
    assert report["config"]["norm_bound"] == 50000
    from secagg.validation import proof_size

    for cid in report["included"]:
        assert report["bytes"][str(cid)]["masked_input"] > proof_size(64)
    assert "norm bound 50000 (proved in zero knowledge); refused: none" in (
        capsys.readouterr().out)


def test_norm_bound_refuses_inputs_over_the_bound_before_the_round(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("py_arkworks_bls12381")
    write_inputs(tmp_path / "in", [1, 2, 3], dim=8, bits=32)  # uniform: far over any bound
    assert cli("--inputs", str(tmp_path / "in"), "--norm-bound", "1000") == 2
    err = capsys.readouterr().err
    assert "--inputs" in err and "--norm-bound 1000" in err and "clip it" in err


def test_streamed_inputs_and_one_line_reasons(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """secagg simulate streams masked inputs through the drivers (chunks counted by the
    server), and a site that leaves is named in the summary with its reason, in one line,
    and in the report's ``reasons``."""
    rep = tmp_path / "r.json"
    rc = cli("--clients", "6", "--dim", "3000", "--drop-rate", "0.2", "--drop-stage",
             "masked-input", "--seed", "4", "--report", str(rep))
    assert rc == 0
    report = json.loads(rep.read_text())
    assert report["correct"] is True
    left = sorted(report["dropped"])
    assert left and set(report["reasons"]) == set(left)
    out = capsys.readouterr().out
    for cid in left:  # while streaming (it held an upload slot) or before its grant
        line = f"client {cid} not included: it left"
        assert line in out and report["reasons"][cid].startswith("it left")
    assert report["transport"]["masked_input_chunks"] >= 6 - len(left)  # streamed
    # natural width on the wire: 3000 x 4 bytes plus headers, not 8 bytes per element
    sizes = [b["masked_input"] for c, b in report["bytes"].items() if c not in left]
    assert all(12_000 <= n < 13_000 for n in sizes)


@pytest.mark.parametrize(("argv", "hint"), [
    (["--clients", "10", "--threshold", "2"], "--threshold 2 is unsafe"),
    (["--clients", "1"], "at least 2"),
    (["--drop-rate", "1.5"], "--drop-rate"),
    (["--drop-stage", "lunch"], "unknown stage"),
    (["--drop-stage", "consistency_check"], "--security malicious"),
    (["--processes", "0"], "--processes"),
    (["--broker", "carrier-pigeon"], "--broker"),
    (["--broker", "mqtt://"], "no host"),
    (["--inputs", "/nonexistent/dir"], "--inputs"),
    (["--bits", "4"], "bits"),
    (["--dim", "0"], "dim"),
    (["--norm-bound", "0"], "--norm-bound"),
    (["--clients", "4", "--bits", "16", "--norm-bound", "20000"], "--norm-bound 20000"),
])
def test_bad_options_exit_2_with_a_hint(argv: list[str], hint: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(*argv) == 2
    assert hint in capsys.readouterr().err


def test_inputs_that_disagree_with_options(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    write_inputs(tmp_path / "in", [1, 2, 3], dim=5)
    assert cli("--inputs", str(tmp_path / "in"), "--clients", "4") == 2
    assert "--clients 4" in capsys.readouterr().err
    assert cli("--inputs", str(tmp_path / "in"), "--dim", "6") == 2
    assert "--dim 6" in capsys.readouterr().err
    np.save(tmp_path / "in" / "4.npy", np.array([1, 2, 3, 4, 1 << 40], dtype=np.uint64))
    assert cli("--inputs", str(tmp_path / "in")) == 2
    assert "2**32" in capsys.readouterr().err


def test_too_many_dropouts_abort_with_exit_1(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    rep = tmp_path / "r.json"
    rc = cli("--clients", "5", "--dim", "10", "--drop-rate", "0.6", "--drop-stage",
             "masked_input", "--seed", "1", "--report", str(rep))
    assert rc == 1
    out = capsys.readouterr()
    assert "round aborted" in out.err
    assert "responded" not in out.out  # the abort is said once, on stderr
    report = json.loads(rep.read_text())
    assert report["correct"] is False and "threshold" in report["error"]


def test_existing_broker_url(tmp_path: Path) -> None:
    broker = EmbeddedBroker(users={"fed": "s3cret"}).run_in_thread()
    try:
        rep = tmp_path / "r.json"
        rc = cli("--clients", "4", "--dim", "8", "--broker",
                 f"mqtt://fed:s3cret@127.0.0.1:{broker.port}", "--report", str(rep))
        assert rc == 0
        report = json.loads(rep.read_text())
        assert report["correct"] is True and report["included"] == [1, 2, 3, 4]
        assert broker.stats.messages_in > 0
    finally:
        broker.stop()


@pytest.mark.mosquitto
@pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")
def test_mosquitto_broker(tmp_path: Path) -> None:
    rep = tmp_path / "r.json"
    rc = cli("--clients", "8", "--dim", "30", "--drop-rate", "0.25", "--broker", "mosquitto",
             "--seed", "5", "--report", str(rep))
    assert rc == 0
    report = json.loads(rep.read_text())
    assert report["correct"] is True and len(report["included"]) <= 8


@pytest.mark.parametrize("broker", ["embedded", "mosquitto"])
def test_the_runs_own_broker_takes_megabyte_frames(tmp_path: Path, broker: str) -> None:
    """Issue 32: through the broker a run starts itself, frames are 1 MiB
    (transport.runner.SIMULATION_MAX_PAYLOAD; the broker is started to take them), not
    256 KiB, each costing three processes a per-frame overhead. Here an 800 KB masked
    input: refused by a broker left at 256 KiB, and each client's wire bytes are its
    messages plus one frame header each (four for it with 256 KiB frames)."""
    from transport.framing import HEADER_BYTES

    if broker == "mosquitto" and not mosquitto_available():
        pytest.skip("mosquitto is not installed")
    rep = tmp_path / "r.json"
    assert cli("--clients", "3", "--dim", "200000", "--seed", "2", "--broker", broker,
               "--report", str(rep)) == 0
    report = json.loads(rep.read_text())
    assert report["correct"] is True and report["included"] == [1, 2, 3]
    if report["transport"]["republished"] == 0:  # a re-sent message adds its frames again
        for cid, sent in report["bytes"].items():
            assert sent["masked_input"] > 800_000
            assert report["wire_bytes"][cid] - sum(sent.values()) == len(sent) * HEADER_BYTES


STUB_TRAIN = (
    "import sys, types; m = types.ModuleType('fl.cli.train'); "
    "m.add_parser = lambda sub: sub.add_parser('train'); m.run = lambda a: 0; "
    "sys.modules['fl.cli.train'] = m; from fl.cli import main; sys.exit(main())")


def test_subprocess_entry_point(tmp_path: Path) -> None:
    ids = [1, 2, 3, 4, 5, 6]
    inputs = write_inputs(tmp_path / "in", ids, dim=20, seed=9)
    out, rep = tmp_path / "sum.npy", tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    entry = ["-m", "fl.cli"] if HAS_TRAIN else ["-c", STUB_TRAIN]
    proc = subprocess.run(
        [sys.executable, *entry, "simulate", "--inputs", str(tmp_path / "in"),
         "--drop-rate", "0.2", "--seed", "2", "--output", str(out), "--report", str(rep)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "correct: yes" in proc.stdout
    assert "[secagg]" not in proc.stderr  # progress only on a terminal
    report = json.loads(rep.read_text())
    check_report(report, ids)
    assert report["correct"] is True
    assert np.array_equal(np.load(out), plaintext_sum(inputs, report["included"], 32))


# --------------------------------------------------------------------------- processes


def _start_cli(tmp_path: Path, *argv: str) -> subprocess.Popen[str]:
    """``secagg simulate`` in a session of its own, with its temporary files under
    ``tmp_path/tmp`` so the test can see what it leaves behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    entry = ["-m", "fl.cli"] if HAS_TRAIN else ["-c", STUB_TRAIN]
    return subprocess.Popen([sys.executable, *entry, "simulate", *argv],
                            cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _processes_of(session: int, marker: str) -> list[int]:
    """Live processes in ``session`` or whose command line mentions ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if state[0] != "Z" and (int(state[3]) == session or marker in cmdline):
            found.append(int(entry.name))
    return found


def _broker_connections(tmp: Path) -> int:
    """Established connections to the embedded broker started under ``tmp`` (its port file
    appears once it listens), counted from the broker's side in /proc/net/tcp{,6}."""
    ports = [path.read_text().strip() for path in tmp.glob("secagg-broker-*/port")]
    if not ports or not ports[0]:
        return 0
    port, count = int(ports[0]), 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()  # local address, remote address, state (01: open)
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                    count += 1
    return count


SIGNAL_POINTS = {
    # the broker's folder exists: its users file is being written or its process starting
    "broker-starting": lambda tmp: bool(list(tmp.glob("secagg-broker-*"))),
    # the broker listens: the worker processes are being started (or still importing)
    "workers-starting": lambda tmp: bool(list(tmp.glob("secagg-broker-*/port"))),
    # the server and the 6 clients are connected: the round runs (dim 4M: seconds of work)
    "round-running": lambda tmp: _broker_connections(tmp) >= 7,
}


@pytest.mark.parametrize("point", sorted(SIGNAL_POINTS))
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_everything_within_two_seconds(tmp_path: Path, signum: int,
                                                      point: str) -> None:
    proc = _start_cli(tmp_path, "--clients", "6", "--dim", "4000000", "--processes", "2")
    tmp = tmp_path / "tmp"
    deadline = time.monotonic() + 60
    reached = SIGNAL_POINTS[point]
    while time.monotonic() < deadline and not reached(tmp):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    assert reached(tmp), f"{point} not reached within 60 s"
    # the documented 2 s on a host with free cores; scaled by the host's measured pace
    # (tests/pace.py): it took 2.09 s once at load average 13.8 on two cores
    limit = 2.0 * slowdown()
    started = time.monotonic()
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
    else:
        proc.send_signal(signum)  # plain kill
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    elapsed = time.monotonic() - started
    assert elapsed < limit, f"took {elapsed:.1f} s (limit {limit:.1f} s)"
    assert proc.returncode == 128 + signum, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "interrupted by" in lines[0], err
    # A child may still be finishing its exit when the command returns (seen in 3 of 40 runs
    # at load average 7: state R, empty command line, reparented to init, gone 0.02 s later);
    # everything must be gone within the documented 2 s of the signal.
    while _processes_of(proc.pid, str(tmp)) and time.monotonic() - started < limit:
        time.sleep(0.01)
    assert _processes_of(proc.pid, str(tmp)) == []
    assert list(tmp.iterdir()) == []


def test_unreachable_broker_fails_in_one_line_within_two_seconds(
        capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    assert cli("--clients", "3", "--dim", "4", "--broker", "mqtt://127.0.0.1:1") == 1
    assert time.monotonic() - started < 2.0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach the MQTT broker at mqtt://127.0.0.1:1" in err[0]


def test_two_runs_share_one_broker(tmp_path: Path) -> None:
    broker = EmbeddedBroker(users={"fed": "s3cret"}).run_in_thread()
    try:
        url = f"mqtt://fed:s3cret@127.0.0.1:{broker.port}"
        runs = [_start_cli(tmp_path, "--clients", "5", "--dim", "8", "--broker", url,
                           "--json") for _ in range(2)]
        for proc in runs:
            out, err = proc.communicate(timeout=100)
            assert proc.returncode == 0, err
            report = json.loads(out)
            assert report["correct"] is True and report["included"] == [1, 2, 3, 4, 5]
    finally:
        broker.stop()


def test_progress_lines_inside_a_stage_when_not_on_a_terminal() -> None:
    from fl.cli.simulate import StageDisplay

    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    stream, clock = io.StringIO(), Clock()
    progress = StageDisplay(stream, 4, interval=10.0, clock=clock)
    progress.start()
    for cid in (1, 2):
        progress.message(cid, Stage.ADVERTISE_KEYS)
    clock.now = 5.0
    progress.tick()
    assert stream.getvalue() == ""  # not yet: one line per interval off a terminal
    clock.now = 10.5
    progress.tick()
    assert stream.getvalue().splitlines() == [
        "[secagg] advertise_keys         2/4     answered     10.5 s"]


def test_progress_line_is_kept_up_to_date_on_a_terminal() -> None:
    from fl.cli.simulate import StageDisplay

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = StageDisplay(stream, 3, clock=lambda: 2.0)
    progress.start()
    progress.message(1, Stage.SHARE_KEYS)
    progress.tick()
    progress.message(2, Stage.SHARE_KEYS)
    progress.tick()
    out = stream.getvalue()
    assert out.count("\r") == 2 and "\n" not in out  # one line, rewritten in place
    assert out.endswith("share_keys             2/3     answered      0.0 s")


def test_a_hundred_clients_logging_in_at_once_all_get_in(tmp_path: Path) -> None:
    """100 honest clients connect to the embedded broker from one address (loopback) at
    the same moment: the broker's pre-login eviction (an attacker's idle sockets make room
    for newcomers) must not evict honest clients whose CONNECT is not read yet."""
    rep = tmp_path / "report.json"
    rc = cli("--clients", "100", "--dim", "16", "--drop-rate", "0", "--report", str(rep))
    assert rc == 0
    report = json.loads(rep.read_text())
    assert report["correct"] is True
    assert len(report["included"]) == 100


def test_requested_drops_are_not_warned_about() -> None:
    """The clients ``--drop-rate`` asked to drop leave as told: the server's "client N
    dropped" line is INFO for them, not a WARNING on the terminal."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}

    quiet = subprocess.run(
        [sys.executable, "-m", "fl.cli", "simulate", "--clients", "10", "--drop-rate", "0.3",
         "--drop-stage", "masked_input", "--seed", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=100, check=False)
    assert quiet.returncode == 0, quiet.stderr
    assert "dropped: masked_input 3" in quiet.stdout  # (each left while streaming its input)
    assert "server: client" not in quiet.stderr, quiet.stderr


# --------------------------------------------------------------------------- failed workers

FAILING_WORKER = '''
import multiprocessing, os
from secagg import client

_stream = client.Client.stream

def stream(self, *args, **kwargs):
    # only in the one worker process the test names: each of its clients raises when the
    # round reaches it (a bug, a MemoryError: the worker's event loop survives it)
    if multiprocessing.current_process().name == os.environ["SECAGG_TEST_FAILING_WORKER"]:
        raise RuntimeError("injected failure of every client in this worker")
    return _stream(self, *args, **kwargs)

client.Client.stream = stream
'''


def _simulate_with_a_failing_worker(tmp_path: Path, worker: int,
                                    *argv: str) -> subprocess.CompletedProcess[str]:
    """``secagg simulate`` as a user runs it, with every client of worker process
    ``worker`` raising once the round starts (a ``sitecustomize`` only that process acts on)."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FAILING_WORKER)
    env = {**os.environ, "SECAGG_TEST_FAILING_WORKER": f"secagg-worker-{worker}",
           "PYTHONPATH": os.pathsep.join(p for p in (str(inject), str(REPO),
                                                     os.environ.get("PYTHONPATH")) if p)}
    entry = ["-m", "fl.cli"] if HAS_TRAIN else ["-c", STUB_TRAIN]
    # the stall watch would end it after timeouts.give_up (180 s here): far past this bound
    return subprocess.run([sys.executable, *entry, "simulate", *argv], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=100, check=False)


def test_a_worker_whose_clients_all_fail_drops_them_with_their_reason(tmp_path: Path) -> None:
    rep = tmp_path / "r.json"
    proc = _simulate_with_a_failing_worker(
        tmp_path, 3, "--clients", "8", "--dim", "20", "--processes", "4", "--seed", "3",
        "--report", str(rep))
    report = json.loads(rep.read_text())
    # worker 3 ran clients 7 and 8: dropped at the stage they failed in, each with its reason
    assert report["included"] == [1, 2, 3, 4, 5, 6] and report["correct"] is True
    assert sorted(report["dropped"]) == ["7", "8"]
    for cid in ("7", "8"):
        assert report["client_status"][cid] == "lost"
        assert "injected failure" in report["reasons"][cid]
        assert "\n" not in report["reasons"][cid]
    assert "client 7 not included: lost: RuntimeError: injected failure" in proc.stdout
    # the simulation was not asked to drop them: it says so and exits 1, not blaming the host
    assert proc.returncode == 1, proc.stderr
    assert "failed in their worker process" in proc.stderr
    assert "no progress" not in proc.stderr and "keep up" not in proc.stderr


def test_a_failed_worker_that_leaves_too_few_aborts_the_round_naming_it(
        tmp_path: Path) -> None:
    rep = tmp_path / "r.json"
    proc = _simulate_with_a_failing_worker(
        tmp_path, 1, "--clients", "6", "--dim", "20", "--seed", "3", "--deadlines", "wall",
        "--report", str(rep))
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "secagg simulate: " in line]
    assert len(errors) == 1 and "round aborted" in errors[0], proc.stderr
    assert "failed in their worker process" in errors[0]
    assert "injected failure" in errors[0]
    report = json.loads(rep.read_text())
    assert report["correct"] is False
    assert {report["client_status"][c] for c in ("4", "5", "6")} == {"lost"}
