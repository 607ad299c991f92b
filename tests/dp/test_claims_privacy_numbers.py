"""The accounting numbers docs/privacy.md section 4 and 5 print are what the code computes.

The cross-check table is read from the page itself and every cell recomputed (Opacus RDP
and PRV through ``dp.accounting``, dp-accounting's RDP and PLD accountants), together with
the agreement the page states; the ``secagg budget`` example is run as printed."""

from __future__ import annotations

import json
import re
import warnings
from fractions import Fraction
from pathlib import Path

import pytest

pytest.importorskip("opacus")
dpa = pytest.importorskip("dp_accounting")

from dp.accounting import gaussian_epsilon  # noqa: E402
from fl.cli import main  # noqa: E402

PAGE = Path(__file__).resolve().parents[2] / "docs" / "privacy.md"


def _table() -> list[list[str]]:
    text = PAGE.read_text(encoding="utf-8")
    head = "| q | z | steps | delta | Opacus RDP | Opacus PRV | dp-acc. RDP | dp-acc. PLD |"
    lines = text[text.index(head):].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_the_cross_check_table_is_what_the_accountants_compute() -> None:
    rows = _table()
    assert len(rows) == 4
    for q_cell, z, steps, delta, rdp, prv, dpa_rdp, dpa_pld in rows:
        q, z_, n, d = float(Fraction(q_cell)), float(z), int(steps), float(delta)
        event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z_)),
                                        n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours_rdp = gaussian_epsilon(z_, q, n, d, "rdp")
            ours_prv = gaussian_epsilon(z_, q, n, d, "prv")
        theirs_rdp = dpa.rdp.RdpAccountant().compose(event).get_epsilon(d)
        theirs_pld = dpa.pld.PLDAccountant().compose(event).get_epsilon(d)
        computed = [ours_rdp, ours_prv, theirs_rdp, theirs_pld]
        printed = [float(x) for x in (rdp, prv, dpa_rdp, dpa_pld)]
        # the printed 4 decimals, with room for the last digit of a numerical accountant
        assert all(abs(c - p) <= 2e-4 for c, p in zip(computed, printed, strict=True)), (
            q_cell, computed, printed)
        # what the page says about them: RDP agrees to < 0.1 %, PRV within 1.1 % of the
        # PLD and above it, and PRV is tighter than RDP
        assert abs(ours_rdp - theirs_rdp) < 1e-3 * theirs_rdp
        assert theirs_pld <= ours_prv < 1.011 * theirs_pld
        assert ours_prv < ours_rdp


def test_abadi_et_al_example_prints_as_the_page_says() -> None:
    text = " ".join(PAGE.read_text(encoding="utf-8").split())
    assert "epsilon 1.26 with the moments accountant) gives 1.04 here" in text
    assert f"{gaussian_epsilon(4.0, 0.01, 10_000, 1e-5, 'rdp'):.2f}" == "1.04"


def test_the_budget_examples_print_what_the_page_says(
        capsys: pytest.CaptureFixture[str]) -> None:
    text = PAGE.read_text(encoding="utf-8")
    match = re.search(r"\((\d+) rounds; z >= ([0-9.]+) for (\d+) rounds, RDP accountant\.\)",
                      text)
    assert match is not None
    assert main(["budget", "--epsilon", "3", "--delta", "1e-5", "--sample-rate", "0.01",
                 "--noise-multiplier", "1.1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rounds"] == int(match[1])
    assert main(["budget", "--epsilon", "3", "--delta", "1e-5", "--sample-rate", "0.01",
                 "--rounds", match[3], "--json"]) == 0
    z = json.loads(capsys.readouterr().out)["noise_multiplier"]
    assert f"{z:.3f}" == match[2]
