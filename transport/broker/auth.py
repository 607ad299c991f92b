"""Who may log in to the embedded broker: scrypt password hashes and login throttling.

The broker keeps only hashes (``$scrypt$ln=14,r=8,p=1$salt$hash``, standard library
``hashlib.scrypt``): a users file holds hashes (``python -m transport.broker hash-password``
prints one), and plaintext passwords handed to :class:`Authenticator` are hashed at once and
forgotten. Failed logins are throttled per (peer address, username) and per peer address:
each failure doubles the wait before that key's next attempt is even checked, up to a cap.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from .errors import BrokerConfigError

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
        self._dummy = _parse(hash_password(secrets.token_hex(8), log2_n=log2_n))

    def __contains__(self, username: str) -> bool:
        return username in self._users

    def __len__(self) -> int:
        return len(self._users)

    def verify(self, username: str | None, password: bytes | None) -> bool:
        """True for a known user with the right password; unknown users cost the same."""
        entry = self._users.get(username or "")
        log2_n, salt, digest = entry if entry is not None else self._dummy
        computed = _scrypt(password or b"", salt, log2_n)
        return hmac.compare_digest(computed, digest) and entry is not None and password is not None


class LoginThrottle:
    """Exponential delay per key after failed logins; keys are forgotten after ``forget`` s.

    Bounded: at most ``max_keys`` keys are remembered (the oldest go first).
    """

    def __init__(self, base: float, cap: float, *, forget: float = 300.0,
                 max_keys: int = 10_000) -> None:
        self.base = base
        self.cap = cap
        self.forget = forget
        self.max_keys = max_keys
        self._keys: OrderedDict[object, tuple[int, float]] = OrderedDict()

    def wait(self, keys: Iterable[object], now: float) -> float:
        """Seconds before an attempt under ``keys`` may be checked (0 when none failed)."""
        worst = 0.0
        for key in keys:
            entry = self._keys.get(key)
            if entry is not None:
                worst = max(worst, entry[1] - now)
        return worst

    def failed(self, keys: Iterable[object], now: float) -> None:
        for key in keys:
            count, until = self._keys.pop(key, (0, now))
            if now - until > self.forget:
                count = 0
            count += 1
            delay = min(self.cap, self.base * (2 ** min(count - 1, 30)))
            self._keys[key] = (count, max(until, now) + delay)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def succeeded(self, key: object) -> None:
        self._keys.pop(key, None)
