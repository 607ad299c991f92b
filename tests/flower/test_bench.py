"""benchmarks/bench_flower.py still runs (tiny sizes; timings are not asserted), and its
rows say what the side-by-side claims: Flower's round aborts on a dropout before the
masked input, this adapter's completes with the exact integer sum."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_flower.py"


def test_the_flower_benchmark_runs_and_reports_both_protocols(
        capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_flower", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--nodes", "6", "--dim", "50", "--drop-rate", "0.2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by = {(r["scenario"].split(" at ")[1], r["protocol"]): r for r in rows}
    assert by["masked_input", "Flower legacy SecAgg+"]["completed"]
    assert not by["share_keys", "Flower legacy SecAgg+"]["completed"]
    for stage in ("masked_input", "share_keys"):
        for bits in (64, 32):
            row = by[stage, f"secagg adapter ({bits}-bit)"]
            assert row["completed"] and row["exact_sum"] is True
            assert row["bytes_up_per_node"] > 0 and row["seconds"] > 0
            # each row ran in its own process: its peak RSS, its ratio to the floor
            assert row["peak_rss"] > 0 and row["over_floor"] > 0 and row["floor_seconds"] > 0
            assert row["up_over_vector"] > 0
            # the adapter's node keeps a few KB between messages (it trains at the
            # masked-input request), as Flower's SecAgg+ node does
            assert 0 < row["context_bytes_per_node"] < 16_000
