"""``secagg keygen``: a site's long-term Ed25519 identity (fl/site/identity.py).

``secagg keygen --out site-3.key`` writes the private key ``site-3.key`` (mode 0600; it
never leaves the site) and the public key ``site-3.pub``, and prints the public key's
fingerprint. The operators exchange the ``.pub`` files (and compare fingerprints) out of
band; every site operator, and the coordinator, puts them in a directory given as
``secagg train --peer-keys DIR`` (docs/deployment.md).
"""

from __future__ import annotations

import argparse
from typing import Any

from fl.cli._common import emit_json


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "keygen",
        help="make a site's identity key (Ed25519) for authenticated rounds",
        description=(
            "Write a site's long-term Ed25519 private key (mode 0600) and its public key "
            "(.pub next to it). Give the .pub file to every other site operator and the "
            "coordinator (out of band); they put it, named site-<id>.pub, in their "
            "--peer-keys directory."),
    )
    p.add_argument("--out", required=True, metavar="site-N.key",
                   help="where to write the private key; the public key goes to the same "
                        "name with .pub")
    p.add_argument("--force", action="store_true",
                   help="replace an existing key pair (every peer then needs the new .pub)")
    p.add_argument("--json", action="store_true",
                   help="print {private_key, public_key, fingerprint} as one JSON object")
    p.set_defaults(command="keygen")
    return p


def run(args: argparse.Namespace) -> int:
    from fl.site.identity import fingerprint, generate

    key, pub, raw = generate(args.out, force=args.force)
    if args.json:
        emit_json({"private_key": str(key), "public_key": str(pub),
                   "fingerprint": fingerprint(raw)})
    else:
        print(f"private key {key} (keep it on this site, mode 0600)")
        print(f"public key  {pub} (give it to the federation as site-<id>.pub)")
        print(f"fingerprint {fingerprint(raw)}")
    return 0
