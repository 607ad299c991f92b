"""Privacy modes as objects (fl/modes.py, issue 33): a new mode is one class and
:func:`fl.modes.register`, and both round descriptions -- the site role's
:class:`fl.contribution.RoundTask` and the runtimes' :class:`fl.round_setup.RoundSetup` --
carry it through their codec, the site session's gate, the encode and the decode; the
distributed-DP encoding goes through one reader and one writer on both wires."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from dp import MODES, EncodingParams
from fl.contribution import RoundTask, TaskError, decoder, site_input
from fl.modes import (
    BUILT_IN,
    ENCODING_KEYS,
    NoDp,
    PrivacyMode,
    Rows,
    Task,
    Trainer,
    mode_names,
    privacy_mode,
    register,
    unregister,
)
from fl.round_reply import decode_sum
from fl.round_setup import RoundSetup, SetupError, encoded_dim
from fl.site.session import SiteSession
from fl.vector import ParameterLayout
from tests.fl.site_cores import site_core
from tests.fl.test_input_bound import DIM, _dp, _fixed
from transport import fields

UNIFORM = "test-uniform"


class Uniform(PrivacyMode):
    """A test-only mode: an exact sum in which every site counts once, whatever its
    records or the weight its reply states (the mean over the sites in the sum)."""

    name = UNIFORM

    def update(self, trainer: Trainer, model: torch.nn.Module, layout: ParameterLayout,
               task: Task, site_id: int) -> Rows:
        return Rows(NoDp().update(trainer, model, layout, task, site_id).rows, 1.0, 1)

    def reply(self, arrays: np.ndarray, metrics: np.ndarray, weight: float,
              sent: np.ndarray | None) -> Rows:
        return Rows(NoDp().reply(arrays, metrics, 1.0, sent).rows, 1.0, 1)


@pytest.fixture
def uniform() -> Iterator[PrivacyMode]:
    mode = register(Uniform())
    try:
        yield mode
    finally:
        unregister(UNIFORM)


class Records:
    """A site whose FedAvg update is ``delta`` (its ``num_records`` would weight it)."""

    def __init__(self, delta: np.ndarray, num_records: int) -> None:
        self.delta = delta
        self.num_records = num_records

    def fedavg_update(self, model: object, layout: object, **kwargs: object) -> np.ndarray:
        return self.delta.copy()


def _sum(vectors: list[np.ndarray]) -> np.ndarray:
    total = np.zeros_like(vectors[0], dtype=np.uint64)
    for vector in vectors:
        total += vector.astype(np.uint64)  # mod 2**64
    return total


def test_the_built_in_modes_are_the_vocabulary_and_a_name_is_registered_once() -> None:
    assert BUILT_IN == MODES and mode_names() == MODES
    assert mode_names(in_setup=True) == ("none", "distributed")
    with pytest.raises(ValueError, match="already registered"):
        register(NoDp())  # a second object under a taken name
    with pytest.raises(ValueError, match="built in"):
        unregister("none")
    with pytest.raises(TaskError, match="privacy mode 'nope'"):
        privacy_mode("nope", TaskError)


def test_a_new_mode_is_one_object_through_the_site_roles_task(uniform: PrivacyMode) -> None:
    model = torch.nn.Linear(3, 1)
    dim = ParameterLayout.of(model).size
    task = RoundTask(mode=UNIFORM, round=2, cohort=3, seed=5)
    assert RoundTask.from_wire(task.to_wire(), dim) == task  # the task's codec carries it
    rng = np.random.default_rng(1)
    deltas = [rng.normal(size=dim) for _ in range(3)]
    given = [site_input(Records(delta, records), model, task, site)
             for site, (delta, records) in enumerate(zip(deltas, (1, 10, 1000), strict=True), 1)]
    assert [c.count for c in given] == [1, 1, 1]
    mean, count = decoder(task, dim)(_sum([c.vector for c in given]), 3)
    assert count == 3  # every site once: the plain mean, not the record-weighted one
    np.testing.assert_allclose(mean, np.mean(deltas, axis=0), atol=1e-6)
    unregister(UNIFORM)
    with pytest.raises(TaskError, match="mode"):  # unknown again once forgotten
        RoundTask.from_wire(task.to_wire(), dim)


def test_a_new_mode_is_one_object_through_the_setup_and_the_site_session(
        uniform: PrivacyMode) -> None:
    setup = replace(_fixed(), mode=UNIFORM)
    raw = setup.to_bytes()
    assert RoundSetup.from_bytes(raw) == setup  # the setup's codec carries it
    rng = np.random.default_rng(2)
    sent = np.zeros(DIM)
    replies = [rng.normal(size=DIM) for _ in setup.roster]
    vectors = []
    weights = (1.0, 5.0, 50.0, 500.0)  # stated, and ignored by the mode
    for node, arrays, weight in zip(setup.roster, replies, weights, strict=True):
        core = site_core()
        session = SiteSession(core=core, runtime="test")
        joined = session.join(raw, run_id=setup.run_id, node_id=node, sent=lambda s: sent)
        assert joined.sent is None  # an exact sum does not encode relative to the sent
        charge = core.ledger.get(joined.charge)
        assert charge is not None and charge.event is None  # the mode's proposal: exact
        vector = session.encode(joined, arrays, {}, weight)
        assert vector.size == encoded_dim(setup) == joined.config.dim
        vectors.append(vector)
    mean, metrics, weight = decode_sum(setup, _sum(vectors), len(vectors), sent)
    assert weight == len(vectors) and metrics == {}
    np.testing.assert_allclose(mean, np.mean(replies, axis=0), atol=1e-4)
    unregister(UNIFORM)
    with pytest.raises(SetupError, match=r"privacy mode 'test-uniform': a round setup runs "
                                         r"one of \('none', 'distributed'\)"):
        RoundSetup.from_bytes(raw)


def test_a_task_only_mode_is_refused_by_a_setup(uniform: PrivacyMode) -> None:
    """A mode whose update needs the site role's training (site DP) says so (in_setup)."""
    site_only = type("SiteOnly", (Uniform,), {"name": "test-site-only", "in_setup": False})
    register(site_only())
    try:
        with pytest.raises(SetupError, match="privacy mode 'test-site-only'"):
            RoundSetup.from_bytes(replace(_fixed(), mode="test-site-only").to_bytes())
    finally:
        unregister("test-site-only")


