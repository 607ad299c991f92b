"""The site role is one runtime of the site core (fl/site/core.py): what it adds may not
weaken what the core charges."""

from __future__ import annotations

from pathlib import Path

import pytest

from dp.policy import SitePolicy
from fl.cli import main
from fl.remote.inputs import demo_site_data
from fl.remote.site import SiteOptions, SiteProcess
from fl.settings import TrainSettings
from fl.site.core import open_site_core
from transport.memory import MemoryNetwork


def test_insecure_verify_is_refused_on_a_dp_site(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``--insecure-verify`` sends the site's input in the clear: a distributed-DP input
    carries only the site's own noise share, while its ledger would charge the noise of the
    calibration threshold's sites. Refused before the site connects or charges anything."""
    ledger = tmp_path / "ledger.json"
    code = main(["train", "--role", "site", "--site-id", "1", "--sites", "3",
                 "--broker", "mqtt://127.0.0.1:9", "--dp", "distributed", "--epsilon", "5",
                 "--insecure-verify", "--ledger", str(ledger)])
    assert code == 2
    assert "--insecure-verify sends this site's input in the clear" in capsys.readouterr().err
    assert not ledger.exists()
    data = demo_site_data(TrainSettings(sites=3), 1, (1, 2, 3))
    for policy in (SitePolicy(), SitePolicy(modes=("none", "site"))):
        with open_site_core(policy=policy, ledger_path=str(tmp_path / "l.json")) as core, \
                pytest.raises(ValueError, match="drop --insecure-verify"):
            SiteProcess(data, MemoryNetwork(), SiteOptions(insecure_verify=True, guard=core),
                        lambda text: None)
    with open_site_core(policy=SitePolicy(modes=("none",)),
                        ledger_path=str(tmp_path / "l.json")) as core:
        SiteProcess(data, MemoryNetwork(), SiteOptions(insecure_verify=True, guard=core),
                    lambda text: None)  # an exact (no-DP) test run may verify
