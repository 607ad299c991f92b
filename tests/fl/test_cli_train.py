"""``secagg train`` through ``fl.cli.app``: report, plot, budget stop, option errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fl.cli import main

pytestmark = pytest.mark.timeout(150)


def test_train_writes_report_and_plot_over_embedded_broker(tmp_path: Path, capsys) -> None:
    report, plot = tmp_path / "report.json", tmp_path / "plot.png"
    code = main(["train", "--sites", "3", "--rounds", "2", "--dataset", "ehr",
                 "--dp", "distributed", "--epsilon", "4", "--delta", "1e-5",
                 "--unit", "patient", "--drop-rate", "0.2", "--broker", "embedded",
                 "--report", str(report), "--plot", str(plot), "--seed", "2"])
    assert code == 0
    data = json.loads(report.read_text())
    assert len(data["rounds"]) == 2
    for row in data["rounds"]:
        assert {"round", "accuracy", "loss", "epsilon", "delta", "included"} <= set(row)
        assert row["delta"] == 1e-5 and 0 < row["epsilon"] <= 4.0
        assert row["aggregate_correct"] is True
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    err = capsys.readouterr().err
    assert "round   2/2" in err and "broker embedded" in err


def test_train_says_when_the_budget_stops_it(tmp_path: Path, capsys) -> None:
    report = tmp_path / "r.json"
    code = main(["train", "--sites", "3", "--rounds", "30", "--dataset", "ehr", "--dp",
                 "distributed", "--epsilon", "1", "--noise-multiplier", "2",
                 "--sample-rate", "0.2", "--broker", "memory", "--report", str(report)])
    assert code == 0
    data = json.loads(report.read_text())
    assert 0 < len(data["rounds"]) < 30 and "not run" in data["stopped"]
    assert "stopped: round" in capsys.readouterr().err


def test_train_csv_and_option_errors(tmp_path: Path, capsys) -> None:
    csv = tmp_path / "own.csv"
    rows = ["pid,a,b,label"] + [f"p{i // 2},{i % 7},{(i * 3) % 5},{int(i % 7 > 3)}"
                                for i in range(120)]
    csv.write_text("\n".join(rows) + "\n")
    assert main(["train", "--sites", "2", "--rounds", "1", "--csv", str(csv),
                 "--patient-column", "pid", "--label-column", "label", "--broker",
                 "memory"]) == 0
    assert main(["train", "--sites", "2", "--rounds", "1", "--csv", str(csv),
                 "--patient-column", "nope", "--label-column", "label"]) == 2
    assert "--patient-column" in capsys.readouterr().err
    assert main(["train", "--sites", "3", "--rounds", "1", "--dp", "site"]) == 2
    assert "--epsilon" in capsys.readouterr().err
    assert main(["train", "--sites", "3", "--rounds", "1", "--broker", "amqp://x"]) == 2


def test_cli_import_does_not_import_torch() -> None:
    code = "import sys, fl.cli.app; fl.cli.app.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "False"
