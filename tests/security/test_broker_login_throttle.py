"""The embedded broker's login throttle against a password guesser on the honest parties'
own address (all sites of a simulation on 127.0.0.1, a hospital NAT): honest logins are
not delayed by the guesser's failures, the guessing rate stays throttled, and the throttle
tables stay bounded under a flood of usernames and addresses (transport/broker/auth.py,
docs/deployment.md section 9)."""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import pytest
from adversary import threat
from test_transport_broker import broker, login, run

from tests.transport.mqtt_raw import RawClient, connect_packet
from transport.broker.auth import LoginThrottle

pytestmark = pytest.mark.security

HONEST_BOUND = 2.0  # seconds; an honest login takes milliseconds, this is load margin


async def _guess(port: int, user: str) -> tuple[int, float]:
    """One wrong password for ``user``: (CONNACK code, seconds until the answer)."""
    started = time.monotonic()
    client = await RawClient.open(port)
    client.send(connect_packet(f"{user}-guess", user, "wrong"))
    try:
        code = (await client.connack(15.0))[1]
    finally:
        client.writer.close()
    return code, time.monotonic() - started


async def _hammer(port: int, user: str, answers: list[tuple[int, float]]) -> None:
    """Guess ``user``'s password again and again, each time right after the answer."""
    while True:
        code, took = await _guess(port, user)
        answers.append((code, took))
        if code != 5:
            await asyncio.sleep(0.05)  # refused unchecked: retry at once (kept light here)


def _checks_within(duration: float, base: float, cap: float, lanes: int,
                   failed: int = 0) -> int:
    """How many passwords ``lanes`` lanes can check within ``duration`` seconds, when the
    key has ``failed`` failures already and its k-th failure holds its lane for
    min(cap, base * 2**(k-1))."""
    free = [0.0] * lanes
    k = failed
    while True:
        lane = min(range(lanes), key=free.__getitem__)
        if free[lane] > duration:
            return k - failed
        k += 1
        free[lane] += min(cap, base * 2.0 ** (k - 1))


async def _timed_login(port: int, user: str, client_id: str) -> float:
    started = time.monotonic()
    client = await login(port, user, client_id=client_id)
    took = time.monotonic() - started
    client.disconnect()
    return took


@threat(attack="Password guessing",
        adversary="network attacker",
        controls="parallel wrong passwords for one site's username from the address the "
                 "other sites log in from (127.0.0.1)",
        protocol="the throttle is per (address, username): another username's logins from "
                 "that address are never delayed, while the guessed one gets at most 2 "
                 "checks per doubling delay")
def test_a_parallel_guesser_delays_no_other_users_login_from_its_address() -> None:
    async def scenario() -> None:
        async with broker(login_failure_delay=0.5) as b:
            assert (await _guess(b.port, "site-3"))[0] == 5  # the username is penalised
            answers: list[tuple[int, float]] = []
            started = time.monotonic()
            attackers = [asyncio.create_task(_hammer(b.port, "site-3", answers))
                         for _ in range(8)]
            try:
                honest = []
                for i in range(4):
                    for user in ("site-9", "server"):
                        honest.append(await _timed_login(b.port, user, f"{user}-{i}"))
                    await asyncio.sleep(0.4)
            finally:
                for task in attackers:
                    task.cancel()
                await asyncio.gather(*attackers, return_exceptions=True)
            duration = time.monotonic() - started
            checked = b.stats.auth_failures - 1
            assert max(honest) < HONEST_BOUND, honest
            assert len(answers) >= 20  # the guesser tried many times ...
            assert {code for code, _ in answers} <= {3, 5}
            # ... but its passwords were checked 2 at a time, each failure holding its
            # lane for a doubling delay (1, 2, 4, 5 s ...): 4 checks in the first 3 s
            assert checked <= _checks_within(duration, 0.5, 5.0, 2, failed=1), (
                checked, duration)
            assert checked < len(answers) / 4

    run(scenario, timeout=30)


