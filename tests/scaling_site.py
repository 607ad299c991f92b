"""A malicious site for the runtimes' input-validation tests: it scales its update.

:class:`ScalingSession` is the site session (:mod:`fl.site.session`) of a site that runs
modified code: it trains and encodes like an honest site, then, when asked for its masked
input, multiplies the vector it masks by ``scale`` (the model-replacement attack: its
update times the inverse of its weight and more). In a round with input validation it
sends the best proof it can make for the scaled vector: the honest proof if the scaled
vector is within the bound (so a bound set too loose lets it through), else the honest
prover's core, ``prove_relation``, with the slack forced (no honest prover makes it),
which the server refuses. Every runtime builds its session through one hook
(``NodeOptions.session`` for a Flower node, ``SecAggExecutor.session`` for an NVFlare
site), so the same attacker runs in each.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fl.site.session import SiteSession
from secagg import Client, MaskedStream, encode
from secagg.crypto import dtype_for_bits
from secagg.messages import InputProof
from secagg.validation import NormStatement, blinding, norm


def scale_masked_input(client: Client, stream: MaskedStream, scale: float
                       ) -> tuple[bytes | None, Any]:
    """The attacker's answer to the masked-input request: (its proof or None, the masked
    input of its vector times ``scale``, each coordinate rounded towards zero)."""
    cfg = client.config
    scaled = np.array([int(v * scale) if isinstance(scale, float) else v * scale
                       for v in norm.centered(stream._input, cfg.bits)],
                      dtype=object) % cfg.modulus
    # the vector the stream masks is replaced (a restored client's input may be a read-only
    # view of its snapshot)
    stream._input = scaled.astype(dtype_for_bits(cfg.bits))
    secret = stream._input
    proof = None
    if cfg.norm_bound is not None:
        shared = client._state.shared  # type: ignore[attr-defined]
        statement = NormStatement(client.session_id, client.client_id, cfg.dim, cfg.bits,
                                  cfg.norm_bound, shared.adverts[client.client_id])
        blind = blinding((bytes(key), added) for key, added in stream._keys)
        try:  # within the bound (a bound set too loose) the honest proof passes ...
            made = norm.prove(statement, secret, blind)
        except ValueError:  # ... beyond it, the best it can do: the slack forced to 0
            witness = norm.centered(secret, cfg.bits) + [0] * norm.SLACK
            made = norm.prove_relation(statement, witness, blind)
        proof = encode(InputProof(client.session_id, client.client_id, made))
    return proof, stream.whole()


class ScalingSession(SiteSession):
    """The site session of a site that scales its masked input by ``scale``."""

    scale: float = 1000

    def answer_with_proof(self, client: Client, payload: bytes, charge: int
                          ) -> tuple[bytes | None, Any]:
        reply = client.stream(payload)
        if isinstance(reply, MaskedStream):
            return scale_masked_input(client, reply, self.scale)
        return None, reply


def scaling(session: SiteSession) -> ScalingSession:
    """``session`` (an honest site's) turned into the scaling attacker's."""
    evil = ScalingSession.__new__(ScalingSession)
    evil.__dict__.update(session.__dict__)
    return evil
