"""Model <-> vector conversion: stable order, dtypes, shapes checked, exact round trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl.vector import LayoutError, ParameterLayout, model_to_vector, vector_to_model


def _modules() -> list[tuple[str, torch.nn.Module, bool]]:
    torch.manual_seed(0)
    return [
        ("linear", torch.nn.Linear(7, 3), False),
        ("mlp", torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 2)), False),
        ("conv-bn", torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                        torch.nn.Flatten()), True),
        ("lstm", torch.nn.LSTM(4, 6, num_layers=2), False),
        ("embedding-f64", torch.nn.Sequential(torch.nn.Embedding(10, 4),
                                              torch.nn.Linear(4, 2)).double(), False),
        ("half", torch.nn.Linear(4, 4).half(), False),
    ]


@pytest.mark.parametrize(("name", "module", "buffers"), _modules(),
                         ids=[m[0] for m in _modules()])
def test_round_trip(name: str, module: torch.nn.Module, buffers: bool) -> None:
    layout = ParameterLayout.of(module, include_buffers=buffers)
    vec = layout.to_vector(module)
    assert vec.dtype == np.float64 and vec.shape == (layout.size,)
    expected = sum(p.numel() for p in module.parameters())
    if buffers:
        expected += sum(b.numel() for b in module.buffers() if torch.is_floating_point(b))
    assert layout.size == expected
    # A different vector loads into the module and reads back exactly (after the dtype cast).
    rng = np.random.default_rng(1)
    new = rng.normal(size=layout.size)
    if module.parameters().__next__().dtype == torch.float16:
        new = new.astype(np.float16).astype(np.float64)
    elif module.parameters().__next__().dtype == torch.float32:
        new = new.astype(np.float32).astype(np.float64)
    layout.load(module, new)
    assert np.array_equal(layout.to_vector(module), new)
    # Order is the named_parameters order: the first entry's values lead the vector.
    first_name, first = next((n, p) for n, p in module.named_parameters())
    assert layout.entries[0].name == first_name
    assert np.array_equal(new[:first.numel()],
                          first.detach().double().reshape(-1).numpy())
    # Dtypes are preserved.
    assert all(e.dtype == p.dtype for e, p in zip(layout.entries, module.parameters(),
                                                  strict=False))


def test_shortcuts_agree() -> None:
    m = torch.nn.Linear(3, 2)
    v = model_to_vector(m) + 1.0
    vector_to_model(m, v)
    assert np.allclose(model_to_vector(m), v)


def test_mismatches_are_refused() -> None:
    a = torch.nn.Linear(4, 2)
    layout = ParameterLayout.of(a)
    with pytest.raises(LayoutError, match="shape"):
        layout.to_vector(torch.nn.Linear(5, 2))
    with pytest.raises(LayoutError, match="dtype"):
        layout.to_vector(torch.nn.Linear(4, 2).double())
    with pytest.raises(LayoutError, match="missing"):
        layout.to_vector(torch.nn.Sequential(torch.nn.Linear(4, 2)))
    with pytest.raises(LayoutError, match="needs"):
        layout.load(a, np.zeros(layout.size + 1))
    bad = np.zeros(layout.size)
    bad[0] = np.nan
    before = layout.to_vector(a)
    with pytest.raises(LayoutError, match="NaN"):
        layout.load(a, bad)
    assert np.array_equal(layout.to_vector(a), before)  # nothing half-loaded


def test_frozen_parameters_are_not_in_the_vector() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    m[0].weight.requires_grad_(False)
    layout = ParameterLayout.of(m)
    assert [e.name for e in layout.entries] == ["0.bias", "1.weight", "1.bias"]
