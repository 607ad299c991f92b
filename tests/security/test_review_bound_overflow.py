"""Review regression (input validation): a finite ``norm_bound`` whose fixed-point form
overflows (``norm_bound * 2**frac_bits`` is infinite) is a typed :class:`SetupError` on the
site (a malicious server's setup) and on the server (its own argument: the round is not run),
never an ``OverflowError`` out of the runtime."""

from __future__ import annotations

from dataclasses import replace

import pytest
from adversary import threat

from fl.round_plan import fixed_setup, with_norm_bound
from fl.round_setup import RoundSetup, SetupError
from fl.vector import ArraySpec


def _setup() -> RoundSetup:
    return fixed_setup(run_id=1, server_round=1, roster=[1, 2, 3],
                       arrays=(ArraySpec("w", (4,), "float32"),), metrics=(),
                       weight_key="n", neighbors=None, threshold=None, dropout_rate=0.0,
                       corrupt_rate=0.0, security="semi-honest", bits=64, frac_bits=24,
                       verify_keys={})


@threat(attack="A norm bound too large for the encoding",
        adversary="malicious server",
        controls="the round setup's norm_bound (1e302, finite, at 24 fractional bits)",
        protocol="fixed_bound refuses a bound with no finite integer form: a typed SetupError on "
                 "the site, no OverflowError")
def test_an_overflowing_bound_from_the_server_is_a_setup_error_on_the_site() -> None:
    raw = replace(_setup(), norm_bound=1e302).to_bytes()
    parsed = RoundSetup.from_bytes(raw)  # a finite number: the wire accepts it
    with pytest.raises(SetupError, match="overflows"):
        parsed.config(5)


@threat(attack="A norm bound too large for the encoding",
        adversary="malicious server",
        controls="SecureAggregation(norm_bound=1e302)",
        protocol="input_bound raises SetupError before any round starts")
def test_an_overflowing_bound_on_the_server_is_a_setup_error() -> None:
    with pytest.raises(SetupError, match="overflows"):
        with_norm_bound(_setup(), 1e302)
