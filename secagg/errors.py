"""The typed errors of the protocol. Errors are part of the interface.

``ProtocolError``  a message was rejected: undecodable, misaddressed, from an unknown
                   sender, out of stage at the server, or otherwise invalid. The object that
                   raised it did not change state because of that message.
``ProtocolAbort``  the round cannot continue safely or cannot finish (too few survivors;
                   a server message from another session or stage, inconsistent with an
                   earlier one, or forged; an unmasking request that would reveal both
                   shares of one peer). The state machine that raised it is now aborted
                   and answers nothing more.

``ProtocolAbort`` subclasses ``ProtocolError`` so that ``except ProtocolError`` catches every
protocol failure. ``CryptoError`` (a key, ciphertext or signature failed validation),
``ShamirError`` (bad sharing parameters or shares) and ``ProtocolError`` share one root,
``SecAggError``: ``except SecAggError`` catches everything the package raises on bad input
(bad configuration is ``ValueError``). ``InputRefused`` (a ``ProtocolError``) and
``InputMismatch`` (a ``ProtocolAbort``) are input validation's (docs/protocol.md 10).
"""

from __future__ import annotations


class SecAggError(Exception):
    """Base class of every error raised by the ``secagg`` package."""


class ProtocolError(SecAggError):
    """A message was rejected. ``stage`` names the stage it was handled in, if known."""

    def __init__(self, message: str, *, stage: object | None = None,
                 client_id: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.client_id = client_id


class DecodeError(ProtocolError):
    """Bytes that are not a well-formed message of this protocol version."""


class ProtocolAbort(ProtocolError):
    """The round was aborted; the state machine that raised it will do nothing more."""


class CryptoError(SecAggError, ValueError):
    """A key, ciphertext or signature failed validation."""


class ShamirError(SecAggError, ValueError):
    """Invalid sharing parameters or shares."""


class StaleSnapshot(ProtocolError):
    """``Client.restore`` refused a snapshot: another session (config, roster or context),
    another client, a wrong key, or bytes that are corrupted or truncated."""


class InputRefused(ProtocolError):
    """A client's input-validation proof failed (docs/protocol.md section 10): its masked
    input is left out of the sum and the client is named (``client_id``,
    ``AggregateResult.refused``)."""


class InputMismatch(ProtocolAbort):
    """After unmasking, the included clients' commitments do not open to the sum: some
    included client masked another vector than the one it proved. Nothing is released, and
    nobody is named: the server cannot tell which client lied without seeing an update
    (docs/protocol.md 10.4, docs/security.md)."""
