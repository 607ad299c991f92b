"""Who may log in to the embedded broker: scrypt password hashes and login throttling.

The broker keeps only hashes (``$scrypt$ln=14,r=8,p=1$salt$hash``, standard library
``hashlib.scrypt``): a users file holds hashes (``python -m transport.broker hash-password``
prints one), and plaintext passwords handed to :class:`Authenticator` are hashed at once and
forgotten. Failed logins are throttled per peer address: after a failure, attempts from
that address are spaced out (parallel ones too), each failure doubling the spacing up to a
cap; an unknown username costs as much time as a known one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections import OrderedDict
from collections.abc import Mapping

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
        # An unknown user costs what the most expensive known one does: the answer's timing
        # must not tell which names exist.
        dummy_cost = max((entry[0] for entry in self._users.values()), default=log2_n)
        self._dummy = _parse(hash_password(secrets.token_hex(8), log2_n=dummy_cost))

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
    """Exponential spacing of login attempts per key (a peer address) after failures.

    Every attempt under a key with failures books the next free time for that key, so
    parallel guesses are spaced out like sequential ones; each failure doubles the spacing
    up to ``cap``. A success does not clear it (an attacker with one valid login could
    otherwise reset its own penalty); keys are forgotten ``forget`` s after their last
    booking, and at most ``max_keys`` are remembered (the oldest go first).
    """

    def __init__(self, base: float, cap: float, *, forget: float = 300.0,
                 max_keys: int = 10_000) -> None:
        self.base = base
        self.cap = cap
        self.forget = forget
        self.max_keys = max_keys
        self._keys: OrderedDict[object, tuple[int, float]] = OrderedDict()

    def _delay(self, failures: int) -> float:
        return float(min(self.cap, self.base * 2.0 ** min(failures - 1, 30)))

    def admit(self, key: object, now: float) -> float:
        """Seconds this attempt must wait before it is read (0 without failures)."""
        entry = self._keys.get(key)
        if entry is None:
            return 0.0
        failures, next_at = entry
        if now - next_at > self.forget:
            del self._keys[key]
            return 0.0
        at = max(now, next_at)
        self._keys[key] = (failures, at + self._delay(failures))
        return at - now

    def failed(self, key: object, now: float) -> None:
        failures, next_at = self._keys.pop(key, (0, now))
        failures += 1
        self._keys[key] = (failures, max(next_at, now + self._delay(failures)))
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
