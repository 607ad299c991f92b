"""What a site puts on the wire in a round: every byte it publishes is captured on the bus,
and none of it is its plaintext update or its sample count. The masked vector's bytes are
indistinguishable from uniform (chi-square and KS), while the plaintext encoding they hide
fails the same tests badly, so the tests have power."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
from scipy import stats

from fl.coordinator import RoundCapture
from fl.federation import train
from fl.settings import TrainSettings
from secagg import decode
from secagg.crypto import dtype_for_bits
from secagg.messages import MaskedChunk, MaskedInput
from transport.framing import FrameError, Reassembler

pytestmark = pytest.mark.timeout(120)


def _fields(obj: Any) -> list[Any]:
    """Every leaf of a decoded msgpack structure (map keys included)."""
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in (*_fields(k), *_fields(v))]
    if isinstance(obj, (list, tuple)):
        return [x for item in obj for x in _fields(item)]
    return [obj]


def _messages(payloads: list[bytes]) -> list[bytes]:
    """Reassemble framed payloads; unframed ones (control) are returned as they are."""
    assembler = Reassembler(max_message_bytes=1 << 24)
    out = []
    for data in payloads:
        try:
            done = assembler.feed("site", data, 0.0)
        except FrameError:
            out.append(data)
            continue
        if done is not None:
            out.append(done.payload)
    return out


def test_site_bytes_reveal_neither_update_nor_count() -> None:
    published: list[tuple[str, str, bytes]] = []

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        published.append((user, topic, bytes(payload)))
        return [payload]

    captures: list[RoundCapture] = []
    settings = TrainSettings(sites=4, rounds=1, model="mlp", broker="memory", seed=5,
                             alpha=100.0)  # IID: counts near 114, unlike protocol ints
    train(settings, tap=tap, on_capture=captures.append)
    (capture,) = captures
    # The round after the secure scaler's aggregation is the training round: keep only it.
    by_site: dict[int, list[bytes]] = {}
    for user, _, payload in published:
        if user.startswith("site-"):
            by_site.setdefault(int(user[5:]), []).append(payload)
    assert set(by_site) == set(capture.inputs)
    for cid, payloads in by_site.items():
        plain = capture.inputs[cid]
        count = capture.counts[cid]
        assert count not in (capture.config.dim, capture.config.bits, *capture.inputs)
        wire = b"".join(payloads)
        assert plain.tobytes() not in wire
        assert plain[:-1].tobytes()[:64] not in wire  # not even a prefix of the update
        streams: dict[int, dict[int, bytes]] = {}  # dim -> chunk offset -> masked bytes
        width = 0
        for message in _messages(payloads):
            leaves = _fields(msgpack.unpackb(message, raw=True, strict_map_key=False))
            assert count not in [x for x in leaves if isinstance(x, int)]
            assert all(plain.tobytes()[:16] not in x for x in leaves if isinstance(x, bytes))
            try:
                decoded = decode(message)
            except Exception:
                continue
            if isinstance(decoded, (MaskedInput, MaskedChunk)):  # streamed: chunks
                offset = decoded.offset if isinstance(decoded, MaskedChunk) else 0
                streams.setdefault(decoded.dim, {})[offset] = bytes(decoded.masked)
                width = decoded.bits
        parts = streams.get(len(plain))  # the training round's (the scaler's is smaller)
        assert parts, "the site's masked input was not on the wire"
        masked = np.frombuffer(b"".join(parts[o] for o in sorted(parts)),
                               dtype=dtype_for_bits(width))
        assert len(masked) == len(plain)  # the training round's (the scaler's is smaller)
        # No coordinate of the masked vector equals the plaintext one (the count included).
        assert not np.any(masked == plain)
        # Fresh masks every run: a uniform vector fails each of the 8 tests (4 sites) with
        # probability equal to its p-value bound, so 1e-7 (not 1e-4: a false alarm in about
        # 1 of 1,250 runs); the plaintext's p-values stay far below 1e-12.
        byte_counts = np.bincount(np.frombuffer(masked.tobytes(), np.uint8), minlength=256)
        assert stats.chisquare(byte_counts).pvalue > 1e-7
        plain_counts = np.bincount(np.frombuffer(plain.tobytes(), np.uint8), minlength=256)
        assert stats.chisquare(plain_counts).pvalue < 1e-12
        uniform = masked.astype(np.float64) / 2.0**64
        assert stats.kstest(uniform, "uniform").pvalue > 1e-7
        assert stats.kstest(plain.astype(np.float64) / 2.0**64, "uniform").pvalue < 1e-12
