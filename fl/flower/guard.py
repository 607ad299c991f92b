"""A node's forward-only record of each round's stage, kept outside ``Context.state``.

Flower saves a node's ``Context`` after a message only when the ClientApp returns, and its
simulation engine may run two messages for one node at the same time from the same saved
``Context``. A snapshot in ``Context.state`` alone could therefore be used twice: two
different unmasking requests answered from the same masked-stage snapshot would reveal both
shares of a peer (the host duty of ``secagg.resume``: never restore a snapshot older than the
stage the client reached). This guard keeps, per session and client, the highest stage the
node answered, the digest of that answer and the round's **snapshot key** in a small file,
read and written under an exclusive ``flock`` so that the messages of one node are handled
one at a time across processes:

* ``Client.restore(..., min_stage=recorded)`` refuses an older snapshot;
* a second, different answer at the recorded stage is refused (an identical one is a
  redelivery);
* an aborted round is recorded as such and every later message for it is refused;
* the round's snapshot is authenticated under a random key drawn when the node joins and
  kept only in the record (:func:`snapshot_key`), so a message of a round the node has
  no record of is refused, and a snapshot of an earlier join of the same session (kept in
  a rolled-back ``Context``) does not verify under a later join's key.

**A private directory**: the records live in ``NodeOptions.stage_dir`` (default
``<tmp>/secagg-flower-<uid>/node-<id>``), which must be a real directory owned by the node's
user with no access for group or others, inside a parent that no other user can write to
(owned by the user or root, and not group/other-writable unless sticky, as ``/tmp`` is);
records are opened without following links and must be regular single-link files of the
user. Anything else is refused (:func:`private_directory`): a local user who could plant or
rewrite a record could read the snapshot key or roll the record back.

**Pruning** (:func:`prune`): 67 bytes per record; when the node joins a round it keeps the
``NodeOptions.keep_rounds`` most recently used records and deletes the rest; under the
default base it also removes other nodes' directories untouched for a day
(:func:`remove_stale_nodes`: Flower's simulation draws new node ids every run). Deleting a
record deletes the only copy of its round's snapshot key: whatever a ``Context`` still
holds of that round can no longer be restored, and a message of that round is refused
("no record"), so pruning never re-opens the rollback. A setup of a pruned session sent
again is refused by the site session's replay rule (the ledger keeps every round's key:
:mod:`fl.site.session`; docs/flower.md, "State on the node").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import FLError

ABORTED = 255
_FORMAT = 2
_SIZE = 3 + 32 + 32  # format, stage, set flag, answer digest, snapshot key
_NAME = re.compile(r"^[0-9a-f]{64}-[0-9]+$")


class GuardError(FLError, RuntimeError):
    """The node refuses: the message would make it answer a round twice, or go back."""


@dataclass
class StageRecord:
    stage: int | None
    digest: bytes
    key: bytes = b""

    def join_round(self, stage: int, reply: bytes) -> None:
        """Record the node's first answer in a round and draw the round's snapshot key."""
        if self.stage is not None:
            raise GuardError("this node already joined this round (same session); a round "
                             "is joined once")
        self.key = os.urandom(32)
        self.answer(stage, reply)

    def answer(self, stage: int, reply: bytes) -> None:
        """Record ``reply`` at ``stage``; refuse going back or a different second answer."""
        digest = hashlib.sha256(reply).digest()
        if self.stage == ABORTED:
            raise GuardError("this node aborted the round; it answers nothing more in it")
        if self.stage is None and not self.key:
            raise GuardError("this node has no record of this round (it never joined it, "
                             "or the record was pruned: NodeOptions.keep_rounds); refused")
        if self.stage is not None and stage < self.stage:
            raise GuardError("the node already answered a later stage of this round")
        if self.stage == stage and digest != self.digest:
            raise GuardError("the node already answered a different message at this stage "
                             "of this round; refused")
        self.stage, self.digest = stage, digest

    def abort(self) -> None:
        self.stage, self.digest = ABORTED, b""


def snapshot_key(record: StageRecord, node_key: bytes) -> bytes:
    """The key a round's snapshot is authenticated under: the record's random key (gone
    when the record is pruned) and the node's own ``NodeOptions.snapshot_key``."""
    if record.stage is None or not record.key:
        raise GuardError("this node has no record of this round (it never joined it, or "
                         "the record was pruned: NodeOptions.keep_rounds); refused")
    return hashlib.sha256(b"secagg/flower|snapshot-key|" + record.key + node_key).digest()


STALE_AFTER = 24 * 3600.0
"""Seconds after which another node's directory under the default base, untouched, is
removed (:func:`remove_stale_nodes`): Flower's simulation draws new node ids every run."""


def default_base() -> Path:
    return Path(tempfile.gettempdir()) / f"secagg-flower-{os.getuid()}"


def default_directory(node_id: int) -> Path:
    return default_base() / f"node-{node_id}"


