"""One privacy-mode vocabulary for a round (issue 33, "a round is described twice"): the site
role's task (:class:`fl.contribution.RoundTask`) and the runtimes' round setup
(:class:`fl.round_setup.RoundSetup`) name a release's privacy mode with the words of
:data:`dp.policy.MODES` (``--dp``, site policies), on the wire too; a setup in the old words
(``fixed``/``ddp``, version 1) is refused with what to change."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dp import MODE_DISTRIBUTED, MODE_NONE, MODES, EncodingParams
from fl.contribution import RoundTask, TaskError
from fl.round_setup import SETUP_MODES, VERSION, RoundSetup, SetupError
from tests.fl.test_input_bound import _dp, _fixed
from transport import fields


def _wire(setup: RoundSetup, **changes: object) -> bytes:
    body = fields.unpack_map(setup.to_bytes(), 1 << 22, error=SetupError,
                             max_array_len=fields.MAX_ROSTER, max_str_len=1 << 12,
                             what="the round setup")
    body.update(changes)
    return fields.pack_map(body)


def test_a_round_setup_and_a_round_task_name_each_mode_with_the_same_word() -> None:
    assert set(SETUP_MODES) == {MODE_NONE, MODE_DISTRIBUTED} and set(SETUP_MODES) <= set(MODES)
    exact, noised = _fixed(), _dp()
    assert (exact.mode, noised.mode) == ("none", "distributed")  # what --dp says
    for setup in (exact, noised):  # the word on the wire, read back
        raw = setup.to_bytes()
        assert fields.unpack_map(raw, 1 << 22, error=SetupError,
                                 max_array_len=fields.MAX_ROSTER, max_str_len=1 << 12,
                                 what="the round setup")["mode"] == setup.mode
        assert RoundSetup.from_bytes(raw).mode == setup.mode
    params = EncodingParams(dim=5, clip_norm=1.0, scale=64.0, bits=40, noise_stddev=1.0,
                            rotation_seed=1, threshold=2)
    tasks = {MODE_NONE: RoundTask(mode=MODE_NONE, round=1, cohort=3, seed=0),
             MODE_DISTRIBUTED: RoundTask(mode=MODE_DISTRIBUTED, round=1, cohort=3, seed=0,
                                         params=params, max_units=10)}
    for mode in SETUP_MODES:  # every mode a setup runs is one a task runs, by the same name
        assert RoundTask.from_wire(tasks[mode].to_wire(), 4).mode == mode


@pytest.mark.parametrize("old", ["fixed", "ddp"])
def test_the_old_words_are_refused_by_both_descriptions(old: str) -> None:
    with pytest.raises(SetupError, match=r"privacy mode '\w+': a round setup runs one of "
                                         r"\('none', 'distributed'\)"):
        RoundSetup.from_bytes(_wire(_fixed(), mode=old))
    task = RoundTask(mode=MODE_NONE, round=1, cohort=3, seed=0).to_wire()
    with pytest.raises(TaskError, match="mode"):
        RoundTask.from_wire({**task, "mode": old}, 4)


def test_site_dp_is_a_task_mode_a_setup_refuses() -> None:
    """Site DP needs the site role's per-patient training: a runtime's setup cannot ask it."""
    with pytest.raises(SetupError, match="privacy mode 'site'"):
        RoundSetup.from_bytes(_wire(_fixed(), mode="site"))


def test_a_version_1_setup_is_refused_with_the_upgrade() -> None:
    assert VERSION == 2
    body = _wire(replace(_fixed(), mode=MODE_NONE), v=1)
    with pytest.raises(SetupError, match="upgrade secagg on the older side"):
        RoundSetup.from_bytes(body)
