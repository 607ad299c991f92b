"""Privacy audit: canary membership inference over repeated training runs (issue #6).

After Jagielski, Ullman, Oprea (NeurIPS 2020) and Nasr et al. (IEEE S&P 2021): train the
same model many times with and without a canary record, score each final model on the
canary, pick a threshold on separate calibration runs, and turn the false positive and
false negative rates of the test "canary was in" on the evaluation runs into an empirical
lower bound on epsilon:

    eps_lb = max( ln((1 - delta - FNR_hi) / FPR_hi), ln((1 - delta - FPR_hi) / FNR_hi) )

with FPR_hi, FNR_hi the one-sided Clopper-Pearson upper bounds at level alpha/2 each, so
eps_lb holds with confidence 1 - alpha. DP runs use the project's site-mode DP-SGD
(``dp.opacus_glue.SitePrivacyEngine``: Opacus per-record gradients, clipping, Gaussian
noise), accounted with Opacus' RDP accountant (``dp.accounting.gaussian_epsilon``).

Model: logistic regression in torch, 40 synthetic records in 6 features plus a 7th feature
only the canary uses (x = 10 e_7, label 1): its clipped gradient has norm exactly C in a
direction no other record touches, the strongest canary for a black-box audit, so the
weight w_7 of the final model is the score.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import pytest
from adversary import threat

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
from scipy.stats import beta  # noqa: E402

from dp.accounting import gaussian_epsilon  # noqa: E402
from dp.opacus_glue import SitePrivacyEngine  # noqa: E402

pytestmark = pytest.mark.security

FEATURES = 6
RECORDS = 40
STEPS = 4
NOISE = 4.0  # accounted epsilon ~ 2.2 at delta = 1e-5 (full-batch DP-GD, 4 steps)
CLIP = 1.0
LR = 4.0
DELTA = 1e-5
ALPHA = 0.05  # 95 % confidence
CALIBRATION = 60
EVALUATION = 140


class _Records(torch.utils.data.Dataset):  # type: ignore[misc]
    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x = torch.tensor(x, dtype=torch.float32)
        self.y = torch.tensor(y, dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2020)
    x = np.zeros((RECORDS, FEATURES + 1))
    x[:, :FEATURES] = rng.normal(size=(RECORDS, FEATURES))
    y = (x[:, 0] + 0.5 * rng.normal(size=RECORDS) > 0).astype(float)
    canary = np.zeros(FEATURES + 1)
    canary[FEATURES] = 10.0
    return x, y, canary


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(
        out.squeeze(-1), target, reduction="sum")


def train(include: bool, *, private: bool, noise: float = NOISE) -> float:
    """One training run; returns the score (the canary-only weight of the final model).
    ``noise`` different from ``NOISE`` simulates a DP bug: the engine claims NOISE."""
    x, y, canary = _data()
    if include:
        x, y = np.vstack([x, canary]), np.append(y, 1.0)
    model = torch.nn.Linear(FEATURES + 1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    if not private:
        xs, ys = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
        for _ in range(STEPS):
            opt.zero_grad()
            (_loss(model(xs), ys) / len(xs)).backward()
            opt.step()
        return float(model.weight[0, FEATURES])
    engine = SitePrivacyEngine(model, opt, _Records(x, y), loss_fn=_loss,
                               noise_multiplier=NOISE, max_grad_norm=CLIP, sample_rate=1.0,
                               unit="record", expected_batch=RECORDS)  # declared: public
    engine.optimizer.noise_multiplier = noise
    for _ in range(STEPS):
        engine.step()
    return float(engine.model.weight[0, FEATURES])


def clopper_pearson_upper(errors: int, trials: int, level: float) -> float:
    """One-sided upper confidence bound on a rate at confidence 1 - level."""
    if errors >= trials:
        return 1.0
    return float(beta.ppf(1 - level, errors + 1, trials - errors))


def _rates(ins: np.ndarray, outs: np.ndarray, tau: float) -> tuple[int, int]:
    """(false positives, false negatives) of 'in iff score > tau'."""
    return int((outs > tau).sum()), int((ins <= tau).sum())


def _eps(fp: int, fn: int, n_out: int, n_in: int, level: float) -> float:
    fpr = clopper_pearson_upper(fp, n_out, level)
    fnr = clopper_pearson_upper(fn, n_in, level)
    best = 0.0
    for a, b in ((fnr, fpr), (fpr, fnr)):
        if 1 - DELTA - a > 0 and b > 0:
            best = max(best, math.log((1 - DELTA - a) / b))
    return best


@dataclass
class Audit:
    eps_lb: float
    threshold: float
    fpr: float
    fnr: float
    runs: int

    def describe(self, accounted: float | None) -> str:
        bound = f", accounted epsilon {accounted:.2f}" if accounted is not None else ""
        return (f"empirical eps_lb {self.eps_lb:.2f} ({100 * (1 - ALPHA):.0f}% confidence, "
                f"{self.runs} runs, FPR {self.fpr:.2f}, FNR {self.fnr:.2f}){bound}")


def audit(private: bool, noise: float = NOISE) -> Audit:
    n = CALIBRATION + EVALUATION
    ins = np.array([train(True, private=private, noise=noise) for _ in range(n)])
    outs = np.array([train(False, private=private, noise=noise) for _ in range(n)])
    cal_in, cal_out = ins[:CALIBRATION], outs[:CALIBRATION]
    ev_in, ev_out = ins[CALIBRATION:], outs[CALIBRATION:]
    candidates = np.unique(np.concatenate([cal_in, cal_out]))
    # the threshold is chosen on calibration runs only (point estimates), so the
    # confidence statement on the evaluation runs needs no multiple-testing correction
    tau = float(max(candidates, key=lambda c: _eps(*_rates(cal_in, cal_out, c), CALIBRATION,
                                                    CALIBRATION, 0.5)))
    fp, fn = _rates(ev_in, ev_out, tau)
    return Audit(_eps(fp, fn, EVALUATION, EVALUATION, ALPHA / 2), tau, fp / EVALUATION,
                 fn / EVALUATION, 2 * n)


@pytest.fixture(autouse=True)
def _quiet_opacus() -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.set_num_threads(1)
        yield


@threat(attack="Membership inference audit, non-private training",
        adversary="anyone who sees the released model",
        controls="the final model of each of 400 training runs (200 with the canary)",
        protocol="nothing: without DP the canary's presence is visible; the audit's "
                 "empirical epsilon lower bound shows the leak", shows="leak")
def test_audit_shows_the_leak_of_non_private_training(request: pytest.FixtureRequest) -> None:
    result = audit(private=False)
    request.node.user_properties.append(("threat.result", result.describe(None)))
    assert result.eps_lb > 3.0, result


@threat(attack="Membership inference audit, DP-SGD (site mode)",
        adversary="anyone who sees the released model",
        controls="the final model of each of 400 DP-SGD runs (200 with the canary)",
        protocol="dp.opacus_glue.SitePrivacyEngine: clip to C, Gaussian noise z*C per step, "
                 "Opacus RDP accounting; the empirical lower bound must stay below the "
                 "accounted epsilon")
def test_audit_of_dp_sgd_stays_below_the_accounted_epsilon(
        request: pytest.FixtureRequest) -> None:
    accounted = gaussian_epsilon(NOISE, 1.0, STEPS, DELTA)
    result = audit(private=True)
    request.node.user_properties.append(("threat.result", result.describe(accounted)))
    assert 1.5 < accounted < 3.0  # the audit can certify up to about 3.6 with these runs
    assert result.eps_lb <= accounted, result


@threat(attack="Membership inference audit, DP-SGD (site mode)",
        adversary="anyone who sees the released model",
        controls="the same audit against an engine that adds 10x too little noise while "
                 "accounting for the claimed noise",
        protocol="the audit must catch it: the lower bound exceeds the accounted epsilon "
                 "(shows the previous test can fail)", shows="leak")
def test_audit_catches_an_engine_that_adds_too_little_noise(
        request: pytest.FixtureRequest) -> None:
    accounted = gaussian_epsilon(NOISE, 1.0, STEPS, DELTA)
    result = audit(private=True, noise=NOISE / 10)
    request.node.user_properties.append(("threat.result", result.describe(accounted)))
    assert result.eps_lb > accounted, result
