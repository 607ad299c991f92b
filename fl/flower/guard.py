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

**Pruning** (:func:`prune`): the files live in ``NodePolicy.stage_dir`` (default
``<tmp>/secagg-flower/node-<id>``), 67 bytes each; when the node joins a round it keeps the
``NodePolicy.keep_rounds`` most recently used records and deletes the rest. Deleting a
record deletes the only copy of its round's snapshot key: whatever a ``Context`` still
holds of that round can no longer be restored, and a message of that round is refused
("no record"), so pruning never re-opens the rollback. A setup of a pruned session sent
again is joined afresh: new keys and secrets, the old join's state unusable
(docs/flower.md, "State on the node").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ABORTED = 255
_FORMAT = 2
_SIZE = 3 + 32 + 32  # format, stage, set flag, answer digest, snapshot key
_NAME = re.compile(r"^[0-9a-f]{64}-[0-9]+$")


class GuardError(RuntimeError):
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
                             "or the record was pruned: NodePolicy.keep_rounds); refused")
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
    when the record is pruned) and the node's own ``NodePolicy.snapshot_key``."""
    if record.stage is None or not record.key:
        raise GuardError("this node has no record of this round (it never joined it, or "
                         "the record was pruned: NodePolicy.keep_rounds); refused")
    return hashlib.sha256(b"secagg/flower|snapshot-key|" + record.key + node_key).digest()


def default_directory(node_id: int) -> Path:
    return Path(tempfile.gettempdir()) / "secagg-flower" / f"node-{node_id}"


def _open_locked(path: Path) -> int:
    """``path`` opened (created if absent) and exclusively locked, checked to be still
    linked once locked: a concurrent :func:`prune` may have deleted the file we opened."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
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
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
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
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
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
