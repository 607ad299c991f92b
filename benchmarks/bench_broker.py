"""Broker throughput: N aiomqtt clients publish M-byte QoS 1 payloads to one subscriber.

Why: a secagg round moves ~0.4-several MB per site per stage through one aggregation
server; this measures how many MB/s each broker sustains in that fan-in shape, next to the
floor of a plain loopback TCP copy of the same bytes (printed as a ratio, per
docs/architecture.md §7), and the broker process's peak RSS.

    python benchmarks/bench_broker.py --clients 20 --size 4194304 --messages 2 [--json]

The embedded broker runs as its own process (``python -m transport.broker``), as the CLI
runs it, so it does not share an event loop or GIL with the clients; Mosquitto is measured
too when installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiomqtt

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from transport.broker.auth import TOKEN_LOG2_N, hash_password  # noqa: E402
from transport.mosquitto import MosquittoBroker, mosquitto_available  # noqa: E402

USERS = {"subscriber": "bench-pw", **{f"pub-{i}": "bench-pw" for i in range(1000)}}
"""One login per client: both brokers bind client ids to usernames."""


@contextmanager
def embedded_process(max_payload: int) -> Iterator[tuple[int, int]]:
    """The embedded broker in a child process (``max_payload`` raised from its 256 KiB
    default to what the benchmark sends); yields its port and pid."""
    with tempfile.TemporaryDirectory() as tmp:
        users_file, port_file = Path(tmp, "users.json"), Path(tmp, "port")
        users_file.write_text(json.dumps({u: hash_password(pw, log2_n=TOKEN_LOG2_N)
                                          for u, pw in USERS.items()}))
        proc = subprocess.Popen(
            [sys.executable, "-m", "transport.broker", "--users-file", str(users_file),
             "--port-file", str(port_file), "--log-level", "WARNING",
             "--max-payload", str(max_payload)],
        )
        try:
            deadline = time.monotonic() + 10
            while not port_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("embedded broker process did not start")
                time.sleep(0.02)
            yield int(port_file.read_text()), proc.pid
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def mosquitto_process(max_payload: int) -> Iterator[tuple[int, int]]:
    with MosquittoBroker(users=USERS, max_payload=max_payload) as broker:
        yield broker.port, broker.pid


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (Linux ``VmHWM``), MiB; NaN where unavailable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


async def fan_in(port: int, clients: int, size: int, messages: int) -> float:
    """Seconds from the first publish until the subscriber has every message."""
    payload = os.urandom(size)
    expected = clients * messages

    def connect(identifier: str) -> aiomqtt.Client:
        return aiomqtt.Client("127.0.0.1", port, username=identifier, password=USERS[identifier],
                              identifier=identifier, timeout=60)

    async with connect("subscriber") as sub:
        await sub.subscribe("bench/#", qos=1)
        publishers = [connect(f"pub-{i}") for i in range(clients)]
        for publisher in publishers:
            await publisher.__aenter__()
        try:
            async def receive() -> None:
                count = 0
                async for message in sub.messages:
                    assert len(message.payload) == size  # type: ignore[arg-type]
                    count += 1
                    if count == expected:
                        return

            async def publish(i: int, publisher: aiomqtt.Client) -> None:
                for m in range(messages):
                    await publisher.publish(f"bench/{i}/{m}", payload, qos=1)

            started = time.perf_counter()
            receiver = asyncio.create_task(receive())
            async with asyncio.timeout(300):
                await asyncio.gather(*(publish(i, p) for i, p in enumerate(publishers)))
                await receiver
            return time.perf_counter() - started
        finally:
            for publisher in publishers:
                await publisher.__aexit__(None, None, None)


def loopback_floor(total: int, chunk: int = 1 << 20) -> float:
    """Seconds to push ``total`` bytes through one loopback TCP connection (the floor)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    block = os.urandom(chunk)

    def sink() -> None:
        conn, _ = server.accept()
        buf = bytearray(chunk)
        with conn:
            while conn.recv_into(buf):
                pass

    thread = threading.Thread(target=sink)
    thread.start()
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as out:
        sent = 0
        while sent < total:
            out.sendall(block)
            sent += chunk
    thread.join()
    server.close()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--size", type=int, default=4 << 20, help="payload bytes")
    parser.add_argument("--messages", type=int, default=2, help="messages per client")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    total = args.clients * args.size * args.messages
    # Through a broker every byte crosses loopback twice (in and out).
    floor = loopback_floor(2 * total)
    results: dict[str, dict[str, float]] = {}
    brokers = {"embedded": embedded_process}
    if mosquitto_available():
        brokers["mosquitto"] = mosquitto_process
    for name, factory in brokers.items():
        with factory(args.size) as (port, pid):
            seconds = asyncio.run(fan_in(port, args.clients, args.size, args.messages))
            peak = peak_rss_mib(pid)
        results[name] = {"seconds": seconds, "mb_per_s": total / seconds / 1e6,
                         "ratio_to_floor": seconds / floor, "peak_rss_mib": peak}
    report = {"clients": args.clients, "size": args.size, "messages": args.messages,
              "total_bytes": total, "floor_seconds": floor, "brokers": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.clients} clients x {args.messages} x {args.size / 1e6:.2f} MB "
          f"-> 1 subscriber ({total / 1e6:.0f} MB), loopback floor {floor:.3f} s")
    for name, row in results.items():
        print(f"  {name:10s} {row['seconds']:7.3f} s  {row['mb_per_s']:8.1f} MB/s  "
              f"{row['ratio_to_floor']:5.1f}x floor  peak RSS {row['peak_rss_mib']:6.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
