"""Site identities and the federation roster each site operator holds (docs/privacy.md
section 1, "Who is in the round").

A site's long-term identity is an Ed25519 key pair (``secagg keygen --out site-3.key``
writes ``site-3.key``, private, mode 0600, and ``site-3.pub``). The operators exchange
the public keys out of band, and each site operator puts the federation's keys in *its
own* peer directory (``site-<id>.pub`` files, ``--peer-keys DIR``). With it the site runs
every round in secagg's ``malicious`` mode, verifying every peer's signatures with the keys
of its own directory -- never keys the coordinator sends -- and refuses a round whose
cohort or roster names a site it has no key for (:func:`check_roster`). The coordinator
cannot then fill a round with sites it simulates: it holds none of their private keys.

What this does not give: sites that collude with the coordinator (their keys are
genuine) still count as peers; docs/privacy.md states the assumption.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from dp import PolicyRefused
from secagg import SigningKey

from ..errors import FLError

PEER_FILE = re.compile(r"^site-([0-9]+)\.pub$")
MAX_SITE_ID = (1 << 32) - 1
MAX_PEERS = 1 << 16
MAX_KEY_FILE = 4096


class IdentityError(FLError, ValueError):
    """A key file or peer directory that cannot be used; the message says what to change."""


class RosterRefused(PolicyRefused, FLError):
    """A round whose cohort or roster the site's own roster does not back (rule
    ``peer_keys``) or that has fewer sites than the policy's ``min_threshold``."""


def fingerprint(public: bytes) -> str:
    """What operators compare out of band: SHA-256 of the raw public key, 16 hex groups."""
    digest = hashlib.sha256(public).hexdigest()[:32]
    return ":".join(digest[i:i + 4] for i in range(0, 32, 4))


def public_path(key_path: str | Path) -> Path:
    """``site-3.key`` -> ``site-3.pub`` (any other name: the name plus ``.pub``)."""
    path = Path(key_path)
    return path.with_suffix(".pub") if path.suffix == ".key" else Path(f"{path}.pub")


