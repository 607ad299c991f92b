"""Private adaptive clipping (Andrew et al. 2021) through an emulated secure sum."""

from __future__ import annotations

import numpy as np

from dp.adaptive_clip import QuantileClipper
from dp.randomness import SeededRandom


def test_clip_tracks_the_target_quantile_from_noisy_secure_counts() -> None:
    rng = np.random.default_rng(0)  # the data, not the noise
    sites = [rng.lognormal(mean=0.0, sigma=0.5, size=200) for _ in range(5)]
    true_median = float(np.median(np.concatenate(sites)))
    clipper = QuantileClipper(clip_norm=10.0, target_quantile=0.5, learning_rate=0.3,
                              count_stddev=20.0, expected_units=1000, threshold=4)
    source = SeededRandom(1)
    for _ in range(60):
        shares = [clipper.site_share(norms, source) for norms in sites]
        total = np.sum(shares, axis=0) % np.uint64(1 << clipper.bits)
        clipper.update(total, num_included=5)
    assert abs(clipper.clip_norm - true_median) < 0.25 * true_median
    centred = 2 * int(np.sum(sites[0] <= clipper.clip_norm)) - sites[0].size
    half = 1 << (clipper.bits - 1)
    shares = [(int(clipper.site_share(sites[0], source)[0]) + half) % (2 * half) - half
              for _ in range(50)]
    assert len(set(shares)) > 5  # each share carries fresh noise, not the bare count
    per_site = np.sqrt(clipper.per_site_variance)
    assert abs(np.mean(shares) - centred) < 5 * per_site / np.sqrt(50) + 1
