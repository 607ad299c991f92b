"""The embedded broker's login throttle against a password guesser on the honest parties'
own address (all sites of a simulation on 127.0.0.1, a hospital NAT): honest logins are
not delayed by the guesser's failures, the guessing rate stays throttled, and the throttle
tables stay bounded under a flood of usernames and addresses (transport/broker/auth.py,
docs/deployment.md section 9)."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import threading
import time
import tracemalloc
from collections.abc import Callable

import pytest
from adversary import threat
from test_transport_broker import IDS, USERS, broker, login, run

from tests.transport.mqtt_raw import RawClient, connect_packet
from transport.broker import EmbeddedBroker
from transport.broker.auth import TOKEN_LOG2_N, LoginThrottle, hash_password
from transport.broker.checks import CheckQueue
from transport.topics import acl_table

pytestmark = pytest.mark.security

HONEST_BOUND = 2.0  # seconds; an honest login takes milliseconds, this is load margin
ALONE = 2  # logins per user measured before an attack


async def _honest_bound(port: int, users: tuple[str, ...] = ("site-9", "server")) -> float:
    """The bound on an honest login during an attack: ``HONEST_BOUND`` plus four times the
    slowest of the same logins measured before the attack, in the same run (on a loaded
    host a login with no attacker at all can take a good part of a second)."""
    alone = [await _timed_login(port, user, f"{user}-alone-{i}")
             for i in range(ALONE) for user in users]
    return HONEST_BOUND + 4 * max(alone)


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
            bound = await _honest_bound(b.port)
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
                await _stop(attackers)
            duration = time.monotonic() - started
            checked = b.stats.auth_failures - 1
            assert max(honest) < bound, (honest, bound)
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
            bound = await _honest_bound(b.port, ("site-3",))
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
                await _stop([attacker])
            duration = time.monotonic() - started
            assert max(honest) < bound, (honest, bound)
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


# -- the password checks themselves: a budget per address, fair shares, constant answers --


async def _guess_from(source: str, port: int, user: str, timeout: float = 15.0) -> float:
    """One wrong password for ``user`` sent from the local address ``source``; the seconds
    from the CONNECT until its CONNACK 5."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        started = time.monotonic()
        writer.write(connect_packet(f"probe-{source}", user, "wrong"))
        answer = await asyncio.wait_for(reader.readexactly(4), timeout)
        assert answer[3] == 5, answer
        return time.monotonic() - started
    finally:
        writer.close()


async def _junk(source: str, port: int, sent: list[int], wait: float = 0.1) -> None:
    """Wrong passwords under ever new usernames from ``source``, a new connection every
    ``wait`` s, each closed then whether answered or not."""
    while True:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port,
                                                           local_addr=(source, 0))
        except OSError:
            await asyncio.sleep(wait)
            continue
        try:
            writer.write(connect_packet(f"j{len(sent)}", f"junk-{len(sent)}", "x"))
            sent.append(1)
            with contextlib.suppress(asyncio.TimeoutError, OSError, asyncio.IncompleteReadError):
                await asyncio.wait_for(reader.readexactly(4), wait)
        finally:
            writer.close()
        await asyncio.sleep(wait)


async def _stop(tasks: list[asyncio.Task[None]], bound: float = 10.0) -> None:
    """Cancel the attackers, again and again until each has ended, for at most ``bound``
    seconds. Once is not enough: on Python 3.11 ``asyncio.wait_for`` loses a cancellation
    that arrives as its inner read completes, and a flood loop that lost it would go on
    opening connections after the test (a suite once ran 23 minutes past this test's
    bound while it grew to 14 GB)."""
    pending = set(tasks)
    deadline = time.monotonic() + bound
    while pending and time.monotonic() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.2)
    assert not pending, f"{len(pending)} attacker tasks still ran {bound} s after cancel"


def _expensive_users() -> dict[str, str]:
    """The test users plus an operator whose password was hashed by ``hash-password``
    (the default, expensive scrypt cost): an unknown username then costs that much too."""
    return {**USERS, "operator": hash_password("operator's passphrase")}


@threat(attack="Exhaust the broker",
        adversary="network attacker",
        controls="wrong passwords under ever new made-up usernames from one address "
                 "(40 connections at a time, each closed 0.1 s after its CONNECT), against "
                 "a users file with a default-cost (hash-password) entry",
        protocol="all unknown usernames of an address share one throttle key (2 lanes, "
                 "doubling delay) and an address has at most 1 check running: the flood "
                 "gets a few checks and another address's logins are not delayed")
