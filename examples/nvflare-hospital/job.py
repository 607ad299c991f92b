"""The hospital job: NVFlare's FedAvg job with two lines changed (docs/nvflare.md).

    python examples/nvflare-hospital/job.py                 # simulator, 3 hospitals, DP
    python examples/nvflare-hospital/job.py --exact         # exact secure sums (sites opt in)
    python examples/nvflare-hospital/job.py --undo-exact    # take the opt-in back

Each hospital's policy lives in its own folder, the one its site reads:
$SECAGG_NVFLARE_DIR/<site>/, default $XDG_STATE_HOME/secagg/nvflare/<site>/ (state home
~/.local/state), never in the job. Its ledger is there too in a deployment; in the
simulator, unless $SECAGG_NVFLARE_DIR is set, each run has its own
(<workspace>/<site>/simulate_job/secagg/ledger.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from getpass import getuser
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXACT_OPT_IN = {"modes": ["none", "distributed"]}
"""What --exact writes as each simulated hospital's policy: exact sums as well as DP rounds
(so a later DP run of the example is not refused)."""

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--hospitals", type=int, default=3)
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--exact", action="store_true",
                    help="exact secure sums, no DP: writes each simulated hospital's opt-in")
parser.add_argument("--undo-exact", action="store_true",
                    help="remove the opt-in --exact wrote (an operator's own policy is kept)")
parser.add_argument("--workspace",
                    default=str(Path(tempfile.gettempdir()) / f"nvflare-hospital-{getuser()}"),
                    help="the simulator's workspace (default: one per user)")
args = parser.parse_args()


def policy_files() -> list[Path]:
    """Each simulated hospital's policy.json, in the folder its site reads."""
    from fl.nvflare.client import SiteConfig

    return [SiteConfig.for_site(f"site-{i}").folder / "policy.json"
            for i in range(1, args.hospitals + 1)]


if args.undo_exact:
    for path in policy_files():
        if path.exists() and json.loads(path.read_text()) == EXACT_OPT_IN:
            path.unlink()
            print(f"removed the exact-sum opt-in {path}")
        elif path.exists():
            print(f"kept {path}: not the opt-in this script writes (an operator's own)")
    sys.exit(0)

import torch  # noqa: E402
from nvflare.app_opt.pt.job_config.model import PTModel  # noqa: E402
from nvflare.job_config.api import FedJob  # noqa: E402

from fl.data import load_dataset  # noqa: E402

# the changed import; it was
#   from nvflare.app_common.workflows.fedavg import FedAvg
#   from nvflare.job_config.script_runner import ScriptRunner
from fl.nvflare import SecureFedAvg, SecureScriptRunner  # noqa: E402

table = load_dataset("ehr", 0, 600)
# epsilon 8 planned over fewer than 4 rounds costs a site more than 4 per round, above a
# default site's cap per release (docs/privacy.md): the plan spans at least 4 rounds
dp = None if args.exact else {"clip_norm": 1.0, "epsilon": 8.0, "delta": 1e-5,
                              "rounds": max(args.rounds, 4)}
job = FedJob(name="hospital", min_clients=args.hospitals)
# was: FedAvg(num_clients=args.hospitals, num_rounds=args.rounds)
job.to_server(SecureFedAvg(num_clients=args.hospitals, num_rounds=args.rounds, dp=dp,
                           stage_timeout=30.0))
job.to_server(PTModel(torch.nn.Linear(table.num_features, table.num_classes)))
# was: ScriptRunner(script=..., script_args=...)
job.to_clients(SecureScriptRunner(str(HERE / "client.py"),
                                  script_args=f"--hospitals {args.hospitals}"))
if args.exact:
    # Exact sums need each hospital operator's opt-in, in the folder its site reads. In the
    # simulator every hospital runs on this machine, so this script writes them; in a
    # deployment each operator writes its own policy.json (docs/nvflare.md).
    for path in policy_files():
        path.write_text(json.dumps(EXACT_OPT_IN))
        print(f"wrote the exact-sum opt-in {path} (undo: {sys.argv[0]} --undo-exact)")
# the server writes the round reports into the job's run directory (SecureFedAvg's
# report_path, default secure_rounds.jsonl), here under the simulator's workspace
report = Path(args.workspace) / "server" / "simulate_job" / "secure_rounds.jsonl"
report.unlink(missing_ok=True)  # an earlier run's
job.simulator_run(args.workspace, n_clients=args.hospitals, threads=args.hospitals)
summed = 0
for line in report.read_text().splitlines() if report.exists() else []:
    r = json.loads(line)
    summed += bool(r["included"])
    print(f"round {r['server_round']}: summed {r['included']}, dropped {r['dropped']}, "
          f"epsilon {r['epsilon']}, seconds {r['seconds']}"
          + (f", not run: {r['skipped']}" if r["skipped"] else "")
          + (f", aborted: {r['aborted']}" if r["aborted"] else ""))
if not summed:
    sys.exit(f"no round summed any hospital (the reports above, and the sites' logs under "
             f"{args.workspace}, say why)")
