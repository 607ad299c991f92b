"""Key files are the federation's roster (fl/site/identity.py): ``secagg keygen`` never follows a
link out of the key folder, and loading refuses links and files another user owns (either
could be swapped for a key of someone else's choosing)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fl.cli import main
from fl.site.identity import IdentityError, generate, load_peer_keys, load_signing_key


def test_keygen_refuses_a_dangling_pub_symlink_and_writes_nothing_outside(
        tmp_path: Path) -> None:
    keys, outside = tmp_path / "keys", tmp_path / "outside"
    keys.mkdir()
    outside.mkdir()
    (keys / "site-3.pub").symlink_to(outside / "planted.pub")  # dangling
    for force in ([], ["--force"]):
        assert main(["keygen", "--out", str(keys / "site-3.key"), "-q", *force]) == 2
        assert not (outside / "planted.pub").exists()
        assert not os.path.lexists(keys / "site-3.key")
    (keys / "site-4.key").symlink_to(outside / "planted.key")
    with pytest.raises(IdentityError, match="symbolic link"):
        generate(keys / "site-4.key", force=True)
    assert list(outside.iterdir()) == []


def _peers(tmp_path: Path) -> Path:
    peers = tmp_path / "peers"
    peers.mkdir()
    for cid in (1, 2):
        generate(peers / f"site-{cid}.key")
        (peers / f"site-{cid}.key").unlink()
    assert sorted(load_peer_keys(peers)) == [1, 2]
    return peers


def test_peer_key_loading_refuses_a_symlinked_key_file(tmp_path: Path) -> None:
    peers = _peers(tmp_path)
    elsewhere = tmp_path / "elsewhere.pub"
    (peers / "site-2.pub").rename(elsewhere)
    (peers / "site-2.pub").symlink_to(elsewhere)
    with pytest.raises(IdentityError, match=r"site-2\.pub is a symbolic link"):
        load_peer_keys(peers)


def test_a_symlinked_signing_key_is_refused(tmp_path: Path) -> None:
    key, _, _ = generate(tmp_path / "site-1.key")
    link = tmp_path / "link.key"
    link.symlink_to(key)
    load_signing_key(key)
    with pytest.raises(IdentityError, match="symbolic link"):
        load_signing_key(link)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_key_files_another_user_owns_are_refused(tmp_path: Path) -> None:
    peers = _peers(tmp_path)
    os.chown(peers / "site-1.pub", 54321, -1)
    with pytest.raises(IdentityError, match="belongs to user 54321"):
        load_peer_keys(peers)
    key, _, _ = generate(tmp_path / "own.key")
    os.chown(key, 54321, -1)
    with pytest.raises(IdentityError, match="belongs to user 54321"):
        load_signing_key(key)