def test_made_up_usernames_from_one_address_cost_a_few_checks_and_delay_no_one() -> None:
    async def scenario() -> None:
        async with EmbeddedBroker(users=_expensive_users(), acl=acl_table(IDS),
                                  login_failure_delay=0.25) as b:
            bound = await _honest_bound(b.port)
            sent: list[int] = []
            started = time.monotonic()
            attackers = [asyncio.create_task(_junk("127.0.0.2", b.port, sent))
                         for _ in range(40)]
            try:
                honest = []
                for i in range(3):
                    await asyncio.sleep(0.5)
                    for user in ("site-9", "server"):
                        honest.append(await _timed_login(b.port, user, f"{user}-{i}"))
            finally:
                await _stop(attackers)
            duration = time.monotonic() - started
            checks = b.throttle.checks
            attacker_checks = checks.performed - len(honest) - 2 * ALONE
            assert max(honest) < bound, (honest, bound)
            assert len(sent) >= 100, len(sent)  # the attacker tried many times ...
            # ... and got the checks of one throttle key: 2 lanes, doubling delays
            assert attacker_checks <= _checks_within(duration, 0.25, 5.0, 2), (
                attacker_checks, duration)
            assert checks.peak_per_address == 1
            assert b.throttle.failures("127.0.0.2", None) == b.stats.auth_failures

    run(scenario, timeout=30)


@threat(attack="Exhaust the broker",
        adversary="network attacker",
        controls="from the address the honest parties log in from (127.0.0.1): made-up "
                 "usernames (40 connections at a time) and parallel wrong passwords for "
                 "a site's username (8 at a time), default-cost hashes",
        protocol="checks are served round robin per address and, within one, per "
                 "throttle key: another username from the attacker's address waits for at "
                 "most a turn of each busy key, not for the attacker's backlog")
def test_a_flood_from_the_honest_parties_address_delays_their_logins_a_bounded_time() -> None:
    async def scenario() -> None:
        async with EmbeddedBroker(users=_expensive_users(), acl=acl_table(IDS),
                                  login_failure_delay=0.25) as b:
            bound = await _honest_bound(b.port)
            sent: list[int] = []
            answers: list[tuple[int, float]] = []
            attackers = [asyncio.create_task(_junk("127.0.0.1", b.port, sent))
                         for _ in range(40)]
            attackers += [asyncio.create_task(_hammer(b.port, "site-3", answers))
                          for _ in range(8)]
            try:
                honest = []
                for i in range(3):
                    await asyncio.sleep(0.5)
                    for user in ("site-9", "server"):
                        honest.append(await _timed_login(b.port, user, f"{user}-{i}"))
            finally:
                await _stop(attackers)
            assert max(honest) < bound, (honest, bound)
            assert len(sent) >= 100 and len(answers) >= 10, (len(sent), len(answers))
            assert b.throttle.checks.peak_per_address == 1
            # the throttle's table holds the address's keys, not one per made-up name
            assert len(b.throttle) <= 5, len(b.throttle)

    run(scenario, timeout=30)


@threat(attack="Password guessing",
        adversary="network attacker",
        controls="40 wrong passwords in parallel for a site's username whose (address, "
                 "username) has never failed",
        protocol="a key's 2 lanes bound its checks before its first failure too: 2 are "
                 "checked, then 2 per doubling delay, and the burst beyond 2 waiting "
                 "attempts is refused unchecked (CONNACK 3) at the first failure")
def test_a_first_burst_of_parallel_guesses_is_throttled_too() -> None:
    async def scenario() -> None:
        async with broker(login_failure_delay=0.2, login_failure_max_delay=1.0) as b:
            started = time.monotonic()
            codes = await asyncio.gather(*(_guess(b.port, "site-3") for _ in range(40)))
            duration = time.monotonic() - started
            checked = [code for code, _ in codes].count(5)
            assert {code for code, _ in codes} <= {3, 5}
            assert checked == b.stats.auth_failures
            assert checked <= _checks_within(duration, 0.2, 1.0, 2), (checked, duration)
            assert checked <= 10  # before the fix: nearly all 40 were checked at once

    run(scenario, timeout=30)


@threat(attack="Username enumeration",
        adversary="network attacker",
        controls="one wrong password each for an existing site username (cheap token "
                 "hash) and for an unknown one (costs what the default-cost operator hash "
                 "costs), sent at the same moment from fresh addresses",
        protocol="a failure is answered a fixed time after its check started (twice the "
                 "most expensive hash, at least 50 ms) plus its delay, whatever the user's "
                 "hash cost")
