"""A federation's broker credentials, written once: one random password per party, the
users file (scrypt hashes) and the topic ACL for the embedded broker, and the same for
Mosquitto (``password_file`` and ``acl_file``).

``write_federation(directory, site_ids)`` is what ``secagg broker`` runs: the directory is
private to its owner (0700), every file 0600, and an existing party's password is kept, so
running it again starts the same federation, but only a password that is still private and
strong: one in a file that others could read (any group or other permission bit), that is
owned by another user, or that is short or repetitive (``password_strength`` below
``MIN_PASSWORD_BITS``) is refused with what to do (docs/security.md, bounds per login).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .broker.auth import TOKEN_LOG2_N, hash_password
from .errors import TransportError
from .mosquitto import render_acl, render_password_file
from .topics import SERVER_USER, acl_json, acl_table, site_name


class CredentialsError(TransportError, ValueError):
    """The credentials directory cannot be used; the message says what to change."""


@dataclass(frozen=True)
class FederationFiles:
    """Where ``write_federation`` put each file."""

    directory: Path
    users: Path
    acl: Path
    mosquitto_passwords: Path
    mosquitto_acl: Path
    passwords: dict[str, Path]


def _private_dir(directory: Path) -> None:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise CredentialsError(f"{directory}: cannot create it ({exc.strerror}); give a "
                               "directory you can write") from None
    info = directory.lstat()
    if not directory.is_dir() or directory.is_symlink():
        raise CredentialsError(f"{directory}: not a directory; give a directory of your own")
    if info.st_uid != os.getuid():
        raise CredentialsError(f"{directory}: owned by another user; give a directory of "
                               "your own")
    if info.st_mode & 0o077:
        os.chmod(directory, 0o700)


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600, never following a planted link."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


MIN_PASSWORD_BITS = 96
"""The least ``password_strength`` an existing password file may hold (a generated one:
``secrets.token_urlsafe(24)``, 32 characters of 64, is about 180)."""


def password_strength(text: str) -> float:
    """An upper bound on a password's entropy in bits: its length times log2 of how many
    distinct characters it uses (a repeated letter has 0; it says nothing of dictionary
    words, which a generated password never is)."""
    distinct = len(set(text))
    return len(text) * math.log2(distinct) if distinct > 1 else 0.0


def _password(path: Path) -> str:
    """The party's existing password, or a new random one written to ``path``; an existing
    one must be in a private file (0600, this user's) and strong, else ``CredentialsError``
    says to delete it (a new one is then made, to hand to the party)."""
    if path.is_symlink():
        raise CredentialsError(f"{path}: is a symbolic link; remove it")
    if path.exists():
        info = path.stat()
        fix = "delete it to make a new one, and give the party its new password"
        if info.st_uid != os.getuid():
            raise CredentialsError(f"{path}: owned by another user; {fix}")
        if info.st_mode & 0o077:
            raise CredentialsError(f"{path}: mode {info.st_mode & 0o777:04o}, readable or "
                                   f"writable by others, so its password may be known; {fix}")
        text = path.read_text(encoding="utf-8").strip()
        if len(text) < 16 or password_strength(text) < MIN_PASSWORD_BITS:
            raise CredentialsError(f"{path}: holds a weak password (under 16 characters or "
                                   f"at most {password_strength(text):.0f} bits, "
                                   f"{MIN_PASSWORD_BITS} needed); {fix}")
        return text
    password = secrets.token_urlsafe(24)
    _write_private(path, password + "\n")
    return password


def write_federation(directory: str | Path, site_ids: Sequence[int]) -> FederationFiles:
    """Write (or complete) the credentials of the coordinator (user ``server``) and sites
    ``site_ids`` (users ``site-<id>``) in ``directory``; see the module docstring."""
    ids = sorted({int(i) for i in site_ids})
    if len(ids) != len(site_ids) or not ids or ids[0] < 1:
        raise CredentialsError(f"site ids {list(site_ids)}: need distinct positive ids")
    root = Path(directory)
    _private_dir(root)
    users = [SERVER_USER, *(site_name(i) for i in ids)]
    pw_files = {user: root / f"{user}.pw" for user in users}
    passwords = {user: _password(path) for user, path in pw_files.items()}
    hashes = {user: hash_password(pw, log2_n=TOKEN_LOG2_N) for user, pw in passwords.items()}
    files = FederationFiles(root, root / "users.json", root / "acl.json",
                            root / "mosquitto.passwd", root / "mosquitto.acl", pw_files)
    _write_private(files.users, json.dumps(hashes, indent=1) + "\n")
    _write_private(files.acl, json.dumps(acl_json(ids), indent=1) + "\n")
    _write_private(files.mosquitto_passwords, render_password_file(passwords))
    _write_private(files.mosquitto_acl, render_acl(acl_table(ids)))
    return files
