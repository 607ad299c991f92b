"""The root of every error the ``fl`` layer raises: ``except FLError`` catches them all.
Subclasses keep ``ValueError``/``RuntimeError`` mix-ins where callers relied on them; the
privacy layer's refusals stay ``dp.PrivacyError`` (a roster refusal is both)."""

from __future__ import annotations

from typing import Any


class FLError(Exception):
    """A federated-learning failure: bad data or options, a checkpoint, an encoding that
    would overflow, a round that failed, a Flower setup or reply refused."""


class NothingReleased(FLError, RuntimeError):
    """A run ended without any round releasing anything (every round aborted or was not
    run): an untrained model is not a result. The message names the rule the sites refused
    on and the fix, when they said one."""


class RunFailed(FLError, RuntimeError):
    """A training run stopped on a failure after ``report["rounds"]`` completed rounds: the
    caller writes that report and model (``fl/cli/train.py``, for ``--role all`` as for
    ``--role coordinator``) and exits 1; ``then`` says how to go on. A checkpoint that
    cannot be written (a full disk) is one of these, not a usage error."""

    def __init__(self, failure: Exception, report: dict[str, Any], then: str = "") -> None:
        done = len(report["rounds"])
        notes = ([f"the report and model of the {done} completed rounds are written"]
                 if done else []) + ([then] if then else [])
        super().__init__(f"{failure}" + (f" ({'; '.join(notes)})" if notes else ""))
        self.failure = failure
        self.report = report