@threat(attack="Password guessing",
        adversary="network attacker",
        controls="wrong passwords for a site's username, one after another from that "
                 "site's own address, while the site logs in with its right password",
        protocol="a password is checked as soon as a lane of its (address, username) is "
                 "free and only the answer to a failure waits; a guesser waiting for its "
                 "answers holds one lane, so the right password is accepted at once")
def test_a_guesser_waiting_for_its_answers_does_not_delay_the_right_password() -> None:
    async def scenario() -> None:
        async with broker(login_failure_delay=0.25) as b:
            answers: list[tuple[int, float]] = []
            started = time.monotonic()
            attacker = asyncio.create_task(_hammer(b.port, "site-3", answers))
            try:
                await asyncio.sleep(0.3)
                honest = []
                for i in range(4):
                    honest.append(await _timed_login(b.port, "site-3", f"site-3-{i}"))
                    await asyncio.sleep(0.5)
            finally:
                attacker.cancel()
                await asyncio.gather(attacker, return_exceptions=True)
            duration = time.monotonic() - started
            assert max(honest) < HONEST_BOUND, honest
            assert answers and all(code == 5 for code, _ in answers)
            # the answers to the guesses waited 0.25, 0.5, 1, 2 s ...: throttled
            assert len(answers) <= _checks_within(duration, 0.25, 5.0, 1), answers
            assert max(took for _, took in answers) >= 0.9, answers

    run(scenario, timeout=30)


@threat(attack="Exhaust the broker",
        adversary="network attacker",
        controls="failed logins under 10,000 distinct usernames of 4 kB from 10,000 "
                 "addresses",
        protocol="the throttle keeps at most max_keys idle (address, username) pairs, as "
                 "16-byte digests, least recently used first out; the latest is remembered")
def test_the_throttle_table_stays_bounded_under_a_flood_of_names_and_addresses() -> None:
    async def flood() -> tuple[int, int, int]:
        throttle = LoginThrottle(0.25, 5.0, max_keys=1000)
        tracemalloc.start()
        try:
            for i in range(10_000):
                user = f"{i:05d}" + "x" * 4000  # long usernames are not kept
                with await throttle.attempt(f"10.{i % 250}.{i // 250}.1", user) as attempt:
                    assert attempt.failed() == 0.25
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        last = throttle.failures("10.249.39.1", "09999" + "x" * 4000)
        return len(throttle), held, last

    keys, held, last = asyncio.run(flood())
    assert keys == 1000
    assert held < 2_000_000, held  # 10,000 x 4 kB usernames would be 40 MB
    assert last == 1  # the most recent attacker is remembered


@threat(attack="Password guessing",
        adversary="network attacker",
        controls="attempts queued behind a penalised (address, username), one of them "
                 "closed (evicted) while it waits",
        protocol="a waiter that leaves frees its place; the next one gets the lane once "
                 "the failure's hold ends, and the failure count is kept")
def test_a_waiter_that_gives_up_frees_its_place_and_the_next_one_gets_the_lane() -> None:
    async def scenario() -> None:
        throttle = LoginThrottle(0.2, 5.0, lanes=1, waiting=2)
        with await throttle.attempt("127.0.0.1", "site-3") as first:
            assert first.failed() == 0.2  # the pair is penalised; its lane is held 0.2 s
        gone = asyncio.create_task(throttle.attempt("127.0.0.1", "site-3"))
        kept = asyncio.create_task(throttle.attempt("127.0.0.1", "site-3"))
        await asyncio.sleep(0)
        gone.cancel()  # e.g. its connection was evicted while it waited
        await asyncio.gather(gone, return_exceptions=True)
        third = asyncio.create_task(throttle.attempt("127.0.0.1", "site-3"))
        with await asyncio.wait_for(kept, 10.0) as attempt:  # after the 0.2 s hold
            attempt.succeeded()
        with await asyncio.wait_for(third, 10.0) as attempt:
            attempt.succeeded()
        assert throttle.failures("127.0.0.1", "site-3") == 1 and len(throttle) == 1

    asyncio.run(scenario())
