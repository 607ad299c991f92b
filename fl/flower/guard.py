"""A node's forward-only record of each round's stage, kept outside ``Context.state``.

Flower saves a node's ``Context`` after a message only when the ClientApp returns, and its
simulation engine may run two messages for one node at the same time from the same saved
``Context``. A snapshot in ``Context.state`` alone could therefore be used twice: two
different unmasking requests answered from the same masked-stage snapshot would reveal both
shares of a peer (the host duty of ``secagg.resume``: never restore a snapshot older than the
stage the client reached). This guard keeps, per session and client, the highest stage the
node answered and the digest of that answer in a small file, read and written under an
exclusive ``flock`` so that the messages of one node are handled one at a time across
processes:

* ``Client.restore(..., min_stage=recorded)`` refuses an older snapshot;
* a second, different answer at the recorded stage is refused (an identical one is a
  redelivery);
* an aborted round is recorded as such and every later message for it is refused.

The files live in ``NodePolicy.stage_dir`` (default: ``<tmp>/secagg-flower/node-<id>``); each
is about 50 bytes, one per round the node took part in. Deleting them re-opens the rollback
they prevent, so prune only rounds that are long over.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ABORTED = 255
_FORMAT = 1


class GuardError(RuntimeError):
    """The node refuses: the message would make it answer a round twice, or go back."""


@dataclass
class StageRecord:
    stage: int | None
    digest: bytes

    def answer(self, stage: int, reply: bytes) -> None:
        """Record ``reply`` at ``stage``; refuse going back or a different second answer."""
        digest = hashlib.sha256(reply).digest()
        if self.stage == ABORTED:
            raise GuardError("this node aborted the round; it answers nothing more in it")
        if self.stage is not None and stage < self.stage:
            raise GuardError("the node already answered a later stage of this round")
        if self.stage == stage and digest != self.digest:
            raise GuardError("the node already answered a different message at this stage "
                             "of this round; refused")
        self.stage, self.digest = stage, digest

    def abort(self) -> None:
        self.stage, self.digest = ABORTED, b""


def default_directory(node_id: int) -> Path:
    return Path(tempfile.gettempdir()) / "secagg-flower" / f"node-{node_id}"


@contextlib.contextmanager
def hold(directory: Path, session: bytes, client_id: int) -> Iterator[StageRecord]:
    """The record of (session, client) under an exclusive lock; written back on exit (also
    when the body raises, so an abort recorded before raising is kept)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / f"{session.hex()}-{client_id}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        raw = os.read(fd, 64)
        record = StageRecord(None, b"")
        if len(raw) == 35 and raw[0] == _FORMAT:
            record = StageRecord(raw[1] if raw[2] else None, raw[3:])
        elif raw:
            raise GuardError(f"the stage record {path} is corrupted; the node refuses the "
                             "round rather than risk answering it twice")
        before = (record.stage, record.digest)
        try:
            yield record
        finally:
            if (record.stage, record.digest) != before and record.stage is not None:
                body = bytes([_FORMAT, record.stage, 1]) + record.digest.ljust(32, b"\0")
                os.lseek(fd, 0, os.SEEK_SET)
                os.ftruncate(fd, 0)
                os.write(fd, body)
    finally:
        os.close(fd)  # releases the lock
