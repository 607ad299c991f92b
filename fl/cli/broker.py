"""``secagg broker``: a federation's broker credentials, and the embedded broker serving them.

``secagg broker --sites 1,2,3 --dir federation/`` writes (or completes) in ``federation/``
(mode 0700) one password file per party (``server.pw``, ``site-1.pw``, ...; mode 0600), the
embedded broker's users file (scrypt hashes) and topic ACL, and Mosquitto's
``password_file`` and ``acl_file`` (transport/credentials.py), then runs the embedded
broker on them until Ctrl-C (``--write-only``: write the files and exit). It prints the
``--broker`` and ``--password-file`` each party passes to ``secagg train`` (docs/quickstart.md
section 3, the one-machine try-out).
"""

from __future__ import annotations

import argparse
from typing import Any

from fl.cli._common import parse_sites
from transport import broker_main, write_federation


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "broker",
        help="write a federation's broker users and ACL, and run the embedded broker",
        description=(
            "Write one password per party (the coordinator is user server, site N is user "
            "site-N), the embedded broker's users file and ACL and Mosquitto's password and "
            "ACL files into --dir, then run the embedded broker on them until Ctrl-C."),
    )
    p.add_argument("--sites", required=True, metavar="S|ID,ID,...",
                   help="the federation's sites: a count S (ids 1..S) or their ids")
    p.add_argument("--dir", required=True, metavar="DIR",
                   help="where the credentials go (made private, mode 0700); existing "
                        "passwords in it are kept")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the broker listens on (default loopback; another address "
                        "needs TLS: run python -m transport.broker with --certfile)")
    p.add_argument("--port", type=int, default=1883, help="TCP port (0 picks a free one)")
    p.add_argument("--port-file", metavar="PATH",
                   help="write the bound port here once the broker listens")
    p.add_argument("--write-only", action="store_true",
                   help="write the files and exit (e.g. for Mosquitto)")
    p.set_defaults(command="broker")
    return p


def run(args: argparse.Namespace) -> int:
    ids = parse_sites(args.sites, "coordinator")
    files = write_federation(args.dir, ids)
    print(f"credentials in {files.directory} (users.json, acl.json; Mosquitto: "
          f"{files.mosquitto_passwords.name}, {files.mosquitto_acl.name})")

    def commands(port: str) -> None:
        for user, path in files.passwords.items():
            print(f"  {user:>10}: --broker mqtt://{user}@{args.host}:{port} "
                  f"--password-file {path}")

    if args.write_only:
        commands("PORT" if args.port == 0 else str(args.port))
        return 0

    def listening(port: int) -> None:  # only now: a port in use is an error, not this
        commands(str(port))
        print(f"embedded broker on {args.host}:{port} (Ctrl-C stops it)", flush=True)

    argv = ["--host", args.host, "--port", str(args.port), "--users-file", str(files.users),
            "--acl-file", str(files.acl), "--parties", str(len(files.passwords)),
            "--log-level", "WARNING"]
    if args.port_file:
        argv += ["--port-file", args.port_file]
    return broker_main(argv, prog="secagg broker", on_listening=listening)
