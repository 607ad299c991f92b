"""The rule "every parameter is public", as a property (docs/privacy.md, "Every parameter
and its source"): for every DP mode, two neighbouring datasets (one patient added, with 1 to
K records, chosen by hypothesis around the rounding boundaries: round(q N), the record
classes' edges and the cut) give identical mechanism parameters.

On main this fails for site mode (the normaliser round(q N)) and patient-idp (the plan's
noise and rates from the group sizes)."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")

from dp.idp import IdpClasses, group_patients, plan_idp  # noqa: E402
from dp.opacus_glue import SitePrivacyEngine  # noqa: E402
from fl.settings import TrainSettings  # noqa: E402

SLOW = settings(max_examples=6, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def _engine_parameters(patients: int, q: float, **options: Any) -> tuple[Any, ...]:
    """What the site's DP-SGD step uses: noise multiplier, clip, rate, and what Opacus
    divides the noised sum by (1 for a sum)."""
    ids = [i // 2 for i in range(2 * patients)]
    model = torch.nn.Linear(3, 2)
    engine = SitePrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               torch.utils.data.TensorDataset(
                                   torch.zeros(len(ids), 3),
                                   torch.zeros(len(ids), dtype=torch.long)),
                               loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"),
                               noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=q,
                               patient_ids=ids, **options)
    opt = engine.optimizer
    divisor = opt.expected_batch_size if opt.loss_reduction == "mean" else 1
    out = (opt.noise_multiplier, opt.max_grad_norm, engine.sample_rate, divisor,
           engine.round_event(5))
    engine.module._close()
    return out


def _boundary(q: float, n: int) -> int:
    """The patient count nearest ``n`` at which round(q N) steps up (a rounding boundary)."""
    return max(1, round((round(q * n) + 0.5) / q))


@SLOW
@given(q=st.sampled_from([0.05, 0.1, 0.2, 0.3]), n=st.integers(5, 300),
       declared=st.sampled_from([None, 7.0]))
def test_site_mode(q: float, n: int, declared: float | None) -> None:
    n = _boundary(q, n)
    assert _engine_parameters(n, q, expected_batch=declared) == \
        _engine_parameters(n + 1, q, expected_batch=declared)


@SLOW
@given(q=st.sampled_from([0.1, 0.2]), n=st.integers(5, 200))
def test_adaptive_clipping_in_site_mode(q: float, n: int) -> None:
    n = _boundary(q, n)
    options = {"target_quantile": 0.5, "count_stddev": 2.0, "expected_batch": 10.0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert _engine_parameters(n, q, **options) == _engine_parameters(n + 1, q, **options)


def _idp_parameters(ids: list[int], budgets: list[float], classes: IdpClasses) -> Any:
    plan = plan_idp(group_patients(ids, budgets, classes=classes), delta=1e-5,
                    sample_rate=0.1, steps=20)
    return (plan.noise_multiplier, plan.weights,
            [(g.records, g.target_epsilon, g.sample_rate, g.clip_norm) for g in plan.groups])


@SLOW
@given(base=st.lists(st.integers(1, 6), min_size=3, max_size=30),
       extra=st.integers(1, 8), budget=st.sampled_from([0.5, 1.0, 2.0, 2.5, 4.0]))
def test_patient_idp(base: list[int], extra: int, budget: float) -> None:
    """Declared cut 5 (classes 1..5) and targets (1, 2): the added patient has up to 8
    records (over the cut) and any budget (between classes, below them)."""
    classes = IdpClasses(max_records=5, targets=(1.0, 2.0))
    ids = [p for p, k in enumerate(base) for _ in range(k)]
    budgets = [2.0 if p % 2 else 1.0 for p, k in enumerate(base) for _ in range(k)]
    assert _idp_parameters(ids, budgets, classes) == _idp_parameters(
        ids + [-1] * extra, budgets + [budget] * extra, classes)


def _csv(path: Path, records: list[int]) -> Path:
    rng = np.random.default_rng(0)
    lines = ["pid,a,b,c,label"]
    for p, k in enumerate(records):
        for _ in range(k):
            a, b, c = rng.uniform(0, 1, size=3)
            lines.append(f"P{p},{a:.4f},{b:.4f},{c:.4f},{'yes' if a + b > 1 else 'no'}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


#: Fields of ``secagg train --plan`` that are not mechanism parameters: the operator's
#: delta warning (it names the patient count on purpose, to the operator only).
NOT_PARAMETERS = ("warnings",)


def _run_plan(records: list[int], **options: Any) -> dict[str, Any]:
    from fl.federation import privacy_plan

    with tempfile.TemporaryDirectory() as tmp:
        bounds = Path(tmp) / "bounds.json"
        bounds.write_text('{"low": [0, 0, 0], "high": [1, 1, 1]}', encoding="utf-8")
        s = TrainSettings(sites=3, rounds=3, csv=str(_csv(Path(tmp) / "t.csv", records)),
                          patient_column="pid", label_column="label", epsilon=4.0,
                          feature_bounds=str(bounds), **options)
        out = privacy_plan(s)
    return {k: v for k, v in out.items() if k not in NOT_PARAMETERS}


_RDP: dict[tuple[Any, ...], Any] = {}


@contextmanager
def _rdp_once() -> Iterator[None]:
    """Opacus' ``compute_rdp`` computed once per question (and a copy of its answer handed
    out). It is a pure function of its arguments, so a plan whose parameters are public asks
    the same questions with one more patient and gets the same answers, while a plan that
    read the data would ask others (computed afresh): the comparison is as strong, and the
    second plan of each pair costs no accounting (site mode's noise search asks 17, about
    2 s each)."""
    from opacus.accountants.analysis import rdp

    compute = rdp.compute_rdp

    def once(q: float, noise_multiplier: float, steps: int, orders: Any) -> Any:
        key = (q, noise_multiplier, steps,
               tuple(orders) if isinstance(orders, (list, tuple, np.ndarray)) else orders)
        if key not in _RDP:
            _RDP[key] = compute(q=q, noise_multiplier=noise_multiplier, steps=steps,
                                orders=orders)
        value = _RDP[key]
        return value.copy() if isinstance(value, np.ndarray) else value

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rdp, "compute_rdp", once)
        yield


@SLOW
@given(records=st.lists(st.integers(1, 4), min_size=30, max_size=80), extra=st.integers(1, 6),
       mode=st.sampled_from([{"dp": "distributed", "sample_rate": 0.2},
                             {"dp": "distributed", "sample_rate": 0.2, "adaptive_clip": 0.5},
                             {"dp": "site", "sample_rate": 0.2},
                             {"dp": "site", "sample_rate": 0.2, "adaptive_clip": 0.5,
                              "expected_batch": 5.0}]))
def test_the_run_plan_with_the_noised_scaler(records: list[int], extra: int,
                                             mode: dict[str, Any]) -> None:
    """The whole run's plan (what `secagg train --plan` prints and the run follows):
    distributed (bits, noise, rates), adaptive clipping, site mode, and the noised feature
    statistics (the default with --feature-bounds) are the same with one more patient."""
    with _rdp_once():
        assert _run_plan(records, **mode) == _run_plan([*records, extra], **mode)


def test_the_site_weights_release_plan_reads_no_data() -> None:
    """The site weights' release (noise, cells) is planned from the settings alone: its
    planner takes no data argument, so no neighbouring pair can move it."""
    import inspect

    from fl.plan import weights as site_weights

    assert list(inspect.signature(site_weights.release_plan).parameters) == ["settings"]