def _unpack(raw: bytes) -> dict[str, object]:
    return fields.unpack_map(raw, 1 << 22, error=SetupError, max_array_len=fields.MAX_ROSTER,
                             max_str_len=1 << 12, what="the round setup")


def test_one_encoding_codec_reads_both_descriptions_the_same() -> None:
    setup = _dp()
    body = _unpack(setup.to_bytes())
    assert setup.dp is not None
    spec = setup.dp  # the setup's wire list is the encoding's fields in their order
    assert body["dp"] == [getattr(spec, key) for key in ENCODING_KEYS] == [
        spec.clip_norm, spec.scale, spec.bits, spec.noise_stddev, spec.rotation_seed,
        spec.mechanism, spec.beta, spec.threshold]
    params = spec.params(DIM + 1)
    task = RoundTask(mode="distributed", round=1, cohort=4, seed=0, params=params,
                     max_units=10)
    assert RoundTask.from_wire(task.to_wire(), DIM).params == params
    # the same bad field is refused by both, each with its own error
    for key, bad in (("beta", 1.0), ("mechanism", "laplace"), ("threshold", 0),
                     ("scale", -1.0)):
        index = ENCODING_KEYS.index(key)
        wire = list(body["dp"])  # type: ignore[call-overload]
        wire[index] = bad
        with pytest.raises(SetupError, match=key):
            RoundSetup.from_bytes(fields.pack_map({**body, "dp": wire}))
        with pytest.raises(TaskError, match=key):
            RoundTask.from_wire({**task.to_wire(), "params": {
                **task.to_wire()["params"], key: bad}}, DIM)
    with pytest.raises(TaskError, match="dim"):  # the task's dimension is checked too
        RoundTask.from_wire({**task.to_wire(), "params": {
            **task.to_wire()["params"], "dim": DIM}}, DIM)


def test_both_wires_keep_the_bytes_of_before_the_modes() -> None:
    """Byte compatibility (no version bump): the setup's canonical bytes (its secagg
    context) and the task's wire map are those of wire version 2 before the modes and the
    one encoding codec (digests taken at main 29d9d31 with the same constructors)."""
    digests = {"none": "528021ff5845d54a2de9b2b8062f06c7e35fd3174e6ef088104efd8715aff1fe",
               "distributed": "a32dca6bc18457e1aac7af0c7ec46c65fb3ce12c8eeaa682b8f8a32b255ad806"}
    for setup in (_fixed(), _dp()):
        raw = replace(setup, nonce=bytes(range(32))).to_bytes()
        assert hashlib.sha256(raw).hexdigest() == digests[setup.mode]
    params = EncodingParams(dim=5, clip_norm=1.0, scale=64.0, bits=40, noise_stddev=1.0,
                            rotation_seed=1, threshold=2)
    task = RoundTask(mode="distributed", round=1, cohort=3, seed=0, params=params,
                     max_units=10)
    assert hashlib.sha256(json.dumps(task.to_wire()).encode()).hexdigest() == (
        "ea79246b7c8cc64022c660e13deab4cf53906044c5cb69acbb94d20a5dcad41f")
