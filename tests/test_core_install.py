"""On a core install (no torch/opacus extra) the commands that need them say so and exit 2
instead of failing with a traceback; ``secagg simulate`` needs neither."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from fl import cli


def _hide(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object, **kwargs: object) -> object:
        if name.split(".")[0] in names:
            return None
        return real(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)  # type: ignore[arg-type]


def test_train_without_torch_explains_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _hide(monkeypatch, "torch", "opacus")
    assert cli.main(["train", "--sites", "3", "--rounds", "1"]) == 2
    assert "secagg[torch]" in capsys.readouterr().err


def test_budget_without_opacus_explains_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _hide(monkeypatch, "torch", "opacus")
    code = cli.main(["budget", "--epsilon", "4", "--delta", "1e-5", "--sample-rate", "0.1",
                     "--rounds", "10"])
    assert code == 2
    assert "secagg[torch]" in capsys.readouterr().err
