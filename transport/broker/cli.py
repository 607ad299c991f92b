"""``python -m transport.broker``: the embedded broker as a process.

    python -m transport.broker --users-file users.json [--acl-file acl.json] [--port-file P]
    python -m transport.broker --host 0.0.0.0 --certfile b.crt --keyfile b.key \\
        --cafile ca.crt --require-certificate --users-file users.json
    python -m transport.broker hash-password        # reads a password, prints its hash

Usage errors exit 2, runtime errors 1, each with one line on stderr. Off loopback the broker
refuses to listen without TLS unless ``--allow-plaintext`` says the network is private.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import json
import logging
import os
import shutil
import signal
import ssl
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .auth import DEFAULT_LOG2_N, hash_password, is_password_hash
from .broker import LOOPBACK_HOSTS, EmbeddedBroker
from .config import DEFAULT_MAX_PAYLOAD, BrokerLimits
from .errors import BrokerConfigError, BrokerError, BrokerStartError
from .topics import SERVER_USER, TopicAcl

logger = logging.getLogger("transport.broker")
PROG = "python -m transport.broker"


def _load_json_object(path: str, what: str) -> dict[str, object]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BrokerConfigError(f"cannot read {what} file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise BrokerConfigError(f"{what} file {path} must hold a JSON object")
    return data


def load_users_file(path: str) -> dict[str, str]:
    """Read ``{"username": "<scrypt hash>", ...}`` (JSON); plaintext passwords are accepted
    with a warning and hashed in memory at once."""
    data = _load_json_object(path, "users")
    if not all(isinstance(v, str) for v in data.values()):
        raise BrokerConfigError(f"users file {path}: every password hash must be a JSON string")
    users = {str(k): str(v) for k, v in data.items()}
    plain = sorted(name for name, value in users.items() if not is_password_hash(value))
    if plain:
        logger.warning("users file %s holds plaintext passwords for %s; store hashes instead "
                       "(%s hash-password)", path, ", ".join(plain), PROG)
    return users


def load_acl_file(path: str) -> dict[str, TopicAcl]:
    """Read ``{"username": {"subscribe": [...], "publish": [...], "retain": [...]}, ...}``."""
    data = _load_json_object(path, "ACL")
    table: dict[str, TopicAcl] = {}
    for user, entry in data.items():
        if not isinstance(entry, dict):
            raise BrokerConfigError(f"ACL file {path}: entry for {user!r} must be an object")
        table[user] = TopicAcl(subscribe=tuple(entry.get("subscribe", ())),
                               publish=tuple(entry.get("publish", ())),
                               retain=tuple(entry.get("retain", ())))
    return table


def write_port_file(path: str, port: int) -> None:
    # Write-then-rename so a polling reader never sees a half-written number.
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(f"{port}\n", encoding="utf-8")
    os.replace(tmp, path)


def tls_context(certfile: str, keyfile: str | None, cafile: str | None,
                require_certificate: bool) -> ssl.SSLContext:
    """Server TLS context; with ``require_certificate`` clients must present a certificate
    signed by ``cafile`` (mutual TLS)."""
    if require_certificate and not cafile:
        raise BrokerConfigError("--require-certificate needs --cafile (the CA that signs the "
                                "clients' certificates)")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(certfile, keyfile)
        if cafile:
            context.load_verify_locations(cafile)
    except (OSError, ssl.SSLError) as exc:
        raise BrokerConfigError(f"cannot load the TLS files: {exc}") from None
    context.verify_mode = ssl.CERT_REQUIRED if require_certificate else (
        ssl.CERT_OPTIONAL if cafile else ssl.CERT_NONE)
    return context


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Embedded MQTT 3.1.1 broker for secagg (authentication "
                               "always on; MQTT 5 is not supported).")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default loopback)")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--users-file", help='JSON {"username": "<scrypt hash>", ...}')
    parser.add_argument("--acl-file",
                        help='JSON {"user": {"subscribe": [...], "publish": [...], '
                             '"retain": [...]}}')
    parser.add_argument("--port-file", help="write the bound port here once listening")
    parser.add_argument("--max-payload", type=int, default=DEFAULT_MAX_PAYLOAD,
                        help=f"largest PUBLISH payload in bytes (default {DEFAULT_MAX_PAYLOAD})")
    parser.add_argument("--certfile", help="PEM certificate: enables TLS (mqtts)")
    parser.add_argument("--keyfile", help="PEM private key for --certfile")
    parser.add_argument("--cafile", help="PEM CA that signs client certificates")
    parser.add_argument("--require-certificate", action="store_true",
                        help="refuse clients without a certificate signed by --cafile (mTLS)")
    parser.add_argument("--allow-plaintext", action="store_true",
                        help="allow a non-loopback --host without TLS (private networks only)")
    parser.add_argument("--parties", type=int, metavar="N",
                        help="how many users will log in at once (a round's sites and its "
                             "server): login and connection places for all of them, even "
                             "from one address when --host is loopback (at most 65536; "
                             "BrokerLimits.for_parties; default: the fixed limits)")
    parser.add_argument("--unthrottled", action="append", metavar="USER",
                        help="a user with no PUBLISH rate limit (repeatable; default: "
                             f"{SERVER_USER}, the aggregator, which publishes for every "
                             "site; every other user has BrokerLimits.max_publish_rate)")
    parser.add_argument("--parent-pid", type=int, metavar="PID",
                        help="stop when process PID (the one that started this broker) is "
                             "gone, even if it was SIGKILLed")
    parser.add_argument("--remove-if-orphaned", metavar="DIR",
                        help="with --parent-pid: remove DIR (the private folder holding the "
                             "users and ACL files) as soon as the parent is gone")
    parser.add_argument("--log-level", default="INFO")
    return parser


ORPHAN_GRACE = 5.0
"""Seconds an orphaned broker has to stop cleanly before it exits regardless."""


def _watch_parent(args: argparse.Namespace, loop: asyncio.AbstractEventLoop,
                  stop: asyncio.Event) -> None:
    """With ``--parent-pid``: once the parent is gone, remove ``--remove-if-orphaned`` at
    once, stop the broker, and exit after ``ORPHAN_GRACE`` s if it has not."""
    from .. import lifeline

    def orphaned() -> None:
        if args.remove_if_orphaned:
            shutil.rmtree(args.remove_if_orphaned, ignore_errors=True)
        logger.warning("the process that started this broker (pid %d) is gone; stopping",
                       args.parent_pid)
        with contextlib.suppress(RuntimeError):  # the loop already closed: exiting anyway
            loop.call_soon_threadsafe(stop.set)
        time.sleep(ORPHAN_GRACE)
        os._exit(1)

    lifeline.watch_parent(args.parent_pid, orphaned)


async def _serve(args: argparse.Namespace,
                 on_listening: Callable[[int], None] | None = None) -> None:
    context = None
    if args.certfile:
        context = tls_context(args.certfile, args.keyfile, args.cafile,
                              args.require_certificate)
    elif args.cafile or args.require_certificate or args.keyfile:
        raise BrokerConfigError("--cafile, --keyfile and --require-certificate need --certfile")
    broker = EmbeddedBroker(
        users=load_users_file(args.users_file), host=args.host, port=args.port,
        acl=load_acl_file(args.acl_file) if args.acl_file else None, ssl_context=context,
        allow_plaintext=args.allow_plaintext, max_payload=args.max_payload,
        limits=None if args.parties is None else BrokerLimits().for_parties(
            args.parties, one_address=args.host in LOOPBACK_HOSTS),
        unthrottled=args.unthrottled or [SERVER_USER],
    )
    await broker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)
    if args.parent_pid is not None:
        _watch_parent(args, loop, stop)
    try:
        if args.port_file:
            write_port_file(args.port_file, broker.port)
        if on_listening is not None:
            on_listening(broker.port)
        await stop.wait()
    finally:
        await broker.stop()
        logger.info("final stats: %s", json.dumps(broker.stats.as_dict()))


def _hash_password(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"{PROG} hash-password",
                                     description="Read a password (twice, or one line from "
                                                 "stdin) and print its scrypt hash.")
    parser.add_argument("--log2-n", type=int, default=DEFAULT_LOG2_N,
                        help=f"scrypt cost (default {DEFAULT_LOG2_N})")
    args = parser.parse_args(argv)
    if sys.stdin.isatty():
        password = getpass.getpass("password: ")
        if getpass.getpass("again: ") != password:
            print(f"{PROG}: error: the passwords differ", file=sys.stderr)
            return 2
    else:
        password = sys.stdin.readline().rstrip("\n")
    if not password:
        print(f"{PROG}: error: empty password", file=sys.stderr)
        return 2
    try:
        print(hash_password(password, log2_n=args.log2_n))
    except BrokerConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None, *, prog: str = PROG,
         on_listening: Callable[[int], None] | None = None) -> int:
    """Process entry point; returns the exit status. ``prog``: the command the user typed
    (named in errors); ``on_listening``: called with the bound port once the broker
    listens."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["hash-password"]:
        return _hash_password(argv[1:])
    args = _parser().parse_args(argv)
    if args.remove_if_orphaned and args.parent_pid is None:
        print(f"{PROG}: error: --remove-if-orphaned needs --parent-pid", file=sys.stderr)
        return 2
    if not args.users_file:
        print(f"{PROG}: error: --users-file is required (authentication is always on)",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_serve(args, on_listening))
    except BrokerConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except BrokerStartError as exc:
        cause = exc.__cause__
        if isinstance(cause, OSError):  # the address: say it in this command's options
            print(f"{prog}: error: cannot listen on {args.host}:{args.port}: "
                  f"{cause.strerror or cause}; pick another port ({prog} --port N, or "
                  "--port 0 for a free one)", file=sys.stderr)
        else:
            print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except BrokerError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0
