"""The benchmark scripts still run (tiny sizes, no timing asserted: docs/architecture.md section 7
keeps performance targets out of the test suite)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from secagg import Config, Stage

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_protocol_benchmark_runs_and_reports_ratios(tmp_path: Path) -> None:
    bench = _load("bench_secagg")
    bench.bench_shamir()
    bench.bench_client_masking(dim=1000, neighbours=4)
    bench.bench_server_unmasking(n=6, dim=1000, drop_rate=0.34)
    rnd = bench.Round(Config(num_clients=5, dim=10, bits=16), {1: Stage.MASKED_INPUT})
    rnd.run()  # asserts the aggregate itself
    bench.RESULTS["load_average"] = 0.0
    bench.write_markdown(str(tmp_path / "perf.md"), "--smoke")
    text = (tmp_path / "perf.md").read_text()
    assert "client masking" in text and "x |" in text
    for row in bench.RESULTS.values():
        if isinstance(row, dict) and row.get("floor_seconds"):
            assert row["ratio"] > 0


def test_long_run_benchmark_reports_rss_per_interval(tmp_path: Path) -> None:
    import io

    import numpy as np

    from fl import checkpoint as ckpt

    bench = _load("bench_long_run")
    out = io.StringIO()
    result = bench.run(rounds=4, every=2, broker="memory", checkpoint=str(tmp_path / "ck"),
                       out=out)
    assert [s["round"] for s in result["rss_mib"]] == [0, 2, 4]
    assert all(s["rss_mib"] > 10 for s in result["rss_mib"])
    assert "round     4  rss" in out.getvalue() and "KiB per round" in out.getvalue()
    saved = ckpt.load(tmp_path / "ck")
    assert saved is not None and saved.round == 4 and len(saved.history) == 4
    points = [(0, 100), (100, 350), (200, 500), (300, 910)]
    assert bench.slope(points) == pytest.approx(np.polyfit(*zip(*points, strict=True), 1)[0])


def test_model_size_benchmark_runs_its_rows_at_a_tiny_size() -> None:
    """benchmarks/bench_model_size.py: a `secagg simulate` row and an in-process row at
    d = 3000 run, check the sum, report no dropped payloads, and make a table row."""
    bench = _load("bench_model_size")
    rows = [bench.Row("tiny", 3, 3000), bench.Row("tiny-inprocess", 3, 3000, inprocess=True)]
    results = []
    for row in rows:
        got = bench.run_row(row, bench.REPO)
        assert got["correct"] is True and got["dropped_payloads"] == 0, got
        assert 1.0 <= got["wire"] / (row.dim * 4) < 1.1  # 32-bit elements on the wire
        assert got["max_rss"] > 0
        assert row.inprocess or got["cpu"] > 0  # every process of the command, summed
        results.append((row, got, 0.01))
    text = bench.table(results, bench.REPO)
    assert text.count("| yes |") == 2 and "x |" in text


def test_flood_benchmark_runs_a_round_with_and_without_a_flood() -> None:
    bench = _load("bench_flood")
    for flood, where in ((0, "out"), (3000, "out")):
        got = bench.run_row(bench.REPO, 3, 100, flood, where, 120.0)
        assert got["completed"] and got["included"] == 3, got


def test_validation_benchmark_runs_its_rows_at_a_tiny_size(tmp_path: Path) -> None:
    """benchmarks/bench_validation.py: a site row, an extrapolated row and a round row at
    tiny d, and the docs table it writes between its markers."""
    pytest.importorskip("py_arkworks_bls12381")
    bench = _load("bench_validation")
    row = bench.bench_site(40, sites=3)
    assert row["prove_s"] > 0 and row["proof_bytes"] > row["masked_bytes"]
    far = bench.extrapolate(row, 4000)
    assert far["extrapolated"] and far["prove_s"] == pytest.approx(row["prove_s"] * 100)
    rnd = bench.bench_round(30, sites=3)  # asserts the two rounds' sums are equal
    assert rnd["validated_upload"] > rnd["plain_upload"]
    doc = tmp_path / "perf.md"
    doc.write_text(f"before\n{bench.MARK_BEGIN}\nold\n{bench.MARK_END}\nafter\n")
    bench.write_docs(bench.markdown([row, far], [rnd], 3), doc)
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert "4,000 (extrapolated)" in text and "| 30 |" in text


@pytest.mark.slow
def test_slow_link_benchmark_counts_bytes_per_site() -> None:
    import io

    bench = _load("bench_slow_link")
    out = io.StringIO()
    result = bench.run(features=40, classes=3, sites=3, slow=100e3, rounds=1, out=out)
    assert result["included"] == [[1, 2, 3]]
    assert set(result["blobs_per_round"]) == {1, 2, 3}
    assert "blobs)" in out.getvalue()


def test_ledger_benchmark_reports_cost_per_charge() -> None:
    pytest.importorskip("opacus")
    bench = _load("bench_ledger")
    first, last, size = bench.measure(charges=20, window=10)
    assert (first["at"], last["at"]) == (10, 20)
    assert all(row["cpu_ms"] > 0 and row["bytes"] > 0 for row in (first, last))
    assert size["file_mb"] > 0


def test_session_replay_benchmark_reports_cost_per_admit() -> None:
    pytest.importorskip("opacus")
    bench = _load("bench_session_replay")
    rows = bench.measure(rounds=20, window=10)
    assert [n for n, _ in rows] == [10, 20] and all(s > 0 for _, s in rows)


def test_attack_benchmark_runs_and_writes_its_section(tmp_path: Path) -> None:
    """benchmarks/bench_attacks.py: one plain-FedAvg round of the model-replacement attack
    (the validated runs are the benchmark's, minutes; tests/flower/test_validation.py
    covers them) and its section written between its markers, twice in place."""
    pytest.importorskip("flwr")
    bench = _load("bench_attacks")
    data = bench.Data(0)
    replaced = bench.run(data, 1, bench.app(data, None, inflate=100.0), None)
    clean = bench.run(data, 1, bench.app(data, None, attack=False), None)
    assert replaced["accuracy"][1] < 0.5 < 0.85 < clean["accuracy"][1]
    runs = {"plain FedAvg (Flower, updates in the clear)": replaced,
            "validated secure aggregation (norm_bound)": {**clean, "refused_rounds": 1}}
    section = bench.render({"rounds": 1, "seed": 0, "bound": 1.0, "boost": 100.0,
                            "attacker_share": 0.1, "runs": runs})
    out = tmp_path / "results.md"
    out.write_text("# results\n")
    bench.write(out, section)
    bench.write(out, section)
    text = out.read_text()
    assert text.count(bench.START) == 1 and "| 1 of 1 rounds |" in text


def test_server_cost_benchmark_runs_a_round_and_counts_every_message() -> None:
    """benchmarks/bench_simulate_scale.py --server-cost: one in-process round with
    dropouts ends with the exact sum and reports each stage's messages and CPU."""
    bench = _load("bench_simulate_scale")
    got = bench.server_round(30, 20)
    assert got["correct"] is True and 0 < got["included"] < 30
    assert got["messages"]["advertise_keys"] > got["messages"]["unmasking"] > 0
    assert set(got["receive"]) == set(got["advance"]) == set(got["messages"])
