"""The built-in privacy modes, :data:`dp.policy.MODES`: ``none``, ``site``, ``distributed``."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, cast

import numpy as np

from dp import (
    MODE_DISTRIBUTED,
    MODE_NONE,
    MODE_SITE,
    EncodingParams,
    PolicyRefused,
    PrivacyConfigError,
    Proposal,
)
from fl.codec import DistributedCodec, noisy_mean
from fl.input_bound import dp_bound
from fl.modes.base import (
    F64,
    U64,
    Grouping,
    ModeError,
    PrivacyMode,
    Release,
    Rows,
    SiteDpRelease,
    SumEncoding,
    Task,
    Trainer,
    cap_units,
    counted_count_stddev,
    own_share,
)

if TYPE_CHECKING:
    import torch

    from fl.vector import ParameterLayout


class NoDp(PrivacyMode):
    """``none``: the exact weighted FedAvg sum ``[n_k delta_k, n_k]`` (fixed point)."""

    name = MODE_NONE
    validated_rows = True


class SiteDp(PrivacyMode):
    """``site``: the update is DP-SGD-private at the site (Opacus) and summed uniformly
    ``[delta_k, 1]``: an exact record count is not private, so the count coordinate carries
    only the number of sites. The runtimes' setup cannot ask it (per-patient training is
    the site role's)."""

    name = MODE_SITE
    in_setup = False
    idp = True

    def update(self, trainer: Trainer, model: torch.nn.Module, layout: ParameterLayout,
               task: Task, site_id: int) -> Rows:
        adaptive = ({} if task.count_stddev is None else {
            "target_quantile": task.target_quantile, "count_stddev": task.count_stddev})
        delta = trainer.site_dp_update(
            model, layout, noise_multiplier=task.noise_multiplier, clip_norm=task.clip_norm,
            sample_rate=task.sample_rate, steps=task.steps, lr=task.lr, unit=task.unit,
            expected_batch=task.expected_batch, **adaptive,
            **({"round_number": task.round} if task.unit == "patient-idp" else {}))
        return Rows(delta, 1.0, 1)  # uniform: a site's count is not protected

    def proposal(self, task: Release, *, secagg_threshold: int, label: str,
                 idp: Grouping | None) -> Proposal:
        """DP-SGD at the site; under ``patient-idp`` the site's *own* plan's rate groups,
        each charged its own cost (refused without one)."""
        task = cast(SiteDpRelease, task)
        unit = getattr(task, "unit", "patient")
        if unit == "patient-idp":
            if idp is None:
                raise PolicyRefused("unit", "the round is computed per patient by individual "
                                    "sampling rates (patient-idp); this site is not "
                                    "configured for it (its operator's --unit)")
            return Proposal.site_idp(idp.plan, steps=task.steps,
                                     secagg_threshold=secagg_threshold, label=label,
                                     patients=idp.groups.digest())
        return Proposal.site_dp(noise_multiplier=task.noise_multiplier,
                                sample_rate=task.sample_rate, steps=task.steps,
                                clip_norm=task.clip_norm, secagg_threshold=secagg_threshold,
                                count_stddev=getattr(task, "count_stddev", None),
                                label=label, unit=unit)


class DistributedDp(PrivacyMode):
    """``distributed``: clipped rows ``[g clipped, gamma]`` through the integer encoder with
    the site's noise share (:class:`fl.codec.DistributedCodec`): per sampled unit in the
    site role, one row of the update (arrays minus those sent) per node in the runtimes."""

    name = MODE_DISTRIBUTED
    noised = True
    relative = True

    def codec(self, enc: SumEncoding) -> DistributedCodec:
        if enc.params is None:
            raise ModeError("a distributed-DP round carries its encoding parameters")
        return DistributedCodec(enc.params, max_weight=enc.max_weight)

    def encode(self, enc: SumEncoding, rows: F64, weight: float) -> U64:
        return self.codec(enc).encode(rows, weight=weight)

    def decode(self, enc: SumEncoding, total: U64, included: int) -> tuple[F64, float]:
        """Per unit (the site role): minus the noisy mean gradient over the noisy unit count
        (floored at one); per node (the runtimes): the noisy sum over ``included``, the
        number of nodes in the sum (public to the server: dividing by the noisy count, near
        zero when few nodes carry much noise, would only add error). With the noisy count."""
        codec = self.codec(enc)
        update = np.asarray(total)[:codec.encoded_dim]  # a clip count may follow it
        if enc.per_unit:
            mean_gradient, count = noisy_mean(codec, update, included)
            return -mean_gradient, count
        sums, count = codec.decode(update, included)
        return sums / max(included, 1), count

    def bound(self, enc: SumEncoding) -> tuple[int | None, int | None]:
        """The clip plus the noise share (a rotated row has no plain weight coordinate)."""
        if enc.norm_bound is None:
            return None, None
        return dp_bound(self.codec(enc).params), None

    def update(self, trainer: Trainer, model: torch.nn.Module, layout: ParameterLayout,
               task: Task, site_id: int) -> Rows:
        weight = task.weight_of(site_id)  # refused before the data is touched
        rows = cap_units(trainer.unit_gradients(model, sample_rate=task.sample_rate,
                                                unit=task.unit), task.max_units)
        return Rows(rows, weight, len(rows))

    def reply(self, arrays: F64, metrics: F64, weight: float, sent: F64 | None) -> Rows:
        if sent is None or sent.shape != arrays.shape:
            raise ModeError("a distributed-DP round needs the arrays the server sent, in "
                            "the reply's layout")
        return Rows((arrays - sent)[None, :], 1.0, 1)

    def proposal(self, task: Release, *, secagg_threshold: int, label: str,
                 idp: Grouping | None) -> Proposal:
        """One noisy secure sum (a round, or the noised feature statistics, kind scaler)."""
        return Proposal.distributed(_params(task), sample_rate=task.sample_rate,
                                    secagg_threshold=secagg_threshold, label=label,
                                    kind=getattr(task, "kind", "train"),
                                    unit=getattr(task, "unit", "patient"),
                                    count_stddev=getattr(task, "count_stddev", None))

    def lone(self, task: Release, proposal: Proposal) -> Proposal:
        """The coordinator may fill the round with sites it simulates (zero noise), so only
        this site's own share of the noise is certain: the event and noise multiplier of
        calibration threshold 1 (the policy's other rules still see the proposed
        thresholds)."""
        count = getattr(task, "count_stddev", None)
        params = _params(task)
        alone = Proposal.distributed(own_share(params), sample_rate=task.sample_rate,
                                     secagg_threshold=proposal.secagg_threshold,
                                     label=proposal.label,
                                     count_stddev=None if count is None else
                                     counted_count_stddev(count, params.threshold, 1))
        return replace(proposal, noise_multiplier=alone.noise_multiplier, event=alone.event,
                       requested_noise_multiplier=proposal.noise_multiplier)

    def released(self, params: EncodingParams | None) -> EncodingParams | None:
        """A node's whole update is one clipped row: one patient (or record) can move it
        anywhere in the clip ball, so it is charged at the replace-one sensitivity (twice
        the row's bound), not the add/remove one of the site role's per-unit rows."""
        if params is None:
            raise ModeError("a distributed-DP round carries its encoding parameters")
        return params.replace_one()


def _params(task: Release) -> EncodingParams:
    """A noised task's encoding (a task without one is malformed)."""
    if task.params is None:
        raise PrivacyConfigError("a distributed task carries its encoding (params)")
    return task.params
