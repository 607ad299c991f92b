"""The checkpoint directory is the run's own: private, no planted link followed, every file
bound by digest; and ``secagg train`` checks its outputs before it trains, with messages
that name the real cause (issues 27, 30, 35)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fl import checkpoint as ckpt
from fl.cli.app import main

pytestmark = pytest.mark.timeout(180)
FAST = ["train", "--sites", "2", "--rounds", "2", "--broker", "memory",
        "--dataset", "breast-cancer", "--model", "logreg"]


def _checkpoint(r: int) -> ckpt.Checkpoint:
    return ckpt.Checkpoint(
        round=r, model={"w": torch.full((8,), float(r))}, fingerprint={"seed": 3},
        history=[{"round": i} for i in range(1, r + 1)],
        events=[{"kind": "gaussian", "noise_multiplier": 1.0, "sample_rate": 0.01,
                 "steps": 10} for _ in range(1, r + 1)])


@contextlib.contextmanager
def _read_only(folder: Path) -> Iterator[None]:
    """``folder`` unwritable, for root too (root ignores modes: an immutable folder)."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(
                ["chattr", "+i", str(folder)], capture_output=True).returncode:
            pytest.skip("root needs chattr +i for a folder it cannot write")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
    else:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o700)


def _train(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main([*FAST, *args])
    captured = capsys.readouterr()
    return code, captured.err


def _forbid_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on training must not start: a refusal comes from checking the options."""
    import fl.federation

    def train(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("training started before the outputs were checked")

    monkeypatch.setattr(fl.federation, "train", train)


def test_the_checkpoint_folder_is_created_private_and_a_shared_one_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "runs" / "ckpt"
    code, _ = _train(["--checkpoint", str(folder)], capsys)
    assert code == 0 and (folder / ckpt.STATE).exists()
    assert folder.stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # as a folder under /tmp, or made with umask 0
    _forbid_training(monkeypatch)
    code, err = _train(["--checkpoint", str(shared)], capsys)
    assert code == 2  # refused before training
    assert f"chmod go-w {shared}" in err and "written by other users" in err
    assert list(shared.iterdir()) == []
    shared.chmod(0o770)
    with pytest.raises(ckpt.CheckpointError, match="chmod go-w"):  # the library refuses too
        ckpt.save(shared, _checkpoint(1))


def test_planted_links_are_never_followed(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    ckpt.save(folder, _checkpoint(1))
    victim = tmp_path / "victim"
    victim.write_bytes(b"not yours")
    for name in ("model-2.pt", "state.json.tmp", "model.pt.tmp"):  # names the save writes
        (folder / name).symlink_to(victim)
    ckpt.save(folder, _checkpoint(2))
    assert victim.read_bytes() == b"not yours"
    assert ckpt.load(folder).round == 2  # type: ignore[union-attr]
    assert not any(p.is_symlink() for p in folder.iterdir())

    events = folder / ckpt.EVENTS
    events.rename(tmp_path / "events.jsonl")
    events.symlink_to(tmp_path / "events.jsonl")  # a log that is a link: refused, not used
    for act in (lambda: ckpt.load(folder), lambda: ckpt.save(folder, _checkpoint(3))):
        with pytest.raises(ckpt.CheckpointError, match="symbolic link"):
            act()
    assert (tmp_path / "events.jsonl").read_bytes().count(b"\n") == 2
    events.unlink()
    (tmp_path / "events.jsonl").rename(events)
    state = folder / ckpt.STATE
    state.rename(tmp_path / "state.json")
    state.symlink_to(tmp_path / "state.json")
    with pytest.raises(ckpt.CheckpointError, match="symbolic link"):
        ckpt.load(folder)


def _tamper(folder: Path, how: str) -> None:
    """Leave fewer spent events on disk while the manifest's counts still match."""
    events, state_path = folder / ckpt.EVENTS, folder / ckpt.STATE
    state = json.loads(state_path.read_text())
    if how == "cut":  # one event fewer, the manifest's rows and bytes edited to match
        kept = events.read_bytes().splitlines(keepends=True)[:-1]
        events.write_bytes(b"".join(kept))
        state["logs"][ckpt.EVENTS].update(rows=len(kept), bytes=sum(map(len, kept)))
        state_path.write_text(json.dumps(state))
    else:  # same rows and bytes: ten times the noise, a smaller epsilon on resume
        events.write_bytes(events.read_bytes().replace(b'"noise_multiplier":1.0',
                                                       b'"noise_multiplier":10.'))


@pytest.mark.parametrize("how", ["cut", "edited"])
def test_a_cut_or_edited_events_log_with_matching_counts_is_refused(
        tmp_path: Path, how: str) -> None:
    folder = tmp_path / "ckpt"
    ckpt.save(folder, _checkpoint(3))
    _tamper(folder, how)
    with pytest.raises(ckpt.CheckpointError, match="SHA-256"):
        ckpt.load(folder)
    with pytest.raises(ckpt.CheckpointError, match="does not match"):  # nor saved over
        ckpt.save(folder, _checkpoint(4))


def test_a_resume_from_a_cut_events_log_is_refused_by_the_cli(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "ckpt"
    dp = ["--dp", "site", "--epsilon", "8", "--checkpoint", str(folder)]
    assert _train(dp, capsys)[0] == 0
    assert json.loads((folder / ckpt.STATE).read_text())["logs"][ckpt.EVENTS]["rows"] >= 2
    _tamper(folder, "cut")
    code, err = _train([*dp, "--resume", "--rounds", "3"], capsys)
    assert code == 2 and "events.jsonl does not match" in err and "SHA-256" in err


def test_a_format_3_checkpoint_without_digests_is_read_and_upgraded(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    ckpt.save(folder, _checkpoint(2))
    state = json.loads((folder / ckpt.STATE).read_text())
    state["format"] = 3
    for spec in state["logs"].values():
        del spec["sha256"]
    (folder / ckpt.STATE).write_text(json.dumps(state))
    assert ckpt.load(folder).events == _checkpoint(2).events  # type: ignore[union-attr]
    ckpt.save(folder, _checkpoint(3))
    state = json.loads((folder / ckpt.STATE).read_text())
    assert state["format"] == ckpt.FORMAT and all("sha256" in s for s in state["logs"].values())


def test_a_file_size_limit_is_not_called_free_space_and_exits_1(tmp_path: Path) -> None:
    """``ulimit -f`` below the model's size: EFBIG (SIGXFSZ ignored, as a shell may) in
    round 1 is a runtime failure (exit 1), named for what it is."""
    import resource
    import signal

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))

    run = subprocess.run(
        [sys.executable, "-m", "fl.cli", *FAST, "--model", "mlp",
         "--checkpoint", str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=150,
        preexec_fn=limit, env={**os.environ, "PYTHONPATH": os.getcwd(),
                               "PYTHONDONTWRITEBYTECODE": "1"})
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1, run.stderr
    assert last.startswith("secagg train: error: cannot write the checkpoint file"), last
    assert "errno 27" in last and "file-size limit" in last and "free space" not in last
    assert "no checkpoint was written yet" in last and "intact" not in last


@pytest.mark.parametrize("output", ["--report", "--checkpoint", "--save-model"])
def test_an_output_into_a_read_only_folder_fails_before_training(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        output: str) -> None:
    _forbid_training(monkeypatch)
    folder = tmp_path / "out"
    folder.mkdir(mode=0o700)
    target = folder if output == "--checkpoint" else folder / "result"
    with _read_only(folder):
        code, err = _train([output, str(target)], capsys)
    assert code == 2, err
    assert str(folder) in err and ("writable" in err or "not permitted" in err)
    assert list(folder.iterdir()) == []


def test_a_checkpoint_path_that_is_a_file_fails_before_training(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid_training(monkeypatch)
    path = tmp_path / "ckpt"
    path.write_text("a file")
    code, err = _train(["--checkpoint", str(path)], capsys)
    assert code == 2 and "is a file, not a directory" in err
    assert path.read_text() == "a file"
