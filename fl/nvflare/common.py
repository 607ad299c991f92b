"""What both sides of the NVFlare runtime agree on: task and key names, and the ids a
round setup (:class:`fl.round_setup.RoundSetup`) gives NVFlare's names.

A site is named by its NVFlare client name; the setup's roster holds, per site,
:func:`site_id` of that name (so the session every party derives binds the names), and its
``run_id`` is :func:`run_id` of the NVFlare job id.
"""

from __future__ import annotations

import hashlib

from fl.errors import FLError

STAGE_TASK = "secagg_stage"
"""The task that carries every stage after the first (the first is the job's train task)."""
SETUP_HEADER = "secagg_setup"
"""Shareable header of a train task: the round setup's canonical bytes."""
PAYLOAD = "secagg_payload"
"""Shareable key: a secagg wire message (server -> site, or site -> server)."""
SESSION = "secagg_session"
PROOF = "secagg_proof"
"""Shareable key of a site's masked-input answer in a round with input validation: its
``InputProof`` (secagg wire bytes), which the server checks before the masked input."""
REFUSAL_HEADER = "secagg_refusal"
"""Header of a site's error reply: its public refusal reason (e.g. ``refused by site policy
[exact-release]: ...``), so the server can say which rule and the fix."""
"""Shareable key: the round's session id (every stage message names it)."""


class NVFlareSecAggError(FLError, RuntimeError):
    """The NVFlare runtime refuses: a task that is not part of a secure round this site
    joined, a train result it cannot encode, or a job that is not set up for it."""


def _id(domain: bytes, name: str) -> int:
    return int.from_bytes(hashlib.sha256(domain + name.encode()).digest()[:8], "big") >> 1


def site_id(name: str) -> int:
    """The roster id of the NVFlare site ``name`` (63 bits of SHA-256 of the name)."""
    return _id(b"secagg/nvflare|site|", name)


def run_id(job_id: str) -> int:
    """The setup's run id for the NVFlare job ``job_id``."""
    return _id(b"secagg/nvflare|job|", job_id)


PROJECT_PACKAGES = ("secagg", "transport", "dp", "fl")
"""The project's top-level packages: installed at every party, never shipped in a job."""
