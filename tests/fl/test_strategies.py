"""``--strategy`` through secure aggregation equals a plain (non-secure) reference written
here: FedAvg, FedProx, SCAFFOLD (control variates summed securely with the model delta)
and the server optimizers of Reddi et al. 2021, on Fed-TCGA-BRCA with the same seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl.contribution import local_seed
from fl.federation import train
from fl.models import make_model
from fl.settings import FLAMBY_TCGA_BRCA, TrainSettings, tcga_brca_settings
from fl.survival import cox_loss, targets, tcga_brca

pytestmark = pytest.mark.timeout(150)

ROUNDS, STEPS = 3, 12


def reference(settings: TrainSettings) -> np.ndarray:
    """The same training without secure aggregation, in float64 on the server side."""
    data = tcga_brca()
    model = make_model("cox", 39, 2, settings.seed)
    w = torch.nn.utils.parameters_to_vector(model.parameters()).detach().double().numpy()
    dim = len(w)
    lr, strategy = settings.lr, settings.strategy
    c, m, v = np.zeros(dim), np.zeros(dim), np.zeros(dim)
    c_site = [np.zeros(dim) for _ in data.train]
    for r in range(1, settings.rounds + 1):
        sums, dc_sums, total = np.zeros(dim), np.zeros(dim), 0
        for k, table in enumerate(data.train):
            x, y = torch.from_numpy(table.x), targets(table).float()
            local = torch.nn.Linear(39, 1, bias=False)
            torch.nn.utils.vector_to_parameters(torch.from_numpy(w).float(), local.parameters())
            start = [p.detach().clone() for p in local.parameters()]
            gen = torch.Generator().manual_seed(local_seed(settings.seed, r, k + 1))
            rows: list[torch.Tensor] = []
            while len(rows) < STEPS:
                order = torch.randperm(len(table), generator=gen)
                rows += [order[i:i + settings.batch_size]
                         for i in range(0, len(table), settings.batch_size)]
            shift = torch.from_numpy(c - c_site[k]).float()
            for batch in rows[:STEPS]:
                local.zero_grad()
                loss = cox_loss(local(x[batch]), y[batch])
                if settings.fedprox_mu > 0:
                    loss = loss + settings.fedprox_mu / 2 * sum(
                        ((p - s) ** 2).sum() for p, s in zip(local.parameters(), start,
                                                             strict=True))
                loss.backward()
                grad = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
                if strategy == "scaffold":
                    grad = grad + shift
                with torch.no_grad():
                    flat = torch.nn.utils.parameters_to_vector(local.parameters()) - lr * grad
                    torch.nn.utils.vector_to_parameters(flat, local.parameters())
            y_k = torch.nn.utils.parameters_to_vector(local.parameters()).detach().double().numpy()
            delta = y_k - w.astype(np.float32).astype(np.float64)
            n = len(table)
            sums += n * delta
            total += n
            if strategy == "scaffold":
                new_c = c_site[k] - c - delta / (STEPS * lr)
                dc_sums += n * (new_c - c_site[k])
                c_site[k] = new_c
        mean = sums / total
        if strategy == "scaffold":
            c = c + dc_sums / total
            w = w + settings.server_lr * mean
        elif strategy in ("fedadam", "fedyogi", "fedadagrad"):
            m = 0.9 * m + 0.1 * mean
            if strategy == "fedadam":
                v = 0.999 * v + 0.001 * mean**2
            elif strategy == "fedyogi":
                v = v - 0.001 * mean**2 * np.sign(v - mean**2)
            else:
                v = v + mean**2
            w = w + settings.server_lr * m / (np.sqrt(v) + 1e-8)
        else:
            w = w + settings.server_lr * mean
        w = w.astype(np.float32).astype(np.float64)  # the global model is float32
    return w


@pytest.mark.parametrize("strategy", sorted(FLAMBY_TCGA_BRCA))
def test_strategy_through_secure_aggregation_equals_plain_reference(strategy: str) -> None:
    settings = tcga_brca_settings(strategy, rounds=ROUNDS, local_steps=STEPS, seed=3,
                                  broker="memory")
    report = train(settings)
    assert all(row["aggregate_correct"] for row in report["rounds"])
    secure = np.asarray(report["model"])
    plain = reference(settings)
    assert np.abs(secure - plain).max() < 1e-5 * max(1.0, np.abs(plain).max())
    start = make_model("cox", 39, 2, 3)
    assert np.abs(secure - torch.nn.utils.parameters_to_vector(
        start.parameters()).detach().double().numpy()).max() > 1e-3  # it trained


def test_scaffold_sends_control_deltas_in_the_same_secure_sum() -> None:
    from fl.coordinator import RoundCapture

    captured: list[RoundCapture] = []
    settings = tcga_brca_settings("scaffold", rounds=1, local_steps=4, broker="memory")
    train(settings, on_capture=captured.append)
    (capture,) = captured
    assert capture.config.dim == 2 * 39 + 1  # [n delta_y, n delta_c, n] in one vector
    assert capture.config.num_clients == 6 and capture.included == frozenset(range(1, 7))


def test_strategy_options_are_checked() -> None:
    with pytest.raises(ValueError, match="--strategy nope"):
        TrainSettings(strategy="nope")
    with pytest.raises(ValueError, match="without --dp"):
        TrainSettings(strategy="scaffold", dp="site", epsilon=4.0)
    with pytest.raises(ValueError, match="checkpoints"):
        TrainSettings(strategy="scaffold", checkpoint="/tmp/x")
    with pytest.raises(ValueError, match="local-steps"):
        TrainSettings(local_steps=0)


def test_local_steps_run_through_reshuffled_passes() -> None:
    """``local_steps`` (FLamby's local updates): batches of fresh seeded passes, each pass
    holding every record once; ``epochs`` is unchanged (the same batches as before)."""
    from fl.site.training import Site

    site = Site(1, tcga_brca().train[5])  # 40 records
    batches = site.batches(epochs=1, batch_size=16, seed=7, steps=7)
    assert [len(b) for b in batches] == [16, 16, 8, 16, 16, 8, 16]
    for start in (0, 3):
        assert sorted(torch.cat(batches[start:start + 3]).tolist()) == list(range(40))
    assert batches[0].tolist() != batches[3].tolist()  # a new shuffle per pass
    epochs = site.batches(epochs=2, batch_size=16, seed=7)
    assert [b.tolist() for b in epochs] == [b.tolist() for b in batches[:6]]


def test_server_strategy_refuses_an_update_of_the_wrong_width() -> None:
    from fl.strategies import ServerStrategy

    with pytest.raises(ValueError, match="expects 8"):
        ServerStrategy("scaffold", 4).step(np.zeros(4), np.zeros(4))
    with pytest.raises(ValueError, match="expects 4"):
        ServerStrategy("fedadam", 4).step(np.zeros(4), np.zeros(8))


def test_server_optimizer_state_survives_a_checkpoint(tmp_path) -> None:
    """Two rounds, a stop, then two more from the checkpoint equal four rounds at once:
    the moments m and v are in the checkpoint."""
    from dataclasses import replace

    settings = tcga_brca_settings("fedadam", rounds=4, local_steps=5, seed=2,
                                  broker="inprocess")
    whole = np.asarray(train(settings)["model"])
    saved = replace(settings, checkpoint=str(tmp_path / "ck"))
    train(replace(saved, rounds=2))
    resumed = train(replace(saved, resume=True))
    assert [row["round"] for row in resumed["rounds"]] == [1, 2, 3, 4]
    np.testing.assert_array_equal(np.asarray(resumed["model"]), whole)
    stateless = train(replace(settings, rounds=2, checkpoint=str(tmp_path / "ck2")))
    assert stateless["rounds"]
    from fl import checkpoint

    loaded = checkpoint.load(tmp_path / "ck2")
    assert loaded is not None and loaded.server is not None
    loaded.server["m"] = [0.0]  # a state of another size is refused
    checkpoint.save(tmp_path / "ck2", loaded)
    with pytest.raises(checkpoint.CheckpointError, match="server state"):
        train(replace(settings, checkpoint=str(tmp_path / "ck2"), resume=True))
