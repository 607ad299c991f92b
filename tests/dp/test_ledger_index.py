"""The ledger's indexes (dp/ledger.py): its round keys in a set and its charges by id, built
at open from the append-only log and kept as charges are made and withdrawn, so the site
session's replay rule (fl/site/session.py ``joined``) and a withdrawal cost the same at any
length (benchmarks/bench_session_replay.py). They must answer what a scan of the charges
answers, after a reopen too."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("opacus")

from dp.encoding import EncodingParams
from dp.ledger import Ledger, label_keys
from dp.policy import Proposal, SitePolicy
from fl.site.session import label_of

POLICY = SitePolicy(modes=("distributed", "none"), min_threshold=2, epsilon=1e6, delta=1e-5)


def _dist(label: str) -> Proposal:
    params = EncodingParams(dim=20, clip_norm=1.0, scale=4096.0, bits=40, noise_stddev=50.0,
                            rotation_seed=1, threshold=3)
    return Proposal.distributed(params, sample_rate=0.01, secagg_threshold=3, label=label)


def _exact(label: str) -> Proposal:
    return Proposal.exact("train", secagg_threshold=3, label=label)


LABELS = ["round 1", label_of("round 2", b"\x01\xab"), label_of("round 3", "run-7"),
          label_of("x [key deadbeef]", "cafe"), label_of("y", "a] [key b"), "z [key q] tail",
          label_of("", ""), "[key ]]"]
"""Labels a coordinator's words end up in, with keys that nest the marker."""
PROBES = ["", "01ab", "1ab", "run-7", "run", "cafe", "deadbeef", "deadbeef] [key cafe", "q",
          "a] [key b", "b", "]", "a", "x"]


def test_the_key_index_answers_what_a_scan_of_the_labels_answers() -> None:
    for label in LABELS:
        keys = label_keys(label)
        for probe in PROBES:
            assert (probe in keys) == label.endswith(f"[key {probe}]"), (label, probe)


def test_keys_and_ids_survive_a_reopen_and_withdrawn_charges_keep_their_key(
        tmp_path: Path) -> None:
    path = tmp_path / "ledger.json"
    with Ledger.open(path, POLICY) as ledger:
        made = [ledger.charge(_dist(label) if n % 2 else _exact(label))
                for n, label in enumerate(LABELS)]
        ledger.withdraw(made[1], "never left")
        ledger.withdraw(made[2], "never left")
        live = {p: ledger.holds_key(p) for p in PROBES}
    assert live == {p: any(c.label.endswith(f"[key {p}]") for c in made) for p in PROBES}
    with Ledger.open(path, POLICY) as ledger:
        assert {p: ledger.holds_key(p) for p in PROBES} == live
        assert [ledger.get(c.id) for c in made] == ledger.charges
        assert ledger.get(made[1].id).withdrawn == "never left"  # type: ignore[union-attr]
        assert ledger.get(0) is None and ledger.get(len(made) + 1) is None
        new = ledger.charge(_exact(label_of("round 9", b"\x09")))
        assert ledger.holds_key("09") and ledger.get(new.id) == new


def test_totals_after_withdrawals_are_what_a_reopen_composes(tmp_path: Path) -> None:
    """A withdrawn exact sum takes one release off the running count; a withdrawn DP charge
    recomposes; a second withdrawal of the same charge changes nothing."""
    path = tmp_path / "ledger.json"
    with Ledger.open(path, POLICY) as ledger:
        made = [ledger.charge(_dist(f"d{n}") if n % 2 else _exact(f"e{n}")) for n in range(6)]
        assert ledger.releases == 6
        counts = []
        for charge in (made[1], made[0], made[2], made[0], made[1]):
            ledger.withdraw(charge, "never left")
            counts.append(ledger.releases)
        assert counts == [5, 4, 3, 3, 3]
        ledger.charge(_exact("e6"))
        live = (ledger.epsilon, ledger.releases, [c.id for c in ledger.active()])
    assert live[1] == 4 and live[2] == [4, 5, 6, 7]
    with Ledger.open(path, POLICY) as ledger:
        again = (ledger.epsilon, ledger.releases, [c.id for c in ledger.active()])
    assert again[1:] == live[1:] and again[0] == pytest.approx(live[0], rel=1e-12)


def test_withdrawing_a_charge_the_ledger_does_not_hold_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ledger.json"
    with Ledger.open(tmp_path / "other.json", POLICY) as other:
        other.charge(_exact("a"))
        stranger = other.charge(_exact("b"))
    with Ledger.open(path, POLICY) as ledger:
        ledger.charge(_exact("c"))
        raw = path.read_bytes()
        with pytest.raises(KeyError, match="charge 2 is not in the privacy ledger"):
            ledger.withdraw(stranger, "never left")
        assert path.read_bytes() == raw and ledger.releases == 1
    with Ledger.open(path, POLICY) as ledger:  # still readable
        assert ledger.releases == 1
