"""A round's nonce N (docs/protocol.md 5.7): fresh, single-use, and never made from bytes,
so no host can run two rounds under one N."""

from __future__ import annotations

import os


class RoundNonce:
    """A round's nonce N (docs/protocol.md 5.7): 32 bytes drawn from ``os.urandom`` when it
    is made, taken by one :class:`Server` only.

    A host that builds the round's public setup before its :class:`Server` (the setup
    carries N to the clients) draws one, relays :attr:`value`, and hands the object to
    ``Server(nonce=...)``. There is no way to make one from given bytes, and a second
    ``Server`` given the same object is refused, so no host can run two rounds under one N
    (a recorded advertisement verifies only under its own N). It cannot be pickled or
    copied into another one: relay :attr:`value`.
    """

    __slots__ = ("_taken", "_value")

    def __init__(self) -> None:
        self._value = os.urandom(32)
        self._taken = False

    @property
    def value(self) -> bytes:
        """N, for the host to relay to the clients (in the round's setup)."""
        return self._value

    def take(self) -> bytes:
        """N, once: the second call raises ``ValueError`` (the nonce was used)."""
        if self._taken:
            raise ValueError("this RoundNonce was already taken by a Server: a nonce is "
                             "single-use; draw a new RoundNonce() for every round")
        self._taken = True
        return self._value

    def __copy__(self) -> RoundNonce:
        return self  # a copy would be a second use of the same N

    def __deepcopy__(self, memo: object) -> RoundNonce:
        return self

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("a RoundNonce is not pickled or stored: relay its .value; the "
                        "Server takes the object itself")

    def __repr__(self) -> str:
        return f"RoundNonce({'taken' if self._taken else 'fresh'})"
