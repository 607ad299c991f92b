"""Review PoC (no data-dependent participation after the privacy gate, site role, ``--dp
site``): docs/privacy.md section 1, "After the privacy gate", says a site's participation
then depends only on public inputs, "a unit whose update has a NaN or an infinity
contributes a zero row". That holds for ``--dp distributed`` (dp/encoding.py
``integer_units``) but not for ``--dp site``: Opacus' per-patient gradients are clipped and
noised as they are, one patient's infinity makes the whole DP-SGD update non-finite, and
:func:`fl.contribution.site_input` encodes it with the fixed-point codec, which raises
``EncodingOverflow``; fl/remote/site.py ``_take_part`` declines the round with that reason,
after the charge.

A malicious coordinator sends a logistic regression whose weight on feature 0 is
``3e38 / c``: a patient's logit overflows float32 exactly when its ``|x_0|`` is above about
``c``. With the site's default policy (site mode allowed, sample rate up to 1) the site joins
when ``c`` is twice its patients' maximum and declines when it is half of it: bisecting
``c`` reads the maximum of a feature over the site's patients, one round per bit, a
deterministic function of one patient that no round's noise covers (the ledger charges each
round's DP-SGD only).

Fixed (dp/units.py ``per_unit_gradients``, the per-patient gradients every mode's DP-SGD
and distributed DP's rows come from): a patient whose gradient has a NaN or an infinity
contributes a zero row before clipping, by the rule distributed DP applies to its rows
(dp/encoding.py ``finite_units``, one function): a function of that patient alone, so the
sensitivity is unchanged, the update stays finite and the site takes part whatever its
records.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from adversary import threat

torch = pytest.importorskip("torch")

from dp.policy import SitePolicy  # noqa: E402
from fl.codec import EncodingOverflow  # noqa: E402
from fl.contribution import RoundTask, TaskError  # noqa: E402
from fl.models import make_model  # noqa: E402
from fl.remote.blob import Blob  # noqa: E402
from fl.remote.inputs import demo_site_data, site_round  # noqa: E402
from fl.remote.messages import Announce, WireError  # noqa: E402
from fl.remote.site import SiteOptions, SiteProcess  # noqa: E402
from fl.vector import ParameterLayout  # noqa: E402
from tests.fl.site_cores import site_core  # noqa: E402
from tests.fl.test_site_session import SETTINGS  # noqa: E402
from transport.memory import MemoryNetwork  # noqa: E402

DECLINED = (WireError, TaskError, EncodingOverflow)
"""What fl/remote/site.py ``_take_part`` answers with a Decline naming the reason."""


def _outcome(c: float) -> str:
    """Site 1 (default policy) on a site-mode round whose model overflows on |x_0| > ~c."""
    data = demo_site_data(SETTINGS, 1, (1, 2, 3))
    schema = {"features": list(data.schema.features), "labels": list(data.schema.labels),
              "model": "logreg"}
    model = make_model("logreg", len(schema["features"]), len(schema["labels"]))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        next(model.parameters())[0, 0] = 3.0e38 / c
    vector = ParameterLayout.of(model).to_vector(model)
    task = RoundTask(mode="site", round=1, cohort=3, seed=0, sample_rate=1.0,
                     noise_multiplier=2.0, clip_norm=1.0, steps=1, lr=0.1)
    blob = Blob.decode(Blob("train", {**schema, **task.to_wire()}, vector).encode())
    ann = Announce(os.urandom(16), 1, 0, "train", "r1", (1, 2, 3), bytes(32), 1,
                   threshold=2)
    guard = site_core(SitePolicy())
    site = SiteProcess(data, MemoryNetwork(), SiteOptions(federation="fed", guard=guard),
                       lambda text: None)
    try:
        site_round(data, blob, ann, require_dp=None, session=site.session)
    except DECLINED as exc:
        assert len(guard.ledger.charges) == 1  # declined after the gate: charged
        return f"declined: {type(exc).__name__}"
    return "joined"


@threat(attack="Feature maximum read from site-mode declines",
        adversary="malicious server",
        controls="a model whose logit overflows float32 above a chosen |x_0|, in --dp site "
                 "rounds the default policy accepts",
        protocol="a non-finite patient gradient contributes a zero row; the site takes part "
                 "whatever its records")
def test_site_mode_participation_does_not_reveal_a_features_maximum() -> None:
    data = demo_site_data(SETTINGS, 1, (1, 2, 3))
    top = float(np.abs(data.table(data.schema.labels).x[:, 0]).max())
    above, below = _outcome(2 * top), _outcome(top / 2)
    assert above == below == "joined", (
        f"threshold 2 x max: {above}; threshold max / 2: {below} -- the site's answer tells "
        "the coordinator where its maximum lies")
