"""Patient-level units on Opacus: grouping, the clip-norm property, site mode."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")

from dp.budget import PrivacyBudget  # noqa: E402
from dp.errors import BudgetExceeded, PrivacyConfigError  # noqa: E402
from dp.opacus_glue import SitePrivacyEngine  # noqa: E402
from dp.randomness import SeededRandom  # noqa: E402
from dp.units import UnitIndex, clipped_unit_sum, site_unit_gradients  # noqa: E402

warnings.filterwarnings("ignore", module="opacus")
LOSS = torch.nn.CrossEntropyLoss(reduction="sum")


def _data(seed: int, n: int = 40, patients: int = 8) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g) * 3
    y = torch.randint(0, 2, (n,), generator=g)
    pid = [f"p{int(i)}" for i in torch.randint(0, patients, (n,), generator=g)]
    return x, y, pid


def test_per_patient_gradient_is_the_sum_of_its_records() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y, pid = _data(0)
    keys, rows = site_unit_gradients(model, LOSS, x, y, pid, unit="patient")
    assert rows.shape == (len(set(pid)), sum(p.numel() for p in model.parameters()))
    for k, row in zip(keys, rows, strict=True):
        mask = torch.tensor([p == k for p in pid])
        model.zero_grad()
        LOSS(model(x[mask]), y[mask]).backward()
        manual = torch.cat([model.weight.grad.flatten(), model.bias.grad.flatten()])
        assert np.allclose(row, manual.numpy(), atol=1e-5)
    _, rec_rows = site_unit_gradients(model, LOSS, x, y, None, unit="record")
    assert rec_rows.shape[0] == len(x)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), clip=st.floats(0.05, 5.0), victim=st.integers(0, 7))
def test_removing_one_patient_moves_the_site_contribution_by_at_most_the_clip_norm(
        seed: int, clip: float, victim: int) -> None:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    x, y, pid = _data(seed)
    patients = sorted(set(pid))
    gone = patients[victim % len(patients)]
    keep = [i for i, p in enumerate(pid) if p != gone]
    _, full = site_unit_gradients(model, LOSS, x, y, pid)
    _, without = site_unit_gradients(model, LOSS, x[keep], y[keep], [pid[i] for i in keep])
    change = np.linalg.norm(clipped_unit_sum(full, clip) - clipped_unit_sum(without, clip))
    assert change <= clip * (1 + 1e-6)


def test_a_unit_whose_gradient_is_not_finite_contributes_a_zero_row_in_every_mode() -> None:
    """One patient's record overflows the model: that patient's gradient row is zero (the
    other patients' rows as they were), so distributed DP's rows and site-mode DP-SGD's
    update stay finite and the site takes part whatever its records
    (tests/security/test_review_session_nonfinite_site_mode.py end to end)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y, pid = _data(0)
    overflowing = x.clone()
    overflowing[0, 0] = float("inf")
    keys, rows = site_unit_gradients(model, LOSS, overflowing, y, pid)
    _, clean = site_unit_gradients(model, LOSS, x, y, pid)
    at = keys.index(pid[0])
    others = [i for i in range(len(keys)) if i != at]
    assert np.isfinite(clean).all() and np.abs(clean[at]).sum() > 0
    assert (rows[at] == 0).all() and np.allclose(rows[others], clean[others], atol=1e-6)
    engine = SitePrivacyEngine(
        model, torch.optim.SGD(model.parameters(), lr=0.1),
        torch.utils.data.TensorDataset(overflowing, y), loss_fn=LOSS, noise_multiplier=1.0,
        max_grad_norm=1.0, sample_rate=1.0, patient_ids=pid, source=SeededRandom(3))
    engine.step()
    assert all(torch.isfinite(p).all() for p in engine.model.parameters())


def test_unit_sampling_is_poisson_over_patients() -> None:
    index = UnitIndex([i // 3 for i in range(3000)], 3000, "patient")
    assert index.num_units == 1000
    sizes = [len(index.sample(0.1, SeededRandom(s))) for s in range(30)]
    assert abs(np.mean(sizes) - 100) < 10 and np.std(sizes) > 3
    records, position = index.batch(np.array([5, 7]))
    assert sorted(records.tolist()) == [15, 16, 17, 21, 22, 23]
    assert sorted(position.tolist()) == [0, 0, 0, 1, 1, 1]
    with pytest.raises(PrivacyConfigError, match="patient id per record"):
        UnitIndex([1, 2], 3, "patient")


def test_site_mode_trains_and_stops_at_the_budget() -> None:
    torch.manual_seed(1)
    x = torch.randn(400, 5)
    y = (x[:, 0] > 0).long()
    pid = [i // 4 for i in range(400)]
    model = torch.nn.Linear(5, 2)
    budget = PrivacyBudget(3.0, 1e-5)
    engine = SitePrivacyEngine(
        model, torch.optim.SGD(model.parameters(), lr=0.1),
        torch.utils.data.TensorDataset(x, y), loss_fn=LOSS, noise_multiplier=1.5,
        max_grad_norm=1.0, sample_rate=0.1, patient_ids=pid, budget=budget,
        source=SeededRandom(2))
    rounds = 0
    with pytest.raises(BudgetExceeded):
        for _ in range(100):
            engine.train_round(5)
            rounds += 1
    assert 3 <= rounds < 100
    assert budget.spent[0] <= 3.0
    assert budget.spent[0] == pytest.approx(engine.epsilon(1e-5), rel=1e-3)
    accuracy = float((engine.model(x).argmax(1) == y).float().mean())
    assert accuracy > 0.85