def remove_stale_nodes(base: Path, own: Path, max_age: float = STALE_AFTER) -> int:
    """Delete the ``node-*`` directories of ``base`` other than ``own`` whose directory and
    records were all last written more than ``max_age`` seconds ago: each record under its
    lock (one in use is left), then the directory if empty. Deleting a record deletes its
    round's snapshot key, so this never re-opens a rollback (module docstring). Returns how
    many directories were removed."""
    import time

    cutoff = time.time() - max_age
    removed = 0
    with contextlib.suppress(FileNotFoundError), os.scandir(base) as listing:
        for entry in listing:
            if not entry.name.startswith("node-") or entry.path == str(own):
                continue
            try:
                info = os.lstat(entry.path)
                if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                    continue  # a link or another user's: never ours to delete
                times = [info.st_mtime] + [e.stat(follow_symlinks=False).st_mtime
                                           for e in os.scandir(entry.path)]
            except OSError:
                continue
            if max(times) > cutoff:
                continue
            prune(Path(entry.path), 0, "")
            with contextlib.suppress(OSError):
                os.rmdir(entry.path)
                removed += 1
    return removed


def private_directory(directory: Path) -> None:
    """Create ``directory`` (mode 0700, its missing parent too) and refuse it unless only
    this user can write in it and in its parent (module docstring)."""
    uid = os.getuid()
    with contextlib.suppress(FileExistsError):
        directory.parent.mkdir(parents=True, mode=0o700)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    mine = os.lstat(directory)
    if (not stat.S_ISDIR(mine.st_mode) or mine.st_uid != uid
            or stat.S_IMODE(mine.st_mode) & 0o077):
        raise GuardError(f"the stage directory {directory} must be a directory of this user "
                         f"with mode 0700 (it is {stat.filemode(mine.st_mode)}, owner "
                         f"{mine.st_uid}); another user could rewrite its records. Remove it "
                         "or set NodeOptions.stage_dir to a private directory")
    parent = os.stat(directory.parent)
    if parent.st_uid not in (uid, 0) or (
            stat.S_IMODE(parent.st_mode) & 0o022 and not parent.st_mode & stat.S_ISVTX):
        raise GuardError(f"the stage directory's parent {directory.parent} can be written "
                         f"by another user ({stat.filemode(parent.st_mode)}, owner "
                         f"{parent.st_uid}), who could replace the directory; set "
                         "NodeOptions.stage_dir inside a directory only this user can write")


def _open_record(path: Path, flags: int) -> int:
    """``path`` opened without following a link; refused unless a regular file of this
    user with one link and no access for group or others."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise GuardError(f"the stage record {path} is a symbolic link; refused") from None
        raise
    st = os.fstat(fd)
    if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink != 1
            or stat.S_IMODE(st.st_mode) & 0o077):
        os.close(fd)
        raise GuardError(f"the stage record {path} is not a private file of this node "
                         f"({stat.filemode(st.st_mode)}, owner {st.st_uid}, {st.st_nlink} "
                         "links); refused")
    return fd


def _open_locked(path: Path) -> int:
    """``path`` opened (created if absent) and exclusively locked, checked to be still
    linked once locked: a concurrent :func:`prune` may have deleted the file we opened."""
    while True:
        fd = _open_record(path, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _parse(raw: bytes, path: Path) -> StageRecord:
    if not raw:
        return StageRecord(None, b"")
    if len(raw) != _SIZE or raw[0] != _FORMAT:
        raise GuardError(f"the stage record {path} is corrupted (or written by another "
                         "version); the node refuses the round rather than risk answering "
                         "it twice")
    return StageRecord(raw[1] if raw[2] else None, raw[3:35], raw[35:67])


@contextlib.contextmanager
def hold(directory: Path, session: bytes, client_id: int) -> Iterator[StageRecord]:
    """The record of (session, client) under an exclusive lock; written back on exit (also
    when the body raises, so an abort recorded before raising is kept). A record the body
    left empty is removed again."""
    private_directory(directory)
    path = directory / record_name(session, client_id)
    fd = _open_locked(path)
    try:
        record = _parse(os.read(fd, _SIZE + 1), path)
        before = (record.stage, record.digest)
        try:
            yield record
        finally:
            if record.stage is None:
                if os.fstat(fd).st_size == 0:
                    path.unlink(missing_ok=True)  # under the lock: nothing half-made stays
            elif (record.stage, record.digest) != before:
                body = (bytes([_FORMAT, record.stage, 1]) + record.digest.ljust(32, b"\0")
                        + record.key)
                os.lseek(fd, 0, os.SEEK_SET)
                os.ftruncate(fd, 0)
                os.write(fd, body)
    finally:
        os.close(fd)  # releases the lock


def record_name(session: bytes, client_id: int) -> str:
    return f"{session.hex()}-{client_id}"


def prune(directory: Path, keep: int, current: str) -> int:
    """Delete all but the ``keep`` most recently written records of ``directory``, never
    ``current`` (the round just joined); each under its lock, a record in use is left for
    the next call. Returns how many were deleted."""
    entries = []
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as listing:
        for entry in listing:
            if _NAME.match(entry.name) and entry.name != current:
                with contextlib.suppress(FileNotFoundError):
                    entries.append((entry.stat().st_mtime_ns, entry.name))
    entries.sort(reverse=True)
    removed = 0
    for _, name in entries[max(keep - 1, 0):]:
        path = directory / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, or a link (never ours): left alone
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a message of that round is being handled right now
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    path.unlink()
                    removed += 1
        finally:
            os.close(fd)
    return removed
