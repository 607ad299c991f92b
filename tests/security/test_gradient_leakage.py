"""What the server sees: gradient leakage from a site's update (issue #6).

Two attacks, each shown to succeed on the plaintext update (encoded as a site would for
distributed DP, without noise, and decoded: what a server without secure aggregation gets)
and to fail on what the server receives under secure aggregation (the site's masked vector
from a real round, decoded as if it were an update):

* exact input reconstruction from the gradient of a linear layer with bias (one record:
  dL/dW = g x^T and dL/db = g, so x = dW[i] / db[i]);
* deep leakage from gradients (Zhu, Liu, Han, NeurIPS 2019), with the label inferred from
  the sign of the last bias gradient (iDLG, Zhao et al. 2020), on a small MLP.
"""

from __future__ import annotations

import numpy as np
import pytest
from adversary import Puppeteer, threat

from dp import EncodingParams, IntegerEncoder
from secagg import Config

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.security

VICTIM = 1
SITES = 5


def _encoder(dim: int) -> IntegerEncoder:
    # clip_norm large enough not to clip (clipping would rescale dW and db alike anyway)
    return IntegerEncoder(EncodingParams(dim=dim, clip_norm=1e3, scale=2.0**20, bits=48,
                                         noise_stddev=0.0, rotation_seed=11, threshold=1))


def _server_views(update: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(plaintext update as the server decodes it without SecAgg, the victim's masked
    vector from a real round decoded the same way)."""
    encoder = _encoder(update.size)
    rng = np.random.default_rng(seed)
    encoded = {VICTIM: encoder.encode(update, noise=False)}
    for cid in range(2, SITES + 1):
        encoded[cid] = encoder.encode(rng.normal(size=update.size), noise=False)
    plaintext = encoder.decode(encoded[VICTIM], 1)
    cfg = Config(num_clients=SITES, dim=encoder.params.encoded_dim,
                 bits=encoder.params.bits)
    p = Puppeteer(cfg, inputs=encoded, seed=seed)
    p.honest_until_masked_input()
    assert VICTIM in p.masked
    masked = encoder.decode(p.masked[VICTIM].vector().astype(np.uint64), 1)
    return plaintext, masked


# --- linear layer ------------------------------------------------------------------------------


def _linear_update(x: np.ndarray, label: int, seed: int) -> np.ndarray:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(x.size, 4).double()
    loss = torch.nn.functional.cross_entropy(layer(torch.from_numpy(x)[None]),
                                             torch.tensor([label]))
    loss.backward()
    assert layer.weight.grad is not None and layer.bias.grad is not None
    return np.concatenate([layer.weight.grad.numpy().ravel(), layer.bias.grad.numpy()])


def invert_linear(update: np.ndarray, d_in: int, d_out: int = 4) -> np.ndarray:
    """The attacker: x = dW[i] / db[i] for the row with the largest |db[i]|."""
    dw = update[: d_in * d_out].reshape(d_out, d_in)
    db = update[d_in * d_out: d_in * d_out + d_out]
    i = int(np.argmax(np.abs(db)))
    return np.asarray(dw[i] / db[i])


@threat(attack="Gradient inversion of a linear layer",
        adversary="curious server (plaintext vs. masked update)",
        controls="one site's update of a linear layer trained on one record",
        protocol="plaintext: x = dW[i] / db[i] exactly; SecAgg: the server holds only "
                 "x + uniform masks, and the inversion of the decoded masked vector is noise")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_linear_layer_inversion_works_on_plaintext_only(seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, size=32)
    plaintext, masked = _server_views(_linear_update(x, seed % 4, seed), seed)
    from_plain = invert_linear(plaintext, 32)
    from_masked = invert_linear(masked, 32)
    assert np.max(np.abs(from_plain - x)) < 1e-3  # exact up to the encoding's rounding
    error = np.linalg.norm(from_masked - x) / np.linalg.norm(x)
    cosine = float(from_masked @ x / (np.linalg.norm(from_masked) * np.linalg.norm(x)))
    # a masked-vector 'inversion' is a random direction: |cos| ~ N(0, 1/32), and
    # P(|cos| > 0.75) ~ 2e-5 per run
    assert error > 0.5 and abs(cosine) < 0.75, (error, cosine)


# --- deep leakage from gradients -------------------------------------------------------------


def _mlp(seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Sigmoid(),
                                torch.nn.Linear(12, 3)).double()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * 0.5)
    return model


def _grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    loss = torch.nn.functional.cross_entropy(model(x[None]), y[None])
    return torch.autograd.grad(loss, list(model.parameters()), create_graph=True)


def _flatten(grads: tuple[torch.Tensor, ...]) -> np.ndarray:
    return np.concatenate([g.detach().numpy().ravel() for g in grads])


def _unflatten(vector: np.ndarray, model: torch.nn.Module) -> list[torch.Tensor]:
    out, offset = [], 0
    for param in model.parameters():
        size = param.numel()
        out.append(torch.from_numpy(vector[offset: offset + size].copy()).reshape(param.shape))
        offset += size
    return out


def deep_leakage(model: torch.nn.Module, target: list[torch.Tensor], seed: int
                 ) -> np.ndarray:
    """The attacker: iDLG label from the last bias gradient, then L-BFGS on a dummy input
    to match the observed gradient (Zhu et al. 2019)."""
    label = torch.argmin(target[-1])
    gen = torch.Generator().manual_seed(1000 + seed)
    dummy = torch.rand(16, generator=gen, dtype=torch.float64).requires_grad_(True)
    opt = torch.optim.LBFGS([dummy], lr=1, max_iter=300, history_size=50,
                            line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        guess = _grads(model, dummy, label)
        loss = sum(((a - b) ** 2).sum() for a, b in zip(guess, target, strict=True))
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        return loss

    opt.step(closure)  # type: ignore[arg-type]
    return np.asarray(dummy.detach().numpy())


@threat(attack="Deep leakage from gradients (Zhu et al. 2019)",
        adversary="curious server (plaintext vs. masked update)",
        controls="one site's update of a small MLP (16-12-3, sigmoid) trained on one record",
        protocol="plaintext: gradient matching recovers the record (MSE < 1e-4); SecAgg: "
                 "matching the decoded masked vector yields no better than a blind guess")
@pytest.mark.parametrize("seed", [0, 1])
def test_deep_leakage_works_on_plaintext_only(seed: int) -> None:
    model = _mlp(seed)
    gen = torch.Generator().manual_seed(seed + 7)
    x = torch.rand(16, generator=gen, dtype=torch.float64)
    y = torch.tensor(seed % 3)
    update = _flatten(_grads(model, x, y))
    plaintext, masked = _server_views(update, seed)
    truth = x.numpy()
    blind = float(np.mean((truth - 0.5) ** 2))  # guessing the data mean
    from_plain = deep_leakage(model, _unflatten(plaintext, model), seed)
    from_masked = deep_leakage(model, _unflatten(masked, model), seed)
    assert float(np.mean((from_plain - truth) ** 2)) < 1e-4
    mse = float(np.mean((from_masked - truth) ** 2))
    assert not np.isfinite(mse) or mse > 0.5 * blind, (mse, blind)
