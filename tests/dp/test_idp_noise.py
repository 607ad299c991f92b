"""Patient-idp DP-SGD draws its Gaussian noise from the cryptographic source every other mode
uses (dp.randomness; site mode: dp.opacus_glue.SecureNoiseOptimizer), never from torch's
Mersenne Twister."""

from __future__ import annotations

import numpy as np
import pytest

from dp.idp import group_patients, plan_idp
from dp.randomness import SeededRandom

torch = pytest.importorskip("torch")


class Counting(SeededRandom):
    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.drawn = 0

    def random_bytes(self, n: int) -> bytes:
        self.drawn += n
        return super().random_bytes(n)


def _engine(source: Counting) -> tuple[object, torch.nn.Module]:
    from torch.utils.data import TensorDataset

    from dp.idp_engine import IdpSgd

    ids = [f"p{i // 2}" for i in range(40)]
    x = torch.randn(len(ids), 4, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    groups = group_patients(ids, 2.0)
    plan = plan_idp(groups, delta=1e-5, sample_rate=0.3, steps=4, method="clipping")
    model = torch.nn.Linear(4, 2)
    model.load_state_dict({"weight": torch.zeros(2, 4), "bias": torch.zeros(2)})
    engine = IdpSgd(model, torch.optim.SGD(model.parameters(), lr=0.5), TensorDataset(x, y),
                    loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"), plan=plan,
                    record_group=groups.record_group, source=source)
    return engine, model


def test_patient_idp_noise_comes_from_the_engines_cryptographic_source() -> None:
    first, second = Counting(7), Counting(7)
    (a, model_a), (b, model_b) = _engine(first), _engine(second)
    a.train_round(4)  # type: ignore[attr-defined]
    b.train_round(4)  # type: ignore[attr-defined]
    # The same source gives the same coins and the same noise: nothing else is random.
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(p, q)
    # 4 steps x 10 parameters x 4 normals (the sum-of-four remedy) x 8 bytes, plus the coins
    assert first.drawn >= 4 * 10 * 4 * 8
    other, model_c = _engine(Counting(8))
    other.train_round(4)  # type: ignore[attr-defined]
    assert not np.allclose(model_a.weight.detach().numpy(), model_c.weight.detach().numpy())
    for engine in (a, b, other):
        engine.close()  # type: ignore[attr-defined]
