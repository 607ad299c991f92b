"""Corrupted unmasking shares are named when attributable (inside Reed-Solomon's decoding
radius), reported as unattributable beyond it, and the aggregate stays exact while t
honest shares of every secret remain."""

from __future__ import annotations

import numpy as np
import pytest

from secagg import Client, Config, Server, encode
from secagg.messages import UnmaskingShares
from secagg.shamir import PRIME


def _round(n: int, t: int, silent: set[int], corrupt: dict[int, set[int]]
           ) -> tuple[Server, dict[int, np.ndarray]]:
    """Run a round where ``corrupt[holder]`` are the owners whose self-mask share that
    holder falsifies, and ``silent`` holders send no unmasking message."""
    config = Config(num_clients=n, threshold=t, dim=6, bits=32)
    rng = np.random.default_rng(n)
    inputs = {i: rng.integers(0, 2**32, 6, dtype=np.uint64) for i in range(1, n + 1)}
    server = Server(config, context=b"blame")
    clients = {i: Client(config, i, v, context=b"blame") for i, v in inputs.items()}
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
    out = server.advance()
    for _ in range(3):
        for cid, msg in out.items():
            reply = clients[cid].handle(encode(msg))
            if isinstance(reply, UnmaskingShares):
                if cid in silent:
                    continue
                seeds = dict(reply.self_mask_shares)
                for owner in corrupt.get(cid, ()):
                    value = (int.from_bytes(seeds[owner], "big") + 7) % PRIME
                    seeds[owner] = value.to_bytes(33, "big")
                reply = UnmaskingShares(reply.session_id, cid, seeds,
                                        reply.masking_key_shares)
            server.receive(cid, encode(reply))
        out = server.advance()
    return server, inputs


@pytest.mark.parametrize(("n", "t", "silent", "corrupt", "named", "unattributable"), [
    # 4 shares, t = 3: no decoding radius at all, so nobody can be named
    (5, 3, {5}, {4: {1}}, {}, {1}),
    # 3 wrong of 10, radius (10 - 6) // 2 = 2: beyond it, unattributable
    (10, 6, set(), {8: {2}, 9: {2}, 10: {2}}, {}, {2}),
    # within the radius: Gao names them
    (9, 5, set(), {2: {1, 3}, 9: {4}}, {2: {1, 3}, 9: {4}}, set()),
    # 2 wrong of 10 (radius 2), one of them among the lowest ids: named
    (10, 6, set(), {1: {5}, 7: {5}}, {1: {5}, 7: {5}}, set()),
])
def test_corrupted_shares_are_named_only_when_attributable_and_the_sum_stays_exact(
        n: int, t: int, silent: set[int], corrupt: dict[int, set[int]],
        named: dict[int, set[int]], unattributable: set[int]) -> None:
    server, inputs = _round(n, t, silent, corrupt)
    result = server.result
    assert result is not None
    expected = sum(inputs[i].astype(object) for i in result.included)
    assert result.total.tolist() == [int(v) % 2**32 for v in expected]
    assert {h: set(o) for h, o in result.corrupt_shares.items()} == named
    assert set(result.unattributable) == unattributable
