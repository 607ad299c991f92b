"""A site's reply to a round setup and what it releases, on both sides of the runtimes that
send a :class:`fl.round_setup.RoundSetup` (Flower, NVFlare): the encoding of a site's trained
arrays to its secagg vector and of the sum back (:func:`encode_reply`, :func:`decode_sum`),
what a round releases and charges each node (:func:`round_release`, :func:`charged_params`,
:func:`charged_event`, :func:`inputs_requested`, :func:`whose_noise`) and the identity checks
of a malicious-mode setup (:func:`check_identity`)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import numpy.typing as npt

from dp import EncodingParams, Event, SitePolicy
from fl.errors import FLError
from fl.modes import ModeError, own_share
from fl.round_setup import RoundSetup, SetupError, dp_params, validate_fixed
from fl.site.core import SecureSum, charged_proposal
from secagg import Stage

F64 = npt.NDArray[np.float64]
U64 = npt.NDArray[np.uint64]


class ReplyError(FLError, ValueError):
    """The user's train reply does not match the round's layout; the message says how."""


def encode_reply(setup: RoundSetup, arrays: F64, metrics: dict[str, float], weight: float,
                 sent: F64 | None) -> U64:
    """A node's secagg input: its mode's row of the reply (:meth:`fl.modes.PrivacyMode.reply`;
    ``sent``: the flattened arrays the server sent, for a mode that encodes the update
    relative to them), encoded (:meth:`fl.modes.PrivacyMode.encode`)."""
    privacy = setup.privacy
    values = np.asarray([metrics[name] for name in setup.metrics], dtype=np.float64)
    try:
        rows = privacy.reply(arrays, values, weight, sent)
    except ModeError as exc:
        raise ReplyError(str(exc)) from None
    encoding = setup.encoding()
    try:
        return privacy.encode(encoding, rows.rows, rows.weight)
    except ValueError as exc:
        raise ReplyError(str(exc)) from None


def decode_sum(setup: RoundSetup, total: U64, included: int, sent: F64
               ) -> tuple[F64, dict[str, float], float]:
    """The aggregate arrays (flat), averaged metrics and the summed weight of a round.

    Mode ``none``: the weighted averages and ``sum w``. ``distributed``: ``sent`` plus the
    noisy sum of clipped updates over ``included``, the number of nodes in the sum (each
    adds one row: the server knows that number, so dividing by the row's noisy count, which
    can be near zero when few nodes carry much noise, would only add error), and the noisy
    count (floored at one)."""
    privacy = setup.privacy
    try:
        averages, weight = privacy.decode(setup.encoding(), total, included)
    except ValueError as exc:
        raise ReplyError(str(exc)) from None
    d = setup.model_dim
    metrics = {name: float(averages[d + i]) for i, name in enumerate(setup.metrics)}
    if privacy.relative:  # the mean update, added to what was sent; a noisy count >= 1
        return sent + averages[:d], metrics, max(weight, 1.0)
    return averages[:d], metrics, weight


def round_release(setup: RoundSetup) -> Callable[[SitePolicy], SecureSum]:
    """What a round releases, as the site core charges it (given the node's policy): an
    exact sum, or one distributed-DP sum of the node's clipped update. The node charges it
    at sample rate 1: the server picks the roster, so the node cannot count on being
    sampled (the NVFlare site likewise, :mod:`fl.nvflare.client`). The update is clipped as
    a whole, which bounds every patient's and every record's influence by the replace-one
    sensitivity (twice the clip): the release is per the policy's unit (patient or record),
    charged at that sensitivity."""
    validate_fixed(setup)
    # the node's whole update is one clipped row: a noised mode charges it at the
    # replace-one sensitivity (twice the row's bound, fl.modes.PrivacyMode.released)
    charged = setup.privacy.released(None if setup.dp is None else dp_params(setup))

    def release(policy: SitePolicy) -> SecureSum:
        unit = policy.unit if policy.unit in ("patient", "record") else "patient"
        return SecureSum(params=charged, sample_rate=1.0, unit=unit)

    return release


def charged_params(params: EncodingParams, security: str) -> EncodingParams:
    """The encoding ``params`` as a node's ledger charges a round that carries it: the
    replace-one sensitivity of its one row (:func:`round_release`) and, unless the roster is
    authenticated (``security="malicious"``, every key enrolled), its own noise share only
    (:func:`fl.modes.own_share`). What a server plans its noise for
    (:func:`fl.round_plan.round_plan`), so the epsilon it reports is each node's."""
    one_row = params.replace_one()
    return one_row if security == "malicious" else own_share(one_row)


def charged_event(setup: RoundSetup) -> Event | None:
    """The budget event each node's ledger records for ``setup``'s round, computed as the
    node computes it (:func:`fl.site.core.charged_proposal` of :func:`round_release`); None
    for an exact sum."""
    return charged_proposal(round_release(setup)(SitePolicy()),
                            secagg_threshold=setup.threshold,
                            authenticated=setup.security == "malicious").event


def inputs_requested(stages: Collection[str]) -> bool:
    """Whether a round's masked inputs may have left the nodes: the server sent the
    masked-input request (``stages``: the labels of the stages the server ran). From then on
    a node keeps the round's charge whether or not the round is released (the withdrawal
    rule, :mod:`fl.site.session`), so the server spends :func:`charged_event` for it too."""
    return Stage.MASKED_INPUT.label in stages


def whose_noise(setup: RoundSetup) -> str:
    """Whose noise a node counts in ``setup``'s round (for a server's report of the nodes'
    epsilon)."""
    return ("the enrolled nodes' noise counted" if setup.security == "malicious"
            else "its own noise share only: the roster is the server's word")


def check_identity(setup: RoundSetup, client_id: int, signing_key: Any,
                   trusted_keys: frozenset[bytes]) -> dict[str, Any]:
    """A malicious-mode setup must give this site its own verify key and only enrolled
    keys (:class:`SetupError` otherwise); the keyword arguments ``secagg.Client`` needs for
    the round's security mode."""
    if setup.security != "malicious":
        return {}
    if signing_key is None:
        raise SetupError("a malicious-mode round needs this site's signing key")
    if setup.verify_keys[client_id - 1] != signing_key.public:
        raise SetupError("the setup gives this site a verify key that is not its own")
    strangers = [i + 1 for i, key in enumerate(setup.verify_keys) if key not in trusted_keys]
    if strangers:
        raise SetupError(f"the setup names verify keys that are not enrolled (roster "
                         f"positions {strangers[:10]}); refused")
    return {"signing_key": signing_key, "verify_keys": setup.peer_keys()}
