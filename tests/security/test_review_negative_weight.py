"""Review PoC (input validation, fixed point): the proved bound is on the L2 norm of the row
``[w x, w m, w]``; a site with a valid login sends a *negative* weight that cancels the honest
nodes' summed weight down to a hair above zero. Its row is well within the bound; before the
fix its proof passed, it was never named, and the server divided the honest weighted sum by
that hair: the global model was blown up by orders of magnitude. Fixed: the round's weight
coordinate is public (``Config.weight_index``, set by the round setup) and proved
non-negative inside the same proof (docs/protocol.md 10.7); the attacker's proof fails, it
is named and left out, and the model is the honest nodes' weighted average."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import pytest

pytest.importorskip("py_arkworks_bls12381")

from adversary import threat
from flwr.app import Message
from flwr.serverapp.strategy import FedAvg

from fl.flower import NodeOptions, SecureAggregation, make_secagg_mod
from fl.flower.local import LocalGrid
from fl.round_setup import _fixed
from fl.site.session import Joined, SiteSession
from secagg import Client
from secagg.messages import InputProof
from secagg.validation import norm
from tests.flower import apps

N = 5
BOUND = 40.0  # as tests/flower/test_validation.py: every honest row is below it
DELTA = 0.01  # the summed weight the attacker leaves


@pytest.fixture(autouse=True)
def _own_state(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The nodes' ledgers and stage records per test (as tests/flower/conftest.py)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


class NegativeWeightSession(SiteSession):
    """Masks the row ``[0, ..., 0, -(sum of the others' weights) + DELTA]`` (norm < BOUND)
    and proves it with the prover's own core (its honest client refuses a negative weight):
    the norm's slack honestly, and, when the round asks for the weight's squares, the
    squares of |w| (the cheapest lie: any small squares sum to a non-negative number).
    Its client is given a weight-1 row at the masked-input request (a client checks its
    input) and handed the evil row before it masks or proves anything. A session lives for
    one message: the row is kept per client id in between."""

    evil_rows: ClassVar[dict[int, Any]] = {}

    def encode(self, joined: Joined, arrays: Any, metrics: Mapping[str, float],
               weight: float) -> Any:
        setup = joined.setup
        me = setup.node_of(joined.client_id)
        others = sum(float(apps.reply_content(n, setup.server_round)["metrics"]["num-examples"])
                     for n in setup.roster if n != me)
        row = np.zeros(setup.model_dim + len(setup.metrics) + 1)
        row[-1] = -others + DELTA
        assert np.linalg.norm(row) < BOUND  # within the proved bound
        self.evil_rows[joined.client_id] = _fixed(setup).encode(row)
        row[-1] = 1.0  # what its client is built with (it checks its input)
        return _fixed(setup).encode(row)

    def answer_with_proof(self, client: Client, payload: bytes, charge: int
                          ) -> tuple[bytes | None, Any]:
        cfg = client.config
        honest = client._secrets.input
        if honest is not None and client.client_id in self.evil_rows:
            # the node trained at this request and gave its client the weight-1 row
            # (``provide_input`` checks it); the evil row replaces it before it is masked
            evil = self.evil_rows.pop(client.client_id).astype(honest.dtype)
            object.__setattr__(client._secrets, "input", evil)

        def forged(keys: Any, advertisement: bytes, key_set: bytes) -> InputProof:
            assert cfg.norm_bound is not None
            st = norm.NormStatement(client.session_id, client.client_id, cfg.dim, cfg.bits,
                                    cfg.norm_bound, advertisement, cfg.weight_index)
            x = norm.centered(client._secrets.input, cfg.bits)
            witness = x + norm.four_square_slack(cfg.norm_bound ** 2 - sum(v * v for v in x))
            if cfg.weight_index is not None:
                witness += norm.four_square_slack(-x[cfg.weight_index])
            blind = norm.blinding((bytes(k), added) for k, added in keys)
            return client._signed(InputProof(client.session_id, client.client_id,
                                             norm.prove_relation(st, witness, blind)), key_set)

        object.__setattr__(client, "_input_proof", forged)
        return super().answer_with_proof(client, payload, charge)


class NegativeWeightNode(NodeOptions):
    def session(self, context: Any) -> SiteSession:
        evil = NegativeWeightSession.__new__(NegativeWeightSession)
        evil.__dict__.update(super().session(context).__dict__)
        return evil


def _grid(attacker: int) -> LocalGrid:
    grid = LocalGrid(None, N)
    honest = apps.operated()
    evil = apps.operated(make_secagg_mod(NegativeWeightNode()))
    target = grid.nodes[attacker]

    def mod(msg: Message, context: Any, call_next: Any) -> Message:
        return (evil if context.node_id == target else honest)(msg, context, call_next)

    grid.app = apps.client_app(mods=[mod])
    return grid


@threat(attack="A negative weight within the norm bound",
        adversary="malicious client",
        controls="its row: zeros with a weight of minus the honest total plus 0.01, proved "
                 "with the prover's core (the norm's slack honest, the squares of |w|)",
        protocol="the weight coordinate (public: Config.weight_index) is proved non-negative "
                 "in the same proof (x_k = sum of squares); the proof fails, the site is "
                 "named and left out",
        shows="defence")
def test_a_negative_weight_within_the_bound_does_not_blow_up_the_model() -> None:
    grid = _grid(attacker=2)
    attacker = grid.nodes[2]
    honest = frozenset(grid.nodes) - {attacker}
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=N),
                                neighbors=None, norm_bound=BOUND)
    try:
        result = wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=30)
    except Exception:  # nothing released is the safe outcome of this attack too
        result = None
    (report,) = wrapper.reports
    # refused and named (the claim), whether or not the round released a sum
    assert attacker in report.input_refused, report
    assert "does not verify" in report.input_refused[attacker]
    assert result is not None and report.total is not None
    assert report.included == honest
    expected = apps.weighted_average(honest, 1)
    for name, value in expected.items():
        got = result.arrays[name].numpy()
        # the attacker's row is bounded by BOUND, so it may move the sum by BOUND, not
        # multiply the honest average by (sum of honest weights) / DELTA
        assert np.linalg.norm(got) < 10 * max(np.linalg.norm(value), 1.0), (
            f"{name}: |model| = {np.linalg.norm(got):.1f}, honest average "
            f"{np.linalg.norm(value):.2f}; attacker {attacker} named? "
            f"{attacker in report.input_refused}")
        np.testing.assert_allclose(got, value, atol=1e-3)  # the honest nodes' own average
