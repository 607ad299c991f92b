"""Privacy-layer measurements: sampler throughput, accounting cross-check, privacy/utility.

    python benchmarks/bench_dp.py [--json] [--quick]

1. Exact samplers at d = 10^5 (one site, one round) against the os.urandom floor.
2. Epsilon from Opacus RDP / PRV versus dp-accounting RDP / PLD (if installed).
3. Privacy/utility on a synthetic task through the real pipeline: 10 sites, patients with
   1-6 records each, logistic regression; every round each site Poisson-samples patients,
   computes per-patient gradients, encodes them with IntegerEncoder (clip, rotate, scale,
   round, discrete Gaussian share, wrap to 2**bits), the modular sum over the surviving
   sites (random 20 % dropout, never below the threshold) is decoded and applied.
   Epsilon is the distributed discrete Gaussian accounting of the run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import warnings
from dataclasses import replace

import numpy as np

from dp.accounting import gaussian_epsilon, noise_multiplier_for
from dp.distributed import calibrate, choose_bits, noise_for_budget, round_epsilon
from dp.encoding import EncodingParams, IntegerEncoder
from dp.samplers import discrete_gaussian, skellam

warnings.filterwarnings("ignore")


def bench_samplers(d: int = 100_000) -> list[dict[str, float | str]]:
    t0 = time.perf_counter()
    os.urandom(8 * d * 12)
    floor = time.perf_counter() - t0
    rows: list[dict[str, float | str]] = []
    for name, fn, var in [("dgauss", discrete_gaussian, 1e4), ("dgauss", discrete_gaussian, 1e8),
                          ("skellam", skellam, 1e4), ("skellam", skellam, 1e8)]:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn(var, d)
            times.append(time.perf_counter() - t0)
        best = min(times)
        rows.append({"sampler": name, "variance": var, "seconds": best,
                     "samples_per_s": d / best, "urandom_floor_s": floor,
                     "ratio_to_floor": best / floor})
    return rows


def bench_accounting() -> list[dict[str, float]]:
    try:
        import dp_accounting as dpa
    except ImportError:
        dpa = None
    rows = []
    for q, z, steps, delta in [(0.01, 4.0, 10_000, 1e-5), (256 / 60_000, 1.1, 14_062, 1e-5),
                               (0.05, 2.0, 500, 1e-6), (0.2, 1.5, 50, 1e-5)]:
        row = {"q": q, "z": z, "steps": steps, "delta": delta,
               "opacus_rdp": gaussian_epsilon(z, q, steps, delta, "rdp"),
               "opacus_prv": gaussian_epsilon(z, q, steps, delta, "prv")}
        if dpa is not None:
            ev = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)),
                                         steps)
            row["dp_accounting_rdp"] = dpa.rdp.RdpAccountant().compose(ev).get_epsilon(delta)
            row["dp_accounting_pld"] = dpa.pld.PLDAccountant().compose(ev).get_epsilon(delta)
        rows.append(row)
    return rows


def _task(seed: int = 0, sites: int = 10, patients: int = 150, dim: int = 20):
    rng = np.random.default_rng(seed)  # synthetic data only; noise comes from dp.samplers
    w_true = rng.normal(size=dim)
    data = []
    for _ in range(sites):
        counts = rng.integers(1, 7, size=patients)
        x = rng.normal(size=(counts.sum(), dim))
        y = (x @ w_true + rng.normal(scale=1.0, size=len(x)) > 0).astype(float)
        data.append((x, y, np.repeat(np.arange(patients), counts)))
    xt = rng.normal(size=(5000, dim))
    yt = (xt @ w_true > 0).astype(float)
    return data, xt, yt


def train(epsilon: float | None, rounds: int = 60, q: float = 0.2, delta: float = 1e-5,
          clip: float = 1.0, lr: float = 2.0, sites: int = 10, threshold: int = 7,
          seed: int = 0) -> dict[str, float]:
    data, xt, yt = _task(seed, sites)
    dim = xt.shape[1] + 1
    patients = max(p.max() + 1 for _, _, p in data)
    expected_units = q * patients * sites
    scale = 2000.0
    params = EncodingParams(dim=dim, clip_norm=clip, scale=scale, bits=64, noise_stddev=0.0,
                            rotation_seed=seed, threshold=threshold)
    if epsilon:  # calibrate with the distributed (discrete Gaussian) accounting itself
        params = noise_for_budget(params, epsilon, delta, q, rounds)
    z_gauss = noise_multiplier_for(epsilon, delta, q, rounds) if epsilon else 0.0
    z = params.noise_stddev * math.sqrt(threshold) / clip
    cal = calibrate(z, clip, sites, threshold)
    bits = choose_bits(dim=dim, clip_norm=clip, scale=scale, noise_stddev=cal.per_site_stddev,
                       num_sites=sites, units_per_site=int(patients * q * 2)).bits
    params = replace(params, bits=bits)
    enc = IntegerEncoder(params)
    w = np.zeros(dim)
    rng = np.random.default_rng(seed + 1)  # dropout pattern only
    for _ in range(rounds):
        alive = [s for s in range(sites) if rng.random() > 0.2]
        if len(alive) < threshold:
            alive = list(range(threshold))
        total = np.zeros(params.encoded_dim, dtype=np.uint64)
        for s in alive:
            x, y, pid = data[s]
            chosen = np.flatnonzero(rng.random(patients) < q)
            mask = np.isin(pid, chosen)
            xb = np.hstack([x[mask], np.ones((mask.sum(), 1))])
            grad_rec = (1 / (1 + np.exp(-xb @ w)) - y[mask])[:, None] * xb
            _, inv = np.unique(pid[mask], return_inverse=True)
            rows = np.zeros((inv.max() + 1 if inv.size else 0, dim))
            np.add.at(rows, inv, grad_rec)
            share = (enc.encode_units(rows, noise=epsilon is not None) if len(rows)
                     else enc.wrap(enc.noise(epsilon is not None)))
            total = (total + share) % np.uint64(1 << bits)
        w -= lr * enc.decode(total, num_included=len(alive)) / expected_units
    acc = float((((np.hstack([xt, np.ones((len(xt), 1))]) @ w) > 0) == yt).mean())
    eps = round_epsilon(params, q, rounds, delta) if epsilon else math.inf
    return {"target_epsilon": epsilon or math.inf, "noise_multiplier": z,
            "central_gaussian_z": z_gauss,
            "distributed_epsilon": eps, "accuracy": acc, "bits": bits,
            "noise_cost_all_survive": cal.cost}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer epsilons")
    args = ap.parse_args()
    eps_list = [1.0, 8.0, None] if args.quick else [0.5, 1.0, 2.0, 4.0, 8.0, None]
    report = {"samplers": bench_samplers(), "accounting": bench_accounting(),
              "privacy_utility": [train(e) for e in eps_list]}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print("sampler   variance   seconds(d=1e5)  Msamples/s  ratio-to-urandom-floor")
    for r in report["samplers"]:
        print(f"{r['sampler']:8s} {r['variance']:9.0e}  {r['seconds']:.3f}          "
              f"{r['samples_per_s'] / 1e6:.2f}        {r['ratio_to_floor']:.0f}x")
    print("\nq        z     steps  delta  opacus-rdp opacus-prv dpacc-rdp dpacc-pld")
    for r in report["accounting"]:
        print(f"{r['q']:.5f} {r['z']:.1f} {r['steps']:6d} {r['delta']:.0e} "
              f"{r['opacus_rdp']:9.4f} {r['opacus_prv']:9.4f} "
              f"{r.get('dp_accounting_rdp', float('nan')):9.4f} "
              f"{r.get('dp_accounting_pld', float('nan')):9.4f}")
    print("\ntarget-eps  z(ddg)  z(central)  distributed-eps  accuracy  bits")
    for r in report["privacy_utility"]:
        print(f"{r['target_epsilon']:9.2f} {r['noise_multiplier']:6.3f} "
              f"{r['central_gaussian_z']:6.3f}    "
              f"{r['distributed_epsilon']:12.3f}   {r['accuracy']:.3f}    {r['bits']}")


if __name__ == "__main__":
    main()
