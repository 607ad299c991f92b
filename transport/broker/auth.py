"""Who may log in to the embedded broker: scrypt password hashes and login throttling.

The broker keeps only hashes (``$scrypt$ln=14,r=8,p=1$salt$hash``, standard library
``hashlib.scrypt``): a users file holds hashes (``python -m transport.broker hash-password``
prints one), and plaintext passwords handed to :class:`Authenticator` are hashed at once and
forgotten. Failed logins are throttled per (peer address, username), all unknown usernames
of an address sharing one key, see :class:`LoginThrottle`: a correct password is accepted as
soon as it is checked (in a few threads shared fairly among addresses,
:class:`~transport.broker.checks.CheckQueue`), and the answer to a failed attempt comes a
fixed time after its check started (longer than the most expensive hash), plus a delay that
doubles per failure (capped), so its timing does not tell which usernames exist.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import math
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .checks import CheckQueue
from .errors import BrokerConfigError, BrokerError

_PREFIX = "$scrypt$"
DEFAULT_LOG2_N = 14
"""scrypt cost for hashes of human-chosen passwords (about 16 MiB and tens of ms)."""
TOKEN_LOG2_N = 8
"""Cost used for generated random tokens (``secrets.token_urlsafe``): their entropy, not
the hash cost, is what stops guessing, and hundreds of sites log in at once."""
_MAX_LOG2_N = 20


def hash_password(password: str, *, log2_n: int = DEFAULT_LOG2_N,
                  salt: bytes | None = None) -> str:
    """``$scrypt$ln=<log2 N>,r=8,p=1$<salt>$<hash>`` (base64 fields) of ``password``."""
    if not 1 <= log2_n <= _MAX_LOG2_N:
        raise BrokerConfigError(f"scrypt cost log2_n={log2_n}: use 1..{_MAX_LOG2_N}")
    salt = secrets.token_bytes(16) if salt is None else salt
    digest = _scrypt(password.encode(), salt, log2_n)
    return (f"{_PREFIX}ln={log2_n},r=8,p=1${base64.b64encode(salt).decode()}"
            f"${base64.b64encode(digest).decode()}")


def _scrypt(password: bytes, salt: bytes, log2_n: int) -> bytes:
    n = 1 << log2_n
    return hashlib.scrypt(password, salt=salt, n=n, r=8, p=1, dklen=32,
                          maxmem=256 * n * 8 + (1 << 20))


def is_password_hash(value: str) -> bool:
    return value.startswith(_PREFIX)


def _parse(stored: str) -> tuple[int, bytes, bytes]:
    try:
        params, salt, digest = stored[len(_PREFIX):].split("$")
        fields = dict(item.split("=") for item in params.split(","))
        if fields.get("r") != "8" or fields.get("p") != "1":
            raise ValueError("only r=8,p=1 are supported")
        log2_n = int(fields["ln"])
        if not 1 <= log2_n <= _MAX_LOG2_N:
            raise ValueError(f"ln={log2_n} out of range")
        return log2_n, base64.b64decode(salt, validate=True), base64.b64decode(digest,
                                                                               validate=True)
    except (ValueError, KeyError) as exc:
        raise BrokerConfigError(f"malformed password hash {stored[:24]!r}...: {exc}; create "
                                "it with 'python -m transport.broker hash-password'") from None


class Authenticator:
    """Checks username/password pairs against stored hashes (plaintext is hashed at once)."""

    def __init__(self, users: Mapping[str, str], *, log2_n: int = TOKEN_LOG2_N) -> None:
        self._users: dict[str, tuple[int, bytes, bytes]] = {}
        for name, value in users.items():
            stored = value if is_password_hash(value) else hash_password(value, log2_n=log2_n)
            self._users[name] = _parse(stored)
        # An unknown user costs what the most expensive known one does: the answer's timing
        # must not tell which names exist.
        dummy_cost = max((entry[0] for entry in self._users.values()), default=log2_n)
        started = time.perf_counter()
        self._dummy = _parse(hash_password(secrets.token_hex(8), log2_n=dummy_cost))
        self.pad = max(0.05, 2.0 * (time.perf_counter() - started))
        """Seconds after a check starts before its failure may be answered: twice what the
        most expensive hash took at start-up (at least 50 ms), raised to 1.5 times any
        slower check seen since, so a failure's timing does not depend on the user's cost."""

    def __contains__(self, username: str) -> bool:
        return username in self._users

    def __len__(self) -> int:
        return len(self._users)

    def verify(self, username: str | None, password: bytes | None) -> bool:
        """True for a known user with the right password; unknown users cost the same."""
        entry = self._users.get(username or "")
        log2_n, salt, digest = entry if entry is not None else self._dummy
        started = time.perf_counter()
        computed = _scrypt(password or b"", salt, log2_n)
        self.pad = max(self.pad, 1.5 * (time.perf_counter() - started))
        return hmac.compare_digest(computed, digest) and entry is not None and password is not None


class LoginBusy(BrokerError):
    """Too many attempts for one (address, username) are already waiting; refused unchecked."""


@dataclass
class _Key:
    """Throttle state of one (address, username)."""

    failures: int = 0
    last_failure: float = -math.inf
    verifying: int = 0
    held: list[float] = field(default_factory=list)  # a failed attempt's lane, until when
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)
    timer: asyncio.TimerHandle | None = None

    def busy(self, now: float) -> int:
        self.held = [until for until in self.held if until > now]
        return self.verifying + len(self.held)

    def idle(self) -> bool:
        return self.verifying == 0 and not self.waiters


class Attempt:
    """One login attempt holding a lane of its (address, username); run its password check
    with :meth:`check` and report the outcome with :meth:`succeeded` or :meth:`failed`
    (leaving the ``with`` block without either frees the lane at no cost, e.g. when the
    peer is gone before its password is read)."""

    def __init__(self, throttle: LoginThrottle, address: str, key: bytes,
                 entry: _Key) -> None:
        self._throttle, self._address, self._key, self._entry = throttle, address, key, entry
        self._open = True

    async def check(self, verify: Callable[[], bool],
                    wanted: Callable[[], bool] = lambda: True) -> tuple[bool, float]:
        """``verify()`` run in the throttle's :class:`CheckQueue` in this attempt's turn:
        (its result, the loop time it started)."""
        return await self._throttle.checks.run(self._address, self._key, verify, wanted)

    def succeeded(self) -> None:
        self._close(failed=False)

    def failed(self, answer_after: float = -math.inf) -> float:
        """Record the failure; the seconds the answer to it must wait: until
        ``answer_after`` (loop time) or now, whichever is later, plus the key's delay. The
        lane stays held until then."""
        return self._close(failed=True, answer_after=answer_after)

    def _close(self, failed: bool, answer_after: float = -math.inf) -> float:
        if not self._open:
            return 0.0
        self._open = False
        return self._throttle._finish(self._key, self._entry, failed, answer_after)

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close(failed=False)


EVICTION_WINDOW = 64
"""How many of the least recently used idle keys :meth:`LoginThrottle._evict` compares."""


class LoginThrottle:
    """Login attempts per key, (peer address, username) with ``None`` for every unknown
    username of the address: verified as soon as a lane is free, a failed one answered
    late, and only a few at a time.

    An attempt takes one of its key's ``lanes`` lanes before its password is checked, so a
    correct password is accepted as soon as scrypt says so, and at most ``lanes`` checks
    of one key run at once, before its first failure too. A failure holds its lane, and the
    answer to it waits, for a delay that doubles with each failure of the key (``base``, up
    to ``cap``); so a key gets at most ``lanes`` guesses per delay, whether they are sent
    one after another or in parallel, and an attacker guessing one after another leaves a
    lane free for the party whose password it guesses. Attempts beyond the lanes wait; once
    the key has failed, at most ``waiting`` of them (more are refused unchecked,
    :class:`LoginBusy`). Failures under other known usernames, or from other addresses,
    never delay an attempt. A success does not clear the key's failures. The checks
    themselves run in :attr:`checks` (``workers`` threads, ``per_address`` at once for an
    address, served round robin across addresses and keys).

    Keys are 16-byte digests (a long username costs no memory); a key's failures are
    forgotten ``forget`` s after its last one, and at most ``max_keys`` idle keys are kept
    (among the least recently used, those with the fewest failures go first), plus those of
    attempts in progress, which the broker's connection caps bound.
    """

    def __init__(self, base: float, cap: float, *, lanes: int = 2, waiting: int = 2,
                 forget: float = 300.0, max_keys: int = 10_000, workers: int = 2,
                 per_address: int = 1) -> None:
        self.base = base
        self.cap = cap
        self.lanes = lanes
        self.waiting = waiting
        self.forget = forget
        self.max_keys = max_keys
        self.checks = CheckQueue(workers=workers, per_address=per_address)
        self._keys: OrderedDict[bytes, _Key] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    @staticmethod
    def key(address: str, username: str | None) -> bytes:
        """The key of ``username`` (``None``: any unknown username) from ``address``."""
        name = b"\1" if username is None else b"\0" + username.encode("utf-8",
                                                                       "surrogatepass")
        raw = address.encode() + name
        return hashlib.blake2b(raw, digest_size=16, person=b"secagg-login").digest()

    def _delay(self, failures: int) -> float:
        return float(min(self.cap, self.base * 2.0 ** min(failures - 1, 30)))

    def failures(self, address: str, username: str | None) -> int:
        entry = self._keys.get(self.key(address, username))
        return 0 if entry is None else entry.failures

    async def attempt(self, address: str, username: str | None) -> Attempt:
        """A lane for this attempt, after waiting for one if all are taken (``username``
        None for an unknown one)."""
        loop = asyncio.get_running_loop()
        key = self.key(address, username)
        entry = self._keys.get(key)
        if entry is None:
            entry = self._keys[key] = _Key()
        self._keys.move_to_end(key)
        now = loop.time()
        penalised = entry.failures > 0 and now - entry.last_failure <= self.forget
        if not entry.waiters and entry.busy(now) < self.lanes:
            entry.verifying += 1
            self._evict()
            return Attempt(self, address, key, entry)
        if penalised and len(entry.waiters) >= self.waiting:
            self._tidy(key, entry)
            raise LoginBusy("too many login attempts for this username from this address "
                            "are waiting; retry later")
        waiter: asyncio.Future[None] = loop.create_future()
        entry.waiters.append(waiter)
        self._evict()
        self._wake_later(entry)
        try:
            await waiter
        except LoginBusy:
            self._tidy(key, entry)
            raise
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # granted as we were cancelled
                self._finish(key, entry, failed=False)
            else:
                with contextlib.suppress(ValueError):
                    entry.waiters.remove(waiter)
                self._tidy(key, entry)
            raise
        return Attempt(self, address, key, entry)

    def _finish(self, key: bytes, entry: _Key, failed: bool,
                answer_after: float = -math.inf) -> float:
        now = asyncio.get_running_loop().time()
        entry.verifying -= 1
        wait = 0.0
        if failed:
            if now - entry.last_failure > self.forget:
                entry.failures = 0
            entry.failures += 1
            entry.last_failure = now
            wait = max(now, answer_after) - now + self._delay(entry.failures)
            entry.held.append(now + wait)
            while len(entry.waiters) > self.waiting:  # a burst that came before the failure
                refused = entry.waiters.pop()
                if not refused.done():
                    refused.set_exception(LoginBusy(
                        "too many login attempts for this username from this address are "
                        "waiting; retry later"))
        self._wake(entry)
        self._tidy(key, entry)
        return wait

    def _wake(self, entry: _Key) -> None:
        """Give free lanes to the oldest waiters; come back when a held lane frees."""
        loop = asyncio.get_running_loop()
        if entry.timer is not None:
            entry.timer.cancel()  # no-op when it is the timer calling
            entry.timer = None
        while entry.waiters and entry.busy(loop.time()) < self.lanes:
            waiter = entry.waiters.popleft()
            if not waiter.done():
                entry.verifying += 1
                waiter.set_result(None)
        self._wake_later(entry)

    def _wake_later(self, entry: _Key) -> None:
        loop = asyncio.get_running_loop()
        if entry.waiters and entry.timer is None and entry.held:
            entry.timer = loop.call_at(min(entry.held), self._wake, entry)

    def _tidy(self, key: bytes, entry: _Key) -> None:
        now = asyncio.get_running_loop().time()
        forgotten = entry.failures == 0 or now - entry.last_failure > self.forget
        if entry.idle() and forgotten and self._keys.get(key) is entry:
            del self._keys[key]

    def _evict(self) -> None:
        """Keep at most ``max_keys`` idle keys. Among the ``EVICTION_WINDOW`` least recently
        used idle keys the one with the fewest live failures goes first (the oldest of
        equals): a guesser flooding the table with fresh keys from many addresses evicts
        its own one-failure keys before a key it has penalised many times."""
        excess = len(self._keys) - self.max_keys
        if excess <= 0:
            return
        now = asyncio.get_running_loop().time()
        while excess > 0:
            window: list[tuple[int, int, bytes]] = []
            for key, entry in self._keys.items():  # oldest first
                if entry.idle():
                    live = entry.failures if now - entry.last_failure <= self.forget else 0
                    window.append((live, len(window), key))
                    if len(window) == EVICTION_WINDOW:
                        break
            if not window:
                return
            window.sort()
            for _, _, key in window[:excess]:
                del self._keys[key]
            excess -= min(excess, len(window))