def test_a_failure_is_answered_after_the_same_time_for_known_and_unknown_users() -> None:
    async def scenario() -> None:
        users = {"site-1": hash_password("token", log2_n=TOKEN_LOG2_N),
                 "operator": hash_password("operator's passphrase", log2_n=15)}
        async with EmbeddedBroker(users=users, login_failure_delay=0.25) as b:
            expensive = min(_time(lambda: b.auth.verify("nobody", b"x")) for _ in range(3))
            pad = b.auth.pad
            gaps, answers = [], []
            for i in range(6):
                known, unknown = await asyncio.gather(
                    _guess_from(f"127.0.{i}.2", b.port, "site-1"),
                    _guess_from(f"127.0.{i}.3", b.port, "nobody"))
                gaps.append(unknown - known)
                answers += [known, unknown]
            assert min(answers) >= pad + 0.25 - 0.01, (answers, pad)
            # without the padding the unknown name's answer comes a whole expensive hash
            # (2 to 500 times the token's) later
            assert abs(statistics.median(gaps)) < expensive / 2, (gaps, expensive)

    run(scenario, timeout=30)


def _time(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


@threat(attack="Exhaust the broker",
        adversary="network attacker",
        controls="100 password checks queued from one address, then one from another "
                 "address and one under another username from the first address",
        protocol="the checks run in 2 threads, at most 1 at a time per address, served "
                 "round robin across addresses and, within one, across throttle keys")
def test_password_checks_are_shared_round_robin_across_addresses_and_usernames() -> None:
    async def scenario() -> tuple[list[str], int]:
        queue = CheckQueue(workers=2, per_address=1)
        started: list[str] = []
        running = [0, 0]  # now, peak

        # The flood's checks wait until the three other logins are queued: on a loaded
        # host the first flood check could otherwise end, and hand its thread to the
        # flood's next one, before the "same" login had even asked (a later arrival).
        queued = threading.Event()

        def check(tag: str) -> Callable[[], bool]:
            def run_check() -> bool:
                if tag == "flood":
                    queued.wait(30)
                started.append(tag)
                running[0] += 1
                running[1] = max(running)
                time.sleep(0.005)
                running[0] -= 1
                return False
            return run_check

        flood = [asyncio.create_task(queue.run("10.0.0.2", b"unknown", check("flood")))
                 for _ in range(100)]
        await asyncio.sleep(0)
        other = asyncio.create_task(queue.run("10.0.0.1", b"site-9", check("other")))
        same = asyncio.create_task(queue.run("10.0.0.2", b"site-1", check("same")))
        gone = asyncio.create_task(queue.run("10.0.0.2", b"site-2", check("gone"),
                                             wanted=lambda: False))
        await asyncio.sleep(0)  # each has asked for its turn
        queued.set()
        results = await asyncio.gather(*flood, other, same, gone, return_exceptions=True)
        assert isinstance(results[-1], ConnectionAbortedError)  # never run
        assert len(queue) == 0 and queue.performed == 102
        return started, running[1]

    started, peak = asyncio.run(scenario())
    assert "gone" not in started and len(started) == 102
    assert started.index("other") <= 2, started[:5]  # the next free thread
    assert started.index("same") <= 3, started[:5]  # the first address's next turn
    assert peak <= 2


@threat(attack="Password guessing",
        adversary="network attacker",
        controls="one username guessed three times, then one failed login from each of "
                 "1,000 other addresses to push its penalty out of a 100-key table",
        protocol="among the least recently used idle keys the one with the fewest failures "
                 "is evicted first: the flood evicts its own one-failure keys and the "
                 "guessed key keeps its penalty")
def test_a_flood_of_fresh_addresses_does_not_flush_a_penalised_key() -> None:
    async def flood() -> tuple[int, int]:
        throttle = LoginThrottle(0.001, 0.002, max_keys=100)
        for _ in range(3):
            with await throttle.attempt("10.0.0.1", "site-3") as attempt:
                attempt.failed()
            await asyncio.sleep(0.01)  # the failure's hold ends
        for i in range(1000):
            with await throttle.attempt(f"10.1.{i // 250}.{i % 250}", "site-3") as attempt:
                attempt.failed()
        return throttle.failures("10.0.0.1", "site-3"), len(throttle)

    penalty, keys = asyncio.run(flood())
    assert penalty == 3 and keys == 100
