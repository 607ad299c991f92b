"""The hospital job: NVFlare's FedAvg job with two lines changed (docs/nvflare.md).

    python examples/nvflare-hospital/job.py                 # simulator, 3 hospitals
    python examples/nvflare-hospital/job.py --exact         # exact secure sums (sites opt in)

Each hospital's policy and ledger live in its own folder, $SECAGG_NVFLARE_DIR/<site>/
(default ~/.local/state/secagg/nvflare/<site>/), never in the job.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from nvflare.app_opt.pt.job_config.model import PTModel
from nvflare.job_config.api import FedJob

from fl.data import load_dataset

# the changed import; it was
#   from nvflare.app_common.workflows.fedavg import FedAvg
#   from nvflare.job_config.script_runner import ScriptRunner
from fl.nvflare import SecureFedAvg, SecureScriptRunner

HERE = Path(__file__).resolve().parent

parser = argparse.ArgumentParser()
parser.add_argument("--hospitals", type=int, default=3)
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--exact", action="store_true", help="exact secure sums, no DP")
parser.add_argument("--workspace", default="/tmp/nvflare-hospital")
args = parser.parse_args()

table = load_dataset("ehr", 0, 600)
dp = None if args.exact else {"clip_norm": 1.0, "epsilon": 8.0, "delta": 1e-5,
                              "rounds": args.rounds}
report = Path(args.workspace) / "secure_rounds.jsonl"
report.parent.mkdir(parents=True, exist_ok=True)
job = FedJob(name="hospital", min_clients=args.hospitals)
# was: FedAvg(num_clients=args.hospitals, num_rounds=args.rounds)
job.to_server(SecureFedAvg(num_rounds=args.rounds, dp=dp, stage_timeout=30.0,
                           report_path=str(report)))
job.to_server(PTModel(torch.nn.Linear(table.num_features, table.num_classes)))
# was: ScriptRunner(script=..., script_args=...)
job.to_clients(SecureScriptRunner(str(HERE / "client.py"),
                                  script_args=f"--hospitals {args.hospitals}"))
if args.exact:
    # Exact sums need each hospital operator's opt-in, in the hospital's own folder. In the
    # simulator every hospital runs on this machine, so this script writes them; in a
    # deployment each operator writes its own policy.json (docs/nvflare.md).
    state = os.environ.get("SECAGG_NVFLARE_DIR")
    base = Path(state) if state else Path.home() / ".local/state/secagg/nvflare"
    for i in range(1, args.hospitals + 1):
        (base / f"site-{i}").mkdir(parents=True, exist_ok=True)
        (base / f"site-{i}" / "policy.json").write_text(json.dumps({"modes": ["none"]}))
job.simulator_run(args.workspace, n_clients=args.hospitals, threads=args.hospitals)
for line in report.read_text().splitlines():
    r = json.loads(line)
    print(f"round {r['server_round']}: summed {r['included']}, dropped {r['dropped']}, "
          f"epsilon {r['epsilon']}, seconds {r['seconds']}")
