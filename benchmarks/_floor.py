"""The physical floor every benchmark is compared with, measured in the same run:
AES-128-CTR keystream (the mask PRG) into a preallocated buffer (one cipher per key, as
masks need),
the modular vector additions, and X25519 exchanges (docs/architecture.md section 7)."""

from __future__ import annotations

import os
import time

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes


def best_of(fn, repeat: int = 3) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def keystream_seconds(count: int, dim: int, itemsize: int = 4, repeat: int = 3) -> float:
    """``count`` keystreams of ``dim`` elements plus ``count`` in-place uint adds."""
    nbytes = dim * itemsize
    zeros = bytes(nbytes)
    buffer = bytearray(nbytes + 15)
    view = np.frombuffer(buffer, dtype=f"<u{itemsize}", count=dim)
    acc = np.zeros(dim, dtype=f"<u{itemsize}")
    keys = [os.urandom(16) for _ in range(min(count, 64))]

    def run() -> None:
        for i in range(count):
            enc = Cipher(algorithms.AES(keys[i % len(keys)]), modes.CTR(bytes(16))).encryptor()
            enc.update_into(zeros, buffer)
            np.add(acc, view, out=acc)

    return best_of(run, repeat)


def x25519_seconds(count: int) -> float:
    me = X25519PrivateKey.generate()
    peers = [X25519PrivateKey.generate().public_key() for _ in range(min(count, 64))]

    def run() -> None:
        for i in range(count):
            me.exchange(peers[i % len(peers)])

    return best_of(run)


def floor_seconds(keystreams: int, dim: int, exchanges: int, itemsize: int = 4) -> float:
    return keystream_seconds(keystreams, dim, itemsize) + x25519_seconds(exchanges)


def scaled_keystream_seconds(count: int, dim: int, itemsize: int = 4,
                             window: int = 1 << 22) -> float:
    """``keystream_seconds`` for vectors larger than memory should hold twice: measured
    over a ``window`` of elements (how a streamed masked input expands its masks, each
    window with its own cipher) and scaled to ``dim``, since the cost is linear in it."""
    window = min(window, dim)
    return keystream_seconds(count, window, itemsize, repeat=5) * dim / window


def socket_copy_seconds(nbytes: int, sample: int = 256 << 20) -> float:
    """One copy of ``nbytes`` through a localhost TCP socket (send, kernel, receive into a
    preallocated buffer), measured over ``sample`` bytes and scaled: the transport's floor
    per hop (a masked input crosses two: client -> broker -> server)."""
    import socket
    import threading

    sample = min(sample, nbytes)
    piece = 4 << 20
    payload = memoryview(bytes(min(piece, sample)))
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    sink = bytearray(piece)

    def drain(conn: socket.socket) -> None:
        got = 0
        view = memoryview(sink)
        while got < sample:
            n = conn.recv_into(view, min(piece, sample - got))
            if not n:
                return
            got += n

    def run() -> None:
        with socket.create_connection(("127.0.0.1", port)) as sender:
            conn, _ = server.accept()
            with conn:
                reader = threading.Thread(target=drain, args=(conn,))
                reader.start()
                sent = 0
                while sent < sample:
                    chunk = payload[:min(len(payload), sample - sent)]
                    sender.sendall(chunk)
                    sent += len(chunk)
                reader.join()

    try:
        seconds = best_of(run, 5)
    finally:
        server.close()
    return seconds * nbytes / sample
