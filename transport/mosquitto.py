"""Run a local Mosquitto (the production broker) with a generated, locked-down config.

Why: tests and benchmarks must exercise the broker that deployments use, with the same
authentication and per-client ACLs, without anyone hand-writing config files. The generated
config listens on loopback only, refuses anonymous clients, disables persistence, and bounds
what one login can make Mosquitto hold: packets a little above the largest frame the drivers
publish (``max_payload``: larger messages are chunked, ``transport.framing``), each
subscriber's queue in bytes, and the broker's heap (``memory_limit``), which is also the
only bound Mosquitto 2.0 has on retained messages (docs/security.md, bounds per login).

The helpers :func:`render_acl`, :func:`render_password_file` and :func:`render_config` return
the exact text written to disk, so the documentation can show a deployable configuration.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import hashlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from transport.broker.config import DEFAULT_MAX_PAYLOAD
from transport.broker.topics import AclEntry, TopicAcl, validate_topic_filter

from .errors import TransportError

__all__ = [
    "MosquittoBroker",
    "MosquittoError",
    "MosquittoNotFoundError",
    "MosquittoStartError",
    "find_mosquitto",
    "hash_password",
    "mosquitto_available",
    "render_acl",
    "render_config",
    "render_password_file",
]

_CANDIDATES = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/usr/bin/mosquitto",
               "/opt/homebrew/sbin/mosquitto", "/usr/local/opt/mosquitto/sbin/mosquitto")
_PBKDF2_ITERATIONS = 101  # what mosquitto_passwd 2.0 writes; the broker reads any count
_FORBIDDEN_NAME_CHARS = frozenset(" \t\r\n:#")


class MosquittoError(TransportError, RuntimeError):
    """Base class for errors starting or configuring Mosquitto."""


class MosquittoNotFoundError(MosquittoError):
    """No mosquitto binary: install it (``apt-get install mosquitto``) or pass ``binary=``."""


class MosquittoStartError(MosquittoError):
    """Mosquitto exited or did not accept connections in time; the message has its log tail."""


def find_mosquitto(binary: str | None = None) -> str | None:
    """Path of the mosquitto executable: ``binary``, ``$SECAGG_MOSQUITTO``, PATH, then the
    usual sbin locations (Debian installs to /usr/sbin, which is not on a user's PATH)."""
    for candidate in (binary, os.environ.get("SECAGG_MOSQUITTO")):
        if candidate:
            return candidate if os.access(candidate, os.X_OK) else None
    found = shutil.which("mosquitto")
    if found:
        return found
    return next((path for path in _CANDIDATES if os.access(path, os.X_OK)), None)


def mosquitto_available() -> bool:
    """True when a mosquitto binary can be found (tests skip otherwise)."""
    return find_mosquitto() is not None


# --------------------------------------------------------------------------- renderers


def _check_name(username: str) -> None:
    if not username or _FORBIDDEN_NAME_CHARS.intersection(username):
        raise ValueError(
            f"username {username!r} cannot be written to Mosquitto's files: use a non-empty "
            "name without whitespace, ':' or '#'"
        )


def hash_password(password: str, *, salt: bytes | None = None,
                  iterations: int = _PBKDF2_ITERATIONS) -> str:
    """Mosquitto's PBKDF2-SHA512 password hash (``$7$iterations$salt$hash``, base64 fields).

    Written here so no ``mosquitto_passwd`` process is needed, and so the format is the one
    documented for Mosquitto 2.0.
    """
    if "\n" in password or "\r" in password:
        raise ValueError("passwords for Mosquitto must not contain line breaks")
    salt = secrets.token_bytes(12) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return (f"$7${iterations}${base64.b64encode(salt).decode()}"
            f"${base64.b64encode(digest).decode()}")


def render_password_file(users: Mapping[str, str]) -> str:
    """Text of a Mosquitto ``password_file`` holding hashes of ``users`` (name -> password)."""
    lines = []
    for username, password in users.items():
        _check_name(username)
        lines.append(f"{username}:{hash_password(password)}")
    return "\n".join(lines) + "\n"


def _acl_patterns(username: str, patterns: Sequence[str]) -> list[str]:
    out = []
    for pattern in patterns:
        if "%c" in pattern:
            raise ValueError(
                f"ACL pattern {pattern!r}: %c (client id) works only in Mosquitto's global "
                "'pattern' lines; write the topic out per user instead"
            )
        expanded = pattern.replace("%u", username)
        if "\n" in expanded or "\r" in expanded:
            raise ValueError(f"ACL pattern {pattern!r} must not contain line breaks")
        validate_topic_filter(expanded)
        out.append(expanded)
    return out


def render_acl(layout: Mapping[str, AclEntry]) -> str:
    """Text of a Mosquitto ``acl_file`` for ``layout``: username -> (read, write) patterns.

    ``read`` patterns allow SUBSCRIBE and delivery, ``write`` patterns allow PUBLISH; a
    pattern in both becomes ``readwrite``. ``%u`` is replaced by the username. Users absent
    from the layout get no access at all (Mosquitto denies by default once an ACL is set).
    """
    blocks = []
    for username, entry in layout.items():
        _check_name(username)
        acl = TopicAcl.coerce(entry)
        read = _acl_patterns(username, acl.subscribe)
        write = _acl_patterns(username, acl.publish)
        lines = [f"user {username}"]
        for pattern in dict.fromkeys(read + write):
            access = ("readwrite" if pattern in read and pattern in write
                      else "read" if pattern in read else "write")
            lines.append(f"topic {access} {pattern}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


PACKET_SLACK = 1024
"""Bytes a PUBLISH packet may have beyond its payload in the generated config: fixed header
(at most 5), topic (2 + its length; secagg's topics are under 200 bytes) and packet id."""
DEFAULT_MAX_QUEUED_BYTES = 256 << 20
"""Bytes Mosquitto queues per subscriber beyond its in-flight window (then it drops, and the
drivers re-send what got no receipt): a subscriber that stops reading costs at most this."""
DEFAULT_MEMORY_LIMIT = 2 << 30
"""Mosquitto's heap cap: past it a publish is dropped and its publisher disconnected. The
only bound Mosquitto 2.0 puts on retained messages (it cannot cap them per user)."""


def render_config(
    *,
    port: int,
    password_file: str,
    acl_file: str | None = None,
    host: str = "127.0.0.1",
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    max_queued_messages: int = 10_000,
    max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
    memory_limit: int = DEFAULT_MEMORY_LIMIT,
    certfile: str | None = None,
    keyfile: str | None = None,
    cafile: str | None = None,
    extra: Sequence[str] = (),
) -> str:
    """Text of ``mosquitto.conf``: loopback listener, no anonymous access, no persistence.

    ``max_payload``: the largest frame the parties publish (their ``max_payload``, the
    framing's chunk size); a packet over it plus ``PACKET_SLACK`` disconnects its sender.
    ``max_queued_messages`` is raised from Mosquitto's 1000 because the aggregation server
    receives one QoS 1 message per site per stage, and Mosquitto drops (silently) what is
    over the limit; ``max_queued_bytes`` bounds that queue in bytes, ``memory_limit`` the
    whole broker (retained messages included).
    """
    for name, value in (("max_payload", max_payload), ("max_queued_bytes", max_queued_bytes),
                        ("memory_limit", memory_limit)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
    lines = [
        "# generated by transport.mosquitto",
        f"listener {port} {host}",
        "allow_anonymous false",
        # The client id is the username: no user can close another's connection by
        # connecting with its client id (a second connection as the same user closes the
        # first, as on the embedded broker).
        "use_username_as_clientid true",
        f"password_file {password_file}",
        "persistence false",
        f"max_packet_size {max_payload + PACKET_SLACK}",
        f"max_queued_messages {max_queued_messages}",
        f"max_queued_bytes {max_queued_bytes}",
        f"memory_limit {memory_limit}",
        "max_inflight_messages 100",
        "set_tcp_nodelay true",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        "log_type notice",
        "log_type information",
        "connection_messages true",
        "log_timestamp true",
    ]
    if acl_file:
        lines.append(f"acl_file {acl_file}")
    if certfile:
        if not keyfile:
            raise ValueError("TLS needs keyfile= alongside certfile=")
        lines += [f"certfile {certfile}", f"keyfile {keyfile}"]
        if cafile:
            lines.append(f"cafile {cafile}")
    lines.extend(extra)
    return "\n".join(lines) + "\n"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------- broker process


class MosquittoBroker:
    """A Mosquitto process with a generated config in a private temp dir.

    ``with MosquittoBroker(users={"server": "pw"}) as b:`` (or ``async with``) gives
    ``b.port`` and ``b.url``; leaving the block terminates Mosquitto and deletes the dir.
    """

    def __init__(
        self,
        users: Mapping[str, str],
        acl: Mapping[str, AclEntry] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        binary: str | None = None,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        max_queued_messages: int = 10_000,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        memory_limit: int = DEFAULT_MEMORY_LIMIT,
        certfile: str | None = None,
        keyfile: str | None = None,
        cafile: str | None = None,
        extra_config: Sequence[str] = (),
        startup_timeout: float = 10.0,
    ) -> None:
        if not users:
            raise ValueError("MosquittoBroker needs users={'name': 'password', ...}: anonymous "
                             "access is disabled in the generated config")
        self.users = dict(users)
        self.acl = dict(acl) if acl is not None else None
        self.host = host
        self._requested_port = port
        self.binary = binary
        self.max_payload = max_payload
        self.max_queued_messages = max_queued_messages
        self.max_queued_bytes = max_queued_bytes
        self.memory_limit = memory_limit
        self.certfile, self.keyfile, self.cafile = certfile, keyfile, cafile
        self.extra_config = tuple(extra_config)
        self.startup_timeout = startup_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self._port: int | None = None
        self._pwfile: Path | None = None
        self._acl_path: Path | None = None
        self.config_text = ""

    @property
    def port(self) -> int:
        if self._port is None:
            raise MosquittoError("Mosquitto is not started; use 'with' or call start()")
        return self._port

    @property
    def url(self) -> str:
        scheme = "mqtts" if self.certfile else "mqtt"
        return f"{scheme}://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        """The Mosquitto process id (for resource measurements)."""
        if self._process is None:
            raise MosquittoError("Mosquitto is not started; use 'with' or call start()")
        return self._process.pid

    @property
    def log_path(self) -> Path | None:
        return Path(self._tmpdir.name) / "mosquitto.log" if self._tmpdir else None

    def log_tail(self, lines: int = 20) -> str:
        """Last lines of Mosquitto's log (for error messages and failing tests)."""
        path = self.log_path
        if path is None or not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Write the config, start Mosquitto and wait until it accepts TCP connections."""
        if self._process is not None:
            raise MosquittoError("Mosquitto already started")
        binary = find_mosquitto(self.binary)
        if binary is None:
            raise MosquittoNotFoundError(
                "mosquitto not found: install it (apt-get install mosquitto), put it on PATH "
                "or set SECAGG_MOSQUITTO=/path/to/mosquitto"
            )
        self._tmpdir = tempfile.TemporaryDirectory(prefix="secagg-mosquitto-")
        try:
            self._write_files()
            # A port picked with port=0 can be taken before Mosquitto binds it; retry then.
            attempts = 3 if self._requested_port == 0 else 1
            for attempt in range(attempts):
                port = self._requested_port or _free_port(self.host)
                try:
                    self._launch(binary, port)
                    # A forgotten stop() must not leave Mosquitto running after exit.
                    atexit.register(self._cleanup)
                    return
                except MosquittoStartError:
                    if attempt + 1 == attempts or "in use" not in self.log_tail():
                        raise
        except BaseException:
            self._cleanup()
            raise

    def _write_files(self) -> None:
        assert self._tmpdir is not None
        root = Path(self._tmpdir.name)
        pwfile = root / "passwd"
        _write_private(pwfile, self._password_file_text(pwfile))
        acl_path = None
        if self.acl is not None:
            acl_path = root / "acl"
            _write_private(acl_path, render_acl(self.acl))
        self._acl_path = acl_path
        self._pwfile = pwfile

    def _password_file_text(self, path: Path) -> str:
        passwd = shutil.which("mosquitto_passwd")
        if passwd is None:
            return render_password_file(self.users)
        # One 'mosquitto_passwd -U' run hashes every user; it owns the format if it changes.
        for username in self.users:
            _check_name(username)
        plain = "".join(f"{name}:{pw}\n" for name, pw in self.users.items())
        _write_private(path, plain)
        result = subprocess.run([passwd, "-U", str(path)], capture_output=True, timeout=30,
                                check=False)
        if result.returncode != 0:
            path.unlink(missing_ok=True)
            return render_password_file(self.users)
        return path.read_text()

    def _launch(self, binary: str, port: int) -> None:
        assert self._tmpdir is not None
        root = Path(self._tmpdir.name)
        extra = list(self.extra_config)
        if hasattr(os, "geteuid") and os.geteuid() == 0 and not _hand_to_mosquitto_user(root):
            # Started as root, Mosquitto drops to the 'mosquitto' user, which could not read
            # our 0700 temp dir; with no such user, stay root (loopback-only, short-lived).
            extra.insert(0, "user root")
        self.config_text = render_config(
            port=port, password_file=str(self._pwfile or ""),
            acl_file=str(self._acl_path) if self._acl_path else None, host=self.host,
            max_payload=self.max_payload, max_queued_messages=self.max_queued_messages,
            max_queued_bytes=self.max_queued_bytes, memory_limit=self.memory_limit,
            certfile=self.certfile, keyfile=self.keyfile, cafile=self.cafile, extra=extra,
        )
        conf = root / "mosquitto.conf"
        _write_private(conf, self.config_text)
        log_path = root / "mosquitto.log"
        with open(log_path, "ab") as log:
            self._process = subprocess.Popen(
                [binary, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Its own session: a Ctrl-C on the terminal reaches the owner, which stops
                # Mosquitto after its clients, not Mosquitto first.
                start_new_session=True,
            )
        self._wait_ready(port)
        self._port = port

    def _wait_ready(self, port: int) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code = self._process.returncode
                self._process = None
                raise MosquittoStartError(
                    f"mosquitto exited with code {code} during startup; log tail:\n"
                    f"{self.log_tail()}"
                )
            # The log line first: a TCP probe alone is fooled by another process that
            # already listens on the port Mosquitto failed to bind.
            if " running" in self.log_tail(50):
                try:
                    with socket.create_connection((self.host, port), timeout=0.5):
                        return
                except OSError:
                    pass
            time.sleep(0.02)
        self._terminate()
        raise MosquittoStartError(
            f"mosquitto did not accept connections on {self.host}:{port} within "
            f"{self.startup_timeout} s; log tail:\n{self.log_tail()}"
        )

    def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(5.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5.0)

    def _cleanup(self) -> None:
        self._terminate()
        if self._tmpdir is not None:
            with contextlib.suppress(OSError):
                self._tmpdir.cleanup()
            self._tmpdir = None

    def stop(self) -> None:
        """Terminate Mosquitto (SIGTERM, then SIGKILL after 5 s) and delete the temp dir."""
        atexit.unregister(self._cleanup)
        self._cleanup()
        self._port = None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def __enter__(self) -> MosquittoBroker:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def __aenter__(self) -> MosquittoBroker:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.stop)


def _hand_to_mosquitto_user(root: Path) -> bool:
    """chown the temp dir to the 'mosquitto' user so Mosquitto need not keep root."""
    try:
        import pwd

        entry = pwd.getpwnam("mosquitto")
    except (ImportError, KeyError):
        return False
    for path in (root, *root.iterdir()):
        os.chown(path, entry.pw_uid, entry.pw_gid)
    return True


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
