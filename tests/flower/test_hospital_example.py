"""examples/flower-hospital as its user runs it: the server app prints each round's summary
as the round ends (not all at the end), and the hospital's own task code raises no torch
warning. The example's ServerApp and ClientApp run on the in-process grid
(fl.flower.local.LocalGrid: Flower's serde, a Context rebuilt per message) with the
example's own run config, scaled down to three hospitals and two rounds."""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import tomllib
from flwr.app import Context, Message, RecordDict
from flwr.common.serde import context_to_proto

from fl.flower.local import LocalGrid

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower-hospital"

pytest.importorskip("torch")


def test_the_hospital_app_prints_each_round_as_it_ends_and_trains_without_warnings(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    for name in [n for n in sys.modules if n.startswith("hospital_app")]:
        monkeypatch.delitem(sys.modules, name)
    from hospital_app import client_app, server_app

    config: dict[str, Any] = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())[
        "tool"]["flwr"]["app"]["config"]
    config |= {"hospitals": 3, "num-server-rounds": 2, "num-patients": 300}
    # Scaled down to three hospitals, each node's own noise share is below the default
    # floor (docs/privacy.md, "A site nobody configured"): the hospitals' operators state
    # their own policy here, as docs/flower.md shows; what is tested is the printing.
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"modes": ["distributed"], "min_noise_multiplier": 0.0,
                                  "round_epsilon": None, "epsilon": None}))
    grid = LocalGrid(client_app.app, 3)
    for i, node in enumerate(grid.nodes):
        grid.contexts[node] = context_to_proto(Context(
            run_id=7, node_id=node, node_config={"partition-id": i, "num-partitions": 3,
                                                  "secagg-policy": str(policy),
                                                  "secagg-ledger": str(tmp_path / f"l{i}")},
            state=RecordDict(), run_config=config))
    seen: list[str] = []  # what the server app had printed when each exchange started
    exchange = grid.send_and_receive

    def send_and_receive(messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        seen.append(capsys.readouterr().out)
        print(end="".join(seen[-1:]))  # keep it for the next look
        return exchange(messages, timeout=timeout)

    monkeypatch.setattr(grid, "send_and_receive", send_and_receive)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        server_app.main(grid, Context(run_id=7, node_id=0, node_config={},
                                      state=RecordDict(), run_config=config))
    final = capsys.readouterr().out
    assert "round 1: 3 hospitals summed" in final and "round 2: 3 hospitals summed" in final
    # round 1's line was out before round 2's exchanges started
    assert any("round 1: 3 hospitals summed" in out for out in seen)
    assert not any("round 2:" in out for out in seen)
    from_example = [w for w in caught if str(EXAMPLE) in str(w.filename)]
    assert not from_example, [str(w.message) for w in from_example]
