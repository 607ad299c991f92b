"""Site mode's DP-SGD engine: noise from the cryptographic source by default, and private
adaptive clipping (Andrew et al. 2021) accounted as one Gaussian per step."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")

from dp.accounting import gaussian_epsilon  # noqa: E402
from dp.opacus_glue import SecureNoiseOptimizer, SitePrivacyEngine  # noqa: E402
from dp.randomness import SeededRandom  # noqa: E402

LOSS = torch.nn.CrossEntropyLoss(reduction="sum")


def _engine(source_seed: int, torch_seed: int, **kwargs: object) -> SitePrivacyEngine:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 4, generator=g) * 3
    y = (x[:, 0] > 0).long()
    pid = [f"p{i // 2}" for i in range(120)]
    torch.manual_seed(torch_seed)
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    options = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "sample_rate": 0.3, **kwargs}
    return SitePrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             torch.utils.data.TensorDataset(x, y), loss_fn=LOSS,
                             patient_ids=pid, source=SeededRandom(source_seed),
                             **options)  # type: ignore[arg-type]


def _params_after(engine: SitePrivacyEngine, steps: int) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            engine.step()
    return torch.cat([p.detach().flatten() for p in engine.model.parameters()])


def test_site_noise_comes_from_the_cryptographic_source_by_default() -> None:
    a, b = _engine(7, torch_seed=1), _engine(7, torch_seed=2)
    assert isinstance(a.optimizer, SecureNoiseOptimizer)
    # Same CSPRNG key, different torch state: identical noise, so torch's generator is unused.
    assert torch.equal(_params_after(a, 3), _params_after(b, 3))
    c = _engine(8, torch_seed=1)
    assert not torch.equal(_params_after(_engine(7, torch_seed=1), 3), _params_after(c, 3))
    torch_noise = _engine(7, torch_seed=1, secure_noise=False)
    assert not isinstance(torch_noise.optimizer, SecureNoiseOptimizer)


def test_adaptive_clipping_moves_the_clip_to_the_quantile_and_is_accounted_jointly() -> None:
    engine = _engine(3, torch_seed=0, max_grad_norm=50.0, target_quantile=0.5,
                     count_stddev=1.0, clip_learning_rate=0.5,
                     expected_batch=18.0)  # declared: 60 patients x 0.3
    _params_after(engine, 40)
    assert engine.clip_norm < 10.0  # started far above every patient's gradient norm
    event = engine.round_event(40)
    assert event.count_stddev == 1.0 and event.effective_noise_multiplier < 1.0
    assert engine.epsilon(1e-5) == pytest.approx(
        gaussian_epsilon(event.effective_noise_multiplier, 0.3, 40, 1e-5), rel=1e-6)
    assert engine.epsilon(1e-5) > gaussian_epsilon(1.0, 0.3, 40, 1e-5)