def generate(key_path: str | Path, *, force: bool = False) -> tuple[Path, Path, bytes]:
    """Write a new identity: the private key (PKCS#8 PEM, mode 0600, created exclusively
    unless ``force``) and its public key (PEM) next to it; returns both paths and the raw
    public key."""
    path = Path(key_path)
    pub = public_path(path)
    if not path.parent.is_dir():
        raise IdentityError(f"{path.parent}: no such directory")
    for existing in (path, pub):
        if existing.is_symlink():  # a dangling one too: it would be followed out of the folder
            raise IdentityError(f"{existing} is a symbolic link (to {os.readlink(existing)}); "
                                "keygen writes only real files: remove the link or choose "
                                "another --out")
    if not force:
        for existing in (path, pub):
            if os.path.lexists(existing):
                raise IdentityError(f"{existing} exists; a site's identity is long-term: "
                                    "keep it, or pass --force to replace it (its peers "
                                    "then need the new public key)")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    _write_new(path, private_pem, 0o600)
    _write_new(pub, public_pem, 0o644)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw,
                                        serialization.PublicFormat.Raw)
    return path, pub, raw


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """``data`` into ``path`` through a fresh temporary file renamed over it: a link at
    ``path`` would be replaced, never followed (generate refuses one before)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.unlink(missing_ok=True)  # left by a crash (unlink removes a link, not its target)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise IdentityError(f"{path}: {exc.strerror or exc}") from None


def _read(path: Path) -> tuple[bytes, int]:
    """A key file's bytes and mode bits: opened without following a link, and refused
    unless it is a regular file of this operator (another user's file, or a link, could be
    swapped for a key of someone else's choosing)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise IdentityError(f"{path} is a symbolic link; key files must be real files "
                                "of this operator: copy the key in place of the link") from None
        raise IdentityError(f"{path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise IdentityError(f"{path} is not a regular file")
        if info.st_uid != os.getuid():
            raise IdentityError(f"{path} belongs to user {info.st_uid}, not to this operator "
                                f"(user {os.getuid()}): another user could replace the key; "
                                "copy it into a file of your own")
        if info.st_size > MAX_KEY_FILE:
            raise IdentityError(f"{path}: {info.st_size} bytes is not a key file")
        return handle.read(MAX_KEY_FILE + 1), stat.S_IMODE(info.st_mode)


def load_signing_key(key_path: str | Path) -> SigningKey:
    """The site's private key; refused when others may read it (like ssh does)."""
    path = Path(key_path)
    data, mode = _read(path)
    if mode & 0o077:
        raise IdentityError(f"{path} is readable by others (mode {mode:o}): run "
                            f"`chmod 600 {path}`; the private key proves this site's identity")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise IdentityError(f"{path} is not an unencrypted PEM private key ({exc}); make "
                            "one with `secagg keygen --out PATH`") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
    return SigningKey(key)


def load_public_key(path: str | Path) -> bytes:
    """The raw 32-byte Ed25519 public key of a ``.pub`` file (PEM, as keygen writes)."""
    path = Path(path)
    data, _ = _read(path)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise IdentityError(f"{path} is not a PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise IdentityError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def load_peer_keys(directory: str | Path) -> dict[int, bytes]:
    """Site id -> raw public key, from the ``site-<id>.pub`` files of ``directory`` (other
    files are ignored). Two ids with the same key are refused: one party, two seats."""
    folder = Path(directory)
    if not folder.is_dir():
        raise IdentityError(f"--peer-keys {folder}: not a directory (it holds one "
                            "site-<id>.pub per site of the federation)")
    keys: dict[int, bytes] = {}
    owners: dict[bytes, int] = {}
    for entry in sorted(folder.iterdir()):
        match = PEER_FILE.match(entry.name)
        if match is None or (entry.is_dir() and not entry.is_symlink()):
            continue  # a link or a non-file named like a key is refused by load_public_key
        cid = int(match.group(1))
        if not 1 <= cid <= MAX_SITE_ID or str(cid) != match.group(1):
            raise IdentityError(f"{entry}: site ids are 1..{MAX_SITE_ID} without leading "
                                "zeros")
        if len(keys) >= MAX_PEERS:
            raise IdentityError(f"{folder}: more than {MAX_PEERS} peer keys")
        key = load_public_key(entry)
        if key in owners:
            raise IdentityError(f"{entry}: the same key as site-{owners[key]}.pub; every "
                                "site needs its own identity")
        keys[cid], owners[key] = key, cid
    if not keys:
        raise IdentityError(f"--peer-keys {folder}: no site-<id>.pub files")
    return keys


@dataclass(frozen=True)
class SiteIdentity:
    """A site's signing key and the federation's public keys from its operator."""

    site_id: int
    signing_key: SigningKey
    peers: Mapping[int, bytes]

    @classmethod
    def load(cls, site_id: int, key_path: str | Path, peer_dir: str | Path) -> SiteIdentity:
        """Refuses a peer directory whose entry for this site is another key."""
        key = load_signing_key(key_path)
        peers = load_peer_keys(peer_dir)
        own = peers.get(site_id)
        if own is None:
            raise IdentityError(f"--peer-keys {peer_dir} has no site-{site_id}.pub: add this "
                                f"site's own public key ({public_path(key_path)})")
        if own != key.public:
            raise IdentityError(f"--peer-keys {peer_dir}/site-{site_id}.pub is not the public "
                                f"key of {key_path} (fingerprint {fingerprint(own)} vs "
                                f"{fingerprint(key.public)})")
        return cls(site_id, key, dict(peers))

    def verify_keys(self, ids: Iterable[int]) -> dict[int, bytes]:
        """The keys of ``ids`` from this operator's directory (call :func:`check_roster`
        first: every id must have one)."""
        return {cid: self.peers[cid] for cid in ids}


def check_roster(ids: Iterable[int], peers: Mapping[int, bytes], *, min_sites: int,
                 what: str = "roster") -> None:
    """Raise :class:`RosterRefused` unless every id has a key in the site's own directory
    and there are at least ``min_sites`` of them (the policy's ``min_threshold``)."""
    members = sorted(set(ids))
    unknown = [cid for cid in members if cid not in peers]
    if unknown:
        raise RosterRefused("peer_keys", f"the round's {what} names sites "
                            f"{unknown[:10]} that are not in this site's --peer-keys (the "
                            "coordinator may be simulating them)")
    if len(members) < min_sites:
        raise RosterRefused("min_threshold", f"the round's {what} has {len(members)} sites; "
                            f"this site needs at least {min_sites}")
