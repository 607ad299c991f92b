"""Input validation across machines (``secagg train --norm-bound``, docs/protocol.md 10):
the coordinator role puts the bound in the round's task, each site role proves its row
within it (weight non-negative), and a site whose proof fails is left out of the sum and
named in the coordinator's log and the round's report. Three site roles and the
coordinator in one event loop over the in-memory bus, as tests/fl/test_remote_roles.py."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

pytest.importorskip("py_arkworks_bls12381")

import fl.remote.coordinator as remote_coordinator
import fl.remote.site as remote_site
import fl.site.session as site_session
from fl.contribution import TaskError, secagg_bound
from fl.settings import TrainSettings
from secagg.client import Client
from secagg.messages import InputProof
from secagg.validation import norm
from tests.fl.site_cores import site_core
from tests.fl.test_remote_roles import IDS, CountingNetwork, _federation

pytestmark = pytest.mark.timeout(120)
from fl.remote.site import SiteOptions  # noqa: E402

ATTACKER = 2


class ScalingClient(Client):
    """Site 2's client: masks its row times 1000 and proves it with the slack left out
    (no honest prover would: the quadratic relation then fails)."""

    def __init__(self, config: Any, client_id: int, vector: Any, **kwargs: Any) -> None:
        super().__init__(config, client_id, vector, **kwargs)
        if client_id != ATTACKER or config.norm_bound is None:
            return
        x = [v * 1000 for v in norm.centered(self._secrets.input, config.bits)]
        scaled = np.array([v % config.modulus for v in x], dtype=object)
        object.__setattr__(self._secrets, "input", scaled.astype(self._secrets.input.dtype))

        def forged(keys: Any, advertisement: bytes, key_set: bytes) -> InputProof:
            st = norm.NormStatement(self.session_id, self.client_id, config.dim, config.bits,
                                    config.norm_bound, advertisement, config.weight_index)
            squares = norm.four_square_slack(x[-1])
            blind = norm.blinding((bytes(k), added) for k, added in keys)
            return self._signed(InputProof(self.session_id, self.client_id, norm.prove_relation(
                st, x + [0] * norm.SLACK + squares, blind)), key_set)

        object.__setattr__(self, "_input_proof", forged)


def test_a_site_role_that_scales_its_row_is_refused_and_named(monkeypatch: Any) -> None:
    monkeypatch.setattr(site_session, "Client", ScalingClient)  # the site role's client
    validated: list[tuple[str, bool]] = []  # each round's deadlines allow the proofs

    def recording(module: Any, who: str) -> None:
        real = module.round_timeouts

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            validated.append((who, kwargs.get("validated", False)))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, "round_timeouts", wrapper)

    recording(remote_site, "site")
    recording(remote_coordinator, "coordinator")
    settings = TrainSettings(sites=3, rounds=1, dataset="breast-cancer", seed=0,
                             norm_bound=500.0)
    logs: list[str] = []
    options = {cid: SiteOptions(federation="fed", idle_timeout=30, insecure_verify=True,
                                guard=site_core())
               for cid in IDS}
    report, codes = asyncio.run(_federation(settings, CountingNetwork(), options, logs))
    text = "\n".join(logs)
    assert codes == [0, 0, 0], text
    (row,) = report["rounds"]
    assert row["included"] == [1, 3], text
    assert row["dropped"][str(ATTACKER)].startswith("refused: input proof refused"), row
    assert row["aggregate_correct"] is True  # the sum is the honest sites' own
    assert f"round 1: site {ATTACKER} refused and left out" in text
    assert "site 1 refused" not in text and "site 3 refused" not in text
    # the feature-scaling sum has no bound; the training round's deadlines model the proof
    assert sorted(set(validated)) == [("coordinator", False), ("coordinator", True),
                                      ("site", False), ("site", True)], validated


def test_the_bound_is_public_and_the_same_on_both_sides() -> None:
    """Both roles derive Config's fields from the same task map; a bound for another mode,
    or a hostile value, is a TaskError (the site declines, never crashes)."""
    body = {"mode": "none", "norm_bound": 10.0, "strategy": "fedavg"}
    assert secagg_bound(body, 31) == (10 * 2 ** 24 + 3, 30)  # ceil(2^24 B + sqrt(31)/2)
    assert secagg_bound({"mode": "none"}, 31) == (None, None)
    for bad in ({"mode": "distributed", "norm_bound": 10.0},
                {"mode": "none", "norm_bound": 10.0, "strategy": "scaffold"},
                {"mode": "none", "norm_bound": -1.0}, {"mode": "none", "norm_bound": "x"}):
        with pytest.raises(TaskError):
            secagg_bound(bad, 31)
    with pytest.raises(ValueError, match="--norm-bound"):
        TrainSettings(dp="distributed", epsilon=4.0, norm_bound=1.0)


def test_an_honest_in_process_run_with_the_bound_equals_the_run_without() -> None:
    """``--role all``: a bound every site's row is within changes nothing (the same model,
    round by round); a bound below the rows lowers the weights (capped_weight), and the
    run still trains."""
    from fl.federation import train

    base = {"sites": 3, "rounds": 2, "dataset": "breast-cancer", "seed": 0}
    plain = train(TrainSettings(**base))
    bounded = train(TrainSettings(**base, norm_bound=1e4))
    assert [r["accuracy"] for r in plain["rounds"]] == [r["accuracy"] for r in bounded["rounds"]]
    assert [r["step_norm"] for r in plain["rounds"]] == [r["step_norm"] for r in bounded["rounds"]]
    capped = train(TrainSettings(**base, norm_bound=5.0))
    assert [r["included"] for r in capped["rounds"]] == [[1, 2, 3]] * 2
    assert capped["rounds"][-1]["accuracy"] > 0.85
