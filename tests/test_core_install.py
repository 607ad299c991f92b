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


def _names_the_clone_install(err: str) -> None:
    """secagg is not on PyPI: the hint installs the extra from the clone, with torch's CPU
    build from PyTorch's CPU index (constraints.txt pins versions only)."""
    assert "secagg[torch]" not in err
    assert "pip install -e '.[torch]' -c constraints.txt" in err
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in err
    assert "not on PyPI" in err


def test_train_without_torch_explains_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _hide(monkeypatch, "torch", "opacus")
    assert cli.main(["train", "--sites", "3", "--rounds", "1"]) == 2
    _names_the_clone_install(capsys.readouterr().err)


def test_budget_without_opacus_explains_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _hide(monkeypatch, "torch", "opacus")
    code = cli.main(["budget", "--epsilon", "4", "--delta", "1e-5", "--sample-rate", "0.1",
                     "--rounds", "10"])
    assert code == 2
    _names_the_clone_install(capsys.readouterr().err)


@pytest.mark.parametrize(("package", "framework"), [("fl.flower", "flwr"),
                                                    ("fl.nvflare", "nvflare")])
def test_a_framework_adapter_without_its_framework_names_the_pinned_clone_install(
        monkeypatch: pytest.MonkeyPatch, package: str, framework: str) -> None:
    """The adapter's install hint installs from the clone (secagg is not on PyPI) and names
    the version constraints.txt pins."""
    import importlib
    from pathlib import Path

    pins = (Path(__file__).resolve().parents[1] / "constraints.txt").read_text()
    pin = next(line for line in pins.splitlines() if line.startswith(f"{framework}=="))
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    _hide(monkeypatch, framework)
    with pytest.raises(ImportError) as caught:
        importlib.import_module(package)
    message = str(caught.value)
    assert "secagg[" not in message and "not on PyPI" in message
    assert f"pip install -e '.[{package.split('.')[1]}]' -c constraints.txt" in message
    assert pin.split("==")[1] in message


def test_ci_says_what_it_installs() -> None:
    """``.ci/run``'s announcement names what its pip command does: the same extras and the
    torch version constraints.txt pins, and no "CPU build" claim unless the command takes
    PyTorch's CPU index (CI's machines cannot reach that index, so it does not)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = (root / ".ci" / "run").read_text()
    install = script[script.index("python -m pip install"):]
    install = install[:install.index("\n\n")].replace("\\\n", " ")
    echo = next(line for line in script.splitlines() if line.startswith('echo "== installing'))
    extras = re.search(r'"\.\[([a-z,]+)\]"', install)
    assert extras is not None and "-c constraints.txt" in install
    for extra in extras.group(1).split(","):
        assert extra in echo, (extra, echo)
    pin = re.search(r"^torch==([\d.]+)", (root / "constraints.txt").read_text(), re.M)
    assert pin is not None and f"torch {pin.group(1)}" in echo
    assert ("CPU build" in echo) == ("download.pytorch.org/whl/cpu" in install)


def test_every_flower_version_named_in_the_docs_is_the_pinned_one() -> None:
    """README, docs/, the Flower example and fl/flower name the Flower version
    constraints.txt pins (a measurement made on an older flwr says so: "on flwr X (before
    the pin moved ...)")."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pin = re.search(r"^flwr==(\d+\.\d+)", (root / "constraints.txt").read_text(), re.M)
    assert pin is not None
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")),
             *sorted((root / "examples" / "flower-hospital").rglob("*.*")),
             *sorted((root / "fl" / "flower").glob("*.py"))]
    wrong = []
    for path in files:
        if path.suffix not in (".md", ".py", ".toml"):
            continue
        text = path.read_text()
        for found in re.finditer(r"(?:[Ff]lwr|Flower)(?:\[simulation\])?(?: |==)(\d+\.\d+)(?! s)",
                                 text):
            before = text[max(0, found.start() - 12):found.start()]
            measured = before.endswith("on ") and "before the pin" in text[found.end():][:40]
            if found.group(1) != pin.group(1) and not measured:
                wrong.append(f"{path.relative_to(root)}: {found.group(0)}")
    assert not wrong, wrong
