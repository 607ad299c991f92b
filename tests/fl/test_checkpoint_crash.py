"""``fl.checkpoint.save`` crashed at each of its steps, then resumed.

A forked child runs ``save`` over a committed checkpoint with every file-system call it
makes counted (``os.open``, ``write``, ``fsync``, ``ftruncate``, ``lseek``, ``replace``,
``link``, ``unlink``) and exits (``os._exit``, no cleanup) at call k, a write at its step
writing half its bytes first (a torn write). For every k the directory then holds the
previous checkpoint or the new one, whole; a save after the crash (the resumed run) commits
the new one; and a k past the last step is a save that completes.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from fl import checkpoint as ckpt

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

CALLS = ("open", "write", "fsync", "ftruncate", "lseek", "replace", "link", "unlink")
CRASHED = 17


def _checkpoint(r: int) -> ckpt.Checkpoint:
    """Round ``r``: a model, history and events that name their round (so a mix shows)."""
    return ckpt.Checkpoint(
        round=r, model={"w": torch.full((64,), float(r)), "b": torch.tensor([r])},
        fingerprint={"seed": 3},
        history=[{"round": i, "accuracy": i / 10, "note": "x" * 50} for i in range(1, r + 1)],
        events=[{"kind": "rdp", "round": i} for i in range(1, r + 1)],
        scaler={"mean": [float(r)]}, stopped=None)


def _same(saved: ckpt.Checkpoint | None, expected: ckpt.Checkpoint) -> bool:
    return (saved is not None and saved.round == expected.round
            and saved.history == expected.history and saved.events == expected.events
            and saved.scaler == expected.scaler
            and all(torch.equal(saved.model[k], v) for k, v in expected.model.items()))


def _save_crashing_at(directory: Path, checkpoint: ckpt.Checkpoint, crash_at: int) -> int:
    """Fork; the child saves and exits at file-system call ``crash_at`` (0: never).
    Returns the child's exit status (``CRASHED``) or, for a completed save, -(its calls)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read)
            count = [0]
            real_write, real_exit = os.write, os._exit

            def counted(name: str, real: Any) -> Any:
                def call(*args: Any, **kwargs: Any) -> Any:
                    count[0] += 1
                    if count[0] == crash_at:
                        if name == "write":
                            data = bytes(args[1])
                            real_write(args[0], data[:len(data) // 2])
                        real_exit(CRASHED)
                    return real(*args, **kwargs)
                return call

            for name in CALLS:
                setattr(os, name, counted(name, getattr(os, name)))
            ckpt.save(directory, checkpoint)
            real_write(write, str(count[0]).encode())
            real_exit(0)
        finally:
            os._exit(99)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        calls = pipe.read()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return -int(calls) if code == 0 else code


def test_a_crash_at_each_step_of_save_leaves_the_old_or_the_new_checkpoint(
        tmp_path: Path) -> None:
    template = tmp_path / "template"
    ckpt.save(template, _checkpoint(1))
    ckpt.save(template, _checkpoint(2))  # logs and a generation to append to
    old, new = _checkpoint(2), _checkpoint(3)

    shutil.copytree(template, tmp_path / "count")
    steps = -_save_crashing_at(tmp_path / "count", new, 0)
    assert steps >= 15, steps  # model, two logs, manifest, link, cleanup
    outcomes = []
    for k in range(1, steps + 2):
        directory = tmp_path / f"k{k}"
        shutil.copytree(template, directory)
        code = _save_crashing_at(directory, new, k)
        assert code == (CRASHED if k <= steps else -steps), (k, code)
        after = ckpt.load(directory)
        if _same(after, old):
            outcomes.append("old")
        else:
            assert _same(after, new), (k, after)
            outcomes.append("new")
        ckpt.save(directory, new)  # the resumed run saves the round again
        assert _same(ckpt.load(directory), new), k
        model = torch.load(directory / ckpt.MODEL, weights_only=True)
        assert torch.equal(model["w"], new.model["w"]), k
        assert len(list(directory.glob("model-*.pt"))) == 1, k  # a crash's leftovers go
    # the commit is one step: every crash before it keeps the old, every one after the new
    first_new = outcomes.index("new")
    assert set(outcomes[:first_new]) == {"old"} and set(outcomes[first_new:]) == {"new"}
    assert 5 <= first_new < steps, outcomes
    print(f"{steps} steps; a crash at step 1..{first_new} keeps round 2, later ones round 3")


def test_history_is_appended_not_rewritten(tmp_path: Path) -> None:
    ckpt.save(tmp_path, _checkpoint(1))
    first = (tmp_path / ckpt.HISTORY).read_bytes()
    ckpt.save(tmp_path, _checkpoint(2))
    second = (tmp_path / ckpt.HISTORY).read_bytes()
    assert second.startswith(first) and second.count(b"\n") == 2
    state = json.loads((tmp_path / ckpt.STATE).read_text())
    assert "history" not in state and state["logs"][ckpt.HISTORY]["rows"] == 2
    assert len((tmp_path / ckpt.STATE).read_bytes()) < 1000


def test_a_format_2_checkpoint_is_read_and_upgraded(tmp_path: Path) -> None:
    old = _checkpoint(2)
    import hashlib
    import io

    buffer = io.BytesIO()
    torch.save(old.model, buffer)
    (tmp_path / "model.pt").write_bytes(buffer.getvalue())
    (tmp_path / "state.json").write_text(json.dumps({
        "format": 2, "round": 2, "model_sha256": hashlib.sha256(buffer.getvalue()).hexdigest(),
        "fingerprint": old.fingerprint, "history": old.history, "events": old.events,
        "scaler": old.scaler, "stopped": None}))
    assert _same(ckpt.load(tmp_path), old)
    ckpt.save(tmp_path, _checkpoint(3))
    assert _same(ckpt.load(tmp_path), _checkpoint(3))


@pytest.mark.parametrize("state", [
    {"format": 3, "round": 2},
    {"format": 3, "round": "two", "model": "model-1.pt", "model_sha256": "00",
     "logs": {}, "fingerprint": {}, "generation": 1},
    [1, 2, 3],
    {"format": 2, "round": 1, "history": 5},
])
def test_a_state_file_of_the_wrong_shape_gives_one_line(tmp_path: Path, state: Any) -> None:
    (tmp_path / ckpt.STATE).write_text(json.dumps(state))
    (tmp_path / "model-1.pt").write_bytes(b"")
    (tmp_path / "model.pt").write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError) as caught:
        ckpt.load(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and str(tmp_path / ckpt.STATE) in message
    assert "start a new --checkpoint directory" in message


def test_a_truncated_history_gives_one_line_and_changes_nothing(tmp_path: Path) -> None:
    ckpt.save(tmp_path, _checkpoint(3))
    path = tmp_path / ckpt.HISTORY
    path.write_bytes(path.read_bytes()[:-30])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ckpt.CheckpointError, match=r"history\.jsonl holds fewer rows"):
        ckpt.load(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def _fill_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on every write of more than 100 bytes finds the disk full."""
    real = os.write

    def full(fd: int, data: Any) -> int:
        if len(data) > 100:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", full)


def test_a_full_disk_names_the_file_and_keeps_the_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt.save(tmp_path, _checkpoint(1))
    _fill_disk(monkeypatch)
    with pytest.raises(ckpt.CheckpointWriteError) as caught:
        ckpt.save(tmp_path, _checkpoint(2))
    monkeypatch.undo()
    message = str(caught.value)
    assert str(tmp_path / "model-2.pt") in message and "No space left" in message
    assert "\n" not in message
    assert _same(ckpt.load(tmp_path), _checkpoint(1))


def test_a_first_save_that_fails_does_not_claim_a_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fill_disk(monkeypatch)
    with pytest.raises(ckpt.CheckpointWriteError) as caught:
        ckpt.save(tmp_path / "ckpt", _checkpoint(1))
    monkeypatch.undo()
    message = str(caught.value)
    assert "no checkpoint was written yet" in message and "intact" not in message
    assert "free space" in message
    ckpt.save(tmp_path / "ckpt", _checkpoint(1))
    _fill_disk(monkeypatch)
    with pytest.raises(ckpt.CheckpointWriteError,
                       match=r"previous checkpoint \(round 1\) is intact"):
        ckpt.save(tmp_path / "ckpt", _checkpoint(2))
