"""The site ledger's file: an append-only log whose charge costs the same at any length, that
survives a crash mid-write without losing a charge, and that still reads format-1 ledgers."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

pytest.importorskip("opacus")

from dp.encoding import EncodingParams
from dp.errors import PrivacyConfigError
from dp.ledger import Ledger, read_charges
from dp.policy import Proposal, SitePolicy

POLICY = SitePolicy(modes=("distributed",), min_threshold=2, epsilon=1e6, delta=1e-5)


def _dist() -> Proposal:
    params = EncodingParams(dim=20, clip_norm=1.0, scale=4096.0, bits=40, noise_stddev=50.0,
                            rotation_seed=1, threshold=3)
    return Proposal.distributed(params, sample_rate=0.01, secagg_threshold=3)


def _written() -> int:
    """Bytes this process has passed to write calls so far (Linux)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_a_charge_writes_one_record_whatever_the_ledgers_length(tmp_path: Path) -> None:
    """Format 1 rewrote every past charge on each charge (0.73 s at 1,000 charges): the
    bytes written per charge grew linearly. Now a charge appends its own line."""
    path = tmp_path / "ledger.json"
    with Ledger.open(path, POLICY) as ledger:
        cost = {}
        proposal = _dist()
        for n in range(1, 301):
            before, size = _written(), path.stat().st_size if path.exists() else 0
            head = path.read_bytes() if n in (10, 300) else b""
            ledger.charge(proposal)
            cost[n] = _written() - before
            if head:  # what was there is untouched: the charge appended
                assert path.read_bytes()[:size] == head
        assert cost[300] == pytest.approx(cost[10], rel=0.05)
        assert cost[300] < 2 * (path.stat().st_size / 300)


def test_a_crash_mid_write_loses_no_acknowledged_charge_and_counts_no_less(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ledger.json"
    with Ledger.open(path, POLICY) as ledger:
        kept = [ledger.charge(_dist()) for _ in range(3)]
        spent = ledger.epsilon
    real = os.pwrite

    def torn(fd: int, data: bytes, offset: int) -> int:  # the process dies mid-record
        real(fd, bytes(data)[: len(data) // 2], offset)
        raise KeyboardInterrupt

    with Ledger.open(path, POLICY) as ledger:
        monkeypatch.setattr(os, "pwrite", torn)
        with pytest.raises(KeyboardInterrupt):  # charge() never returned: nothing was sent
            ledger.charge(_dist())
        with pytest.raises(KeyboardInterrupt):  # a withdrawal torn: the charge stays counted
            ledger.withdraw(kept[-1], "never left")
        monkeypatch.setattr(os, "pwrite", real)
    assert not path.read_bytes().endswith(b"\n")  # the torn line is on disk
    with Ledger.open(path, POLICY) as ledger:  # a new process
        assert [c.id for c in ledger.active()] == [1, 2, 3]
        assert ledger.epsilon == pytest.approx(spent, rel=1e-12)
        assert path.read_bytes().endswith(b"\n")  # cut at the last whole record
        ledger.charge(_dist())
    assert [c.id for c in read_charges(path)] == [1, 2, 3, 4]


def test_a_whole_last_record_without_its_newline_counts(tmp_path: Path) -> None:
    path = tmp_path / "ledger.json"
    with Ledger.open(path, POLICY) as ledger:
        ledger.charge(_dist())
        ledger.charge(_dist())
    path.write_bytes(path.read_bytes()[:-1])  # the crash came before the newline
    with Ledger.open(path, POLICY) as ledger:
        assert ledger.releases == 2
        ledger.charge(_dist())
    assert [c.id for c in read_charges(path)] == [1, 2, 3]


@pytest.mark.parametrize("damage", ["middle", "tail", "file"])
def test_a_damaged_ledger_is_refused_and_left_as_it_is(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "ledger.json"
    with Ledger.open(path, POLICY) as ledger:
        for _ in range(3):
            ledger.charge(_dist())
    lines = path.read_bytes().split(b"\n")
    if damage == "middle":  # a cut line followed by whole ones is not a crash
        lines[2] = lines[2][:40]
        raw = b"\n".join(lines)
    elif damage == "tail":  # a last line this module never writes
        raw = path.read_bytes() + b"garbage"
    else:
        raw = b"{not json"
    path.write_bytes(raw)
    with pytest.raises(PrivacyConfigError, match="unreadable"):
        Ledger.open(path, POLICY)
    assert path.read_bytes() == raw


def test_a_format1_ledger_is_read_and_migrated_by_the_next_charge(tmp_path: Path) -> None:
    path = tmp_path / "ledger.json"
    with Ledger.open(tmp_path / "new.json", POLICY) as ledger:
        first, second = ledger.charge(_dist()), ledger.charge(_dist())
        ledger.withdraw(second, "refused at go")
        spent = ledger.epsilon
        charges = ledger.charges
    path.write_text(json.dumps({"format": 1, "policy": POLICY.to_json(),  # as format 1 wrote
                                "charges": [asdict(c) for c in charges]}, indent=1) + "\n")
    with Ledger.open(path, POLICY) as ledger:
        assert ledger.charges == charges and ledger.releases == 1
        assert ledger.epsilon == pytest.approx(spent, rel=1e-12)
        assert path.read_text().startswith("{\n")  # reading changes nothing
        third = ledger.charge(_dist())
    assert read_charges(path) == [*charges, third]
    header = json.loads(path.read_text().splitlines()[0])
    assert header["format"] == 2 and header["policy"] == POLICY.to_json()
    with Ledger.open(path, POLICY) as ledger:
        assert ledger.releases == 2 and ledger.epsilon > spent
        assert first.id == 1 and ledger.charges[1].withdrawn == "refused at go"


def test_running_totals_match_the_recomposed_ledger(tmp_path: Path) -> None:
    """The in-memory totals a charge is checked against are what a reopen composes."""
    path = tmp_path / "ledger.json"
    other = SitePolicy(modes=("distributed",), min_threshold=2, epsilon=1e5, delta=1e-5)
    with Ledger.open(path, POLICY) as ledger:
        charges = [ledger.charge(_dist()) for _ in range(5)]
        ledger.withdraw(charges[1], "never left")
        ledger.charge(_dist())
        live = (ledger.epsilon, ledger.releases)
    with Ledger.open(path, other) as ledger:  # another policy: logged, not rewritten
        assert (ledger.epsilon, ledger.releases) == pytest.approx(live, rel=1e-12)
        ledger.charge(_dist())
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [next(iter(r)) for r in records] == (["format"] + ["charge"] * 5 + ["withdraw"]
                                                + ["charge", "policy", "charge"])
    assert records[-1]["charge"]["epsilon_after"] > live[0]
