"""docs/quickstart.md section 1's differential-privacy command, taken from the docs' text and
run as printed (``--rounds`` shortened, as the docs show a flag overriding; the in-process
broker; the plot written to the test's folder): every site takes part in every round, the
loss falls and the budget holds (issue 27: the docs' examples that configure privacy
train)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

pytest.importorskip("torch")

from fl.cli.app import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"


def _command(marker: str) -> list[str]:
    """The docs' ``secagg ...`` command of the code block containing ``marker``."""
    blocks, block, inside = [], [], False
    for line in DOC.read_text().splitlines():
        if line.strip().startswith("```"):
            if inside:
                blocks.append("\n".join(block))
            inside, block = not inside, []
        elif inside:
            block.append(line)
    blocks = [b for b in blocks if marker in b]
    assert len(blocks) == 1, (marker, len(blocks))
    argv = shlex.split(blocks[0].replace("\\\n", " "))
    assert argv[0] == "secagg"
    return argv[1:]


def test_the_quickstart_dp_command_trains(tmp_path: Path) -> None:
    argv = _command("--plot dp.png")
    assert argv[argv.index("--epsilon") + 1] == "4" and "--plot" in argv
    argv[argv.index("--plot") + 1] = str(tmp_path / "dp.png")
    report = tmp_path / "report.json"
    assert main([*argv, "--rounds", "4", "--broker", "memory", "-q",
                 "--report", str(report)]) == 0
    rows = json.loads(report.read_text())["rounds"]
    assert len(rows) == 4 and all(len(r["included"]) == 5 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert 0 < rows[-1]["epsilon"] <= 4.0
