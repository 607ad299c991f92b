"""A hospital's NVFlare Client API training script: an ordinary one. Nothing in it is about
secure aggregation: the job (job.py) runs it under fl.nvflare's SecAggExecutor, which puts
the model it sends through the site core (policy, ledger, encoding) and a secure sum."""

from __future__ import annotations

import argparse

import nvflare.client as flare
import torch
from nvflare.app_common.abstract.fl_model import FLModel

from fl.data import dirichlet_split, load_dataset, split_patients
from fl.models import make_model

parser = argparse.ArgumentParser()
parser.add_argument("--hospitals", type=int, default=3)
parser.add_argument("--patients", type=int, default=600)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()

flare.init()
site = flare.get_site_name()  # site-1, site-2, ...
train_table, test_table = split_patients(load_dataset("ehr", 0, args.patients), 0.2, 0)
partition = int(site.split("-")[1]) - 1
table = dirichlet_split(train_table, args.hospitals, alpha=1.0, seed=0)[partition]
model = make_model("logreg", table.num_features, table.num_classes, seed=0)
x, y = torch.from_numpy(table.x), torch.from_numpy(table.y)

while flare.is_running():
    received = flare.receive()
    model.load_state_dict({k: torch.as_tensor(v) for k, v in received.params.items()})
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    for _ in range(args.epochs):
        for batch in torch.randperm(len(y)).split(32):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        logits = model(torch.from_numpy(test_table.x))
        accuracy = float((logits.argmax(1) == torch.from_numpy(test_table.y)).float().mean())
    print(f"{site} round {received.current_round}: accuracy of the received model "
          f"after local training {accuracy:.3f}")
    flare.send(FLModel(params=model.state_dict(), meta={"NUM_STEPS_CURRENT_ROUND": len(table)}))
