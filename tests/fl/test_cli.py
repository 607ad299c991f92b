"""The ``secagg`` command line as its users meet it: --version, help on every option and
examples at the end, train's options grouped by role, one error shape with exit 2 for
usage and 1 for runtime (an unreachable broker is not a traceback), -q, --json on stdout,
a TOML run configuration that flags override, progress with an estimate, --save-model."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fl.cli.app import EXAMPLES, build_parser, main
from fl.models import make_model

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
FAST = ["--sites", "2", "--rounds", "2", "--broker", "memory", "--dataset", "breast-cancer"]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("secagg ")
    parser = build_parser()
    for name, command in {"secagg": parser, **_subparsers(parser)}.items():
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help.strip(), (name, action.option_strings)
        text = command.format_help()
        examples = EXAMPLES[None if name == "secagg" else name]
        assert examples.startswith("examples:\n") and text.rstrip().endswith(
            examples.rstrip().splitlines()[-1]), name  # help ends with examples


def test_train_options_are_grouped_by_role() -> None:
    train = _subparsers(build_parser())["train"]
    where = {opt: group.title for group in train._action_groups
             for action in group._group_actions for opt in action.option_strings}
    assert where["--site-id"] == where["--idle-timeout"] == "site (--role site)"
    coordinator = where["--join-timeout"]
    assert coordinator.startswith("coordinator across machines") == (
        where["--eval-csv"] == coordinator)
    for option in ("--rounds", "--lr", "--noise-multiplier", "--cohort", "--drop-rate"):
        assert where[option].startswith("coordinator (--role all or coordinator)"), option
    for option in ("--csv", "--dp", "--broker", "--model"):
        assert where[option].startswith("every role"), option


def test_errors_have_one_shape(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["train", "--sites", "3", "--rounds", "0", "--broker", "memory"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("secagg train: error: --rounds 0") and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_:  # argparse's own usage errors: same shape
        main(["train", "--model", "resnet"])
    assert exit_.value.code == 2 and "secagg train: error: argument --model" in (
        capsys.readouterr().err)
    assert main(["train", *FAST, "--save-model", str(tmp_path / "no" / "m.pt")]) == 2
    assert "secagg train: error:" in capsys.readouterr().err
    # Every command, the same shape.
    assert main(["budget", "--epsilon", "-1", "--delta", "1e-5", "--sample-rate", "0.1",
                 "--rounds", "3"]) == 2
    assert capsys.readouterr().err.startswith("secagg budget: error: --epsilon")
    assert main(["simulate", "--clients", "1"]) == 2
    assert capsys.readouterr().err.startswith("secagg simulate: error: --clients 1")


def test_a_round_that_keeps_aborting_names_the_flag_that_gives_it_more_attempts(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The message of a failed round tells the user to raise --max-attempts: the flag exists,
    is honoured, and is checked."""
    hopeless = ["train", "--sites", "5", "--rounds", "1", "--dataset", "ehr",
                "--drop-rate", "0.9", "--broker", "memory", "--seed", "3"]
    assert main([*hopeless, "--max-attempts", "0"]) == 2
    assert capsys.readouterr().err.startswith("secagg train: error: --max-attempts 0")
    assert main([*hopeless, "--max-attempts", "3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("secagg train: error: round 1 aborted 3 times")
    assert "--max-attempts" in err and "Traceback" not in err


def test_an_unreachable_broker_is_a_runtime_error_without_traceback(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), XDG_STATE_HOME=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "fl.cli", "train", "--role", "site", "--site-id", "1",
         "--sites", "3", "--broker", "mqtt://127.0.0.1:9", "--connect-timeout", "0.5"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=90)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("secagg train: error: site-1: cannot reach the MQTT broker")
    assert "Traceback" not in proc.stderr


def test_config_file_json_quiet_progress_and_saved_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[train]\nsites = 2\nrounds = 1\nbroker = "memory"\n'
                      'dataset = "breast-cancer"\nmodel = "mlp"\n')
    model_path = tmp_path / "model.pt"
    assert main(["train", "--config", str(config), "--rounds", "2", "--json",
                 "--save-model", str(model_path), "--checkpoint", str(tmp_path / "ckpt")]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)  # stdout is exactly one JSON object
    assert len(report["rounds"]) == 2  # the flag overrode the file's rounds = 1
    assert report["settings"]["model"] == "mlp" and report["settings"]["sites"] == 2
    assert "round   1/2" in err and "left]" in err and "elapsed" in err
    model = make_model("mlp", 30, 2)
    model.load_state_dict(torch.load(model_path))  # one line of plain torch
    checkpointed = make_model("mlp", 30, 2)  # a checkpoint's model loads the same way
    checkpointed.load_state_dict(torch.load(tmp_path / "ckpt" / "model.pt"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 checkpointed.state_dict().values(),
                                                 strict=True))
    meta = json.loads((tmp_path / "model.pt.json").read_text())
    assert meta["model"] == "mlp" and meta["num_classes"] == 2 and len(meta["scaler"]["mean"]) == 30
    assert meta["final_accuracy"] == report["final_accuracy"]

    assert main(["budget", "--epsilon", "4", "--delta", "1e-5", "--sample-rate", "0.1",
                 "--rounds", "40", "--json", "-q"]) == 0
    assert json.loads(capsys.readouterr().out)["rounds"] == 40  # every command: --json

    assert main(["train", *FAST, "--rounds", "1", "-q"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("secagg train: 1 rounds")

    config.write_text('[train]\nsites = 2\nrounds = 1\nlearning_rate = 0.1\n')
    assert main(["train", "--config", str(config)]) == 2
    assert "unknown option 'learning_rate'" in capsys.readouterr().err
    config.write_text('[train]\nsites = 2\nrounds = "one\n')
    assert main(["train", "--config", str(config)]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_the_commands_log_to_the_current_stderr_not_a_closed_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A command run in-process sets up logging while ``sys.stderr`` is one stream (a
    test's capture, a notebook cell's); records logged after that stream was closed go to
    the stream that is ``sys.stderr`` then, never into a "--- Logging error ---"."""
    import argparse
    import io
    import logging
    import sys

    from fl.cli._common import setup_logging

    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    setup_logging(argparse.Namespace(verbosity=0), "test")
    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("fl.test").warning("after the first stream closed")
    assert "[test] WARNING fl.test: after the first stream closed" in second.getvalue()
    assert "Logging error" not in second.getvalue()
