"""One site session: the join and answer sequence every runtime runs (docs/architecture.md
section 10; docs/privacy.md section 1, "One site session").

A runtime (the Flower mod, the NVFlare executor, the ``secagg train --role site`` process,
the next one) hands a :class:`SiteSession` the round's description and its I/O, and keeps only
its transport and where its state lives. The sequence is written here once, in this order,
and every runtime calls these methods in it:

1. **join** (:meth:`SiteSession.join`): parse the setup (:class:`fl.round_setup.RoundSetup`)
   and **check the run** it names; **identity**: the site's place in the roster and, in
   malicious mode, its own verify key and only enrolled keys
   (:func:`fl.round_reply.check_identity`); **layout**: the arrays sent have the setup's
   layout, the release is one the site can encode (:func:`fl.round_reply.round_release`),
   plus the runtime's own limits (``check_setup``). The site role's announcements carry its
   own task (:class:`fl.contribution.RoundTask`: per-patient sampling, site DP, adaptive
   clipping, the feature statistics, SCAFFOLD); it parses and checks them itself
   (:func:`fl.remote.inputs.site_round`) and hands :meth:`SiteSession.admit` their
   :class:`Terms`, the narrow hook :meth:`SiteSession.join` ends in too;
2. **admit** (:meth:`SiteSession.admit`): the site core (mandatory) checks the protocol
   margins, the replay rule refuses a round joined before, an unfinished earlier round is
   abandoned, and the release is checked against the operator's policy and charged,
   write-ahead, to the ledger (:mod:`fl.site.core`); it returns an :class:`Admitted` round;
3. **train**: the runtime's I/O (the Flower mod's ``call_next``, the NVFlare trainer, the
   site role's :func:`fl.contribution.site_input`), only after the round is admitted;
4. **encode** (:meth:`SiteSession.encode`, :func:`fl.round_reply.encode_reply`; the site
   role's vector comes encoded from its task);
5. **advertise** (:meth:`SiteSession.advertise`, over :meth:`SiteSession.client`, which the
   site role calls at ``go``): the round's ``secagg.Client`` on the encoded input. The
   Flower node advertises first and runs steps 3-4 at the masked-input request, giving the
   client its input then (``Client.provide_input``; the arrays it trains from arrive with
   that request and are checked against the setup first, :meth:`SiteSession.check_sent`),
   so its ``Context`` carries no model-sized vector between messages; the charge is still
   made at step 2, before any training;
6. **answer** (:meth:`SiteSession.answer`, :meth:`SiteSession.answer_with_proof`; the site
   role's ``transport.ClientDriver`` answers on the same client);
7. **erase / withdraw** (:meth:`SiteSession.end`, :meth:`SiteSession.abandon`): the runtime
   drops the round's secrets, and the charge is withdrawn when the masked input never
   existed.

Two rules hold in every runtime because they are written here once:

* **Replay** (:meth:`SiteSession.admit`): a round is joined once. Its charge is labelled
  with its key (the secure-aggregation session id, or the site role's announcement), and a
  second join of a key the ledger already holds -- charged or withdrawn, before or after a
  restart -- is refused (:class:`Replayed`) before anything is charged or trained.
* **Withdrawal** (:meth:`SiteSession.not_sent`): a charge is withdrawn exactly when the
  site's masked input never left it for a reason that does not depend on its data: the
  round aborted, was abandoned for a newer one, or was refused at ``go`` before the masked
  input existed. A refusal of the site's own computation (its training or encoding failed)
  keeps the charge: the refusal itself may depend on the data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from dp import Charge
from fl.errors import FLError
from fl.round_reply import check_identity, encode_reply, round_release
from fl.round_setup import RoundSetup, SetupError, encoded_dim
from fl.site.core import SiteCore
from secagg import Client, Config, MaskedStream, ProtocolAbort, Stage, encode
from secagg.messages import MaskedInput
from secagg.session import derive_session_id

F64 = npt.NDArray[np.float64]
U64 = npt.NDArray[np.uint64]
Log = Callable[[str], None]


class Replayed(FLError, RuntimeError):
    """The site already joined this round (same key): a round is joined once."""


def _key_text(key: bytes | str) -> str:
    return key.hex() if isinstance(key, bytes) else str(key)


def label_of(what: str, key: bytes | str) -> str:
    """The ledger label of a round: ``what`` (human) and the round's key (the replay rule
    finds it there)."""
    return f"{what} [key {_key_text(key)}]"


def joined(core: SiteCore, key: bytes | str) -> bool:
    """Whether the site's ledger already holds a charge (active or withdrawn) of ``key``
    (:func:`label_of`'s label; the ledger keeps its round keys in a set)."""
    return core.ledger.holds_key(_key_text(key))


def refuse_replay(core: SiteCore, key: bytes | str, what: str) -> None:
    """The replay rule: :class:`Replayed` when the ledger holds a charge of ``key``."""
    if joined(core, key):
        raise Replayed(f"this site already joined this round ({what}); a round is joined "
                       "once, a replayed setup is neither charged nor trained")


@dataclass(frozen=True)
class Terms:
    """A round's public terms as the session admits it, in any runtime's vocabulary (the hook
    :meth:`SiteSession.admit` takes; :meth:`SiteSession.join` builds them from a
    :class:`~fl.round_setup.RoundSetup`).

    ``key``: the round's key (the replay rule's; a secure-aggregation session id, or the site
    role's announcement); ``what``: the round in the ledger's label; ``charge``: the
    write-ahead charge of the round's release, given the site's core and the round's label
    (raises :class:`dp.policy.PolicyRefused`); ``authenticated``: whether the round's roster
    is authenticated by keys the operator enrolled (None: the core's own setting stands)."""

    key: bytes | str
    what: str
    num_clients: int
    threshold: int
    neighbors: int | None
    security: str
    charge: Callable[[SiteCore, str], Charge]
    authenticated: bool | None = None


@dataclass
class Admitted:
    """A round the session admitted and charged (what a runtime keeps until it ends)."""

    key: bytes | str
    charge: int
    """The ledger id of the round's charge (:meth:`SiteSession.end` withdraws it)."""


@dataclass
class Joined(Admitted):
    """A round setup the session joined and charged (what a runtime keeps until it
    advertises)."""

    setup: RoundSetup
    client_id: int
    config: Config
    sent: F64 | None
    identity: dict[str, Any] = field(default_factory=dict)

    @property
    def session_id(self) -> bytes:
        assert isinstance(self.key, bytes)
        return self.key


class SiteSession:
    """One site's session over a runtime (module docstring).

    The site's core (mandatory), one of: ``open_core``, which opens it per use (its
    operator's policy and ledger; the ledger's lock is held only while a round is admitted
    or withdrawn), or ``core``, a core the runtime holds open for its life (the site role).
    ``runtime``: its name in the ledger's labels; ``signing_key``/``trusted_keys``: the
    site's identity and its operator's enrolled keys (malicious mode); ``check_setup``: the
    runtime's own limits on a setup (e.g. what Flower can move between messages), called
    before anything is charged."""

    def __init__(self, open_core: Callable[[], SiteCore] | None = None, *, runtime: str,
                 core: SiteCore | None = None, signing_key: Any = None,
                 trusted_keys: frozenset[bytes] = frozenset(),
                 check_setup: Callable[[RoundSetup, Config], None] | None = None,
                 log: Log | None = None) -> None:
        if (open_core is None) == (core is None):
            raise TypeError("a site session runs over its site core: give exactly one of "
                            "open_core (opened per round) and core (held by the runtime)")
        if core is not None and not isinstance(core, SiteCore):
            raise ValueError(f"a site session's core must be a fl.site.core.SiteCore, got "
                             f"{type(core).__name__}")
        self.open_core = open_core
        self.core = core
        self.runtime = runtime
        self.signing_key = signing_key
        self.trusted_keys = trusted_keys
        self.check_setup = check_setup
        self.log = log or (lambda text: None)

    @contextlib.contextmanager
    def _held(self, core: SiteCore | None = None) -> Iterator[SiteCore]:
        """The site's core for one step: ``core`` or the one the runtime holds, else opened
        and closed around the step."""
        held = core or self.core
        if held is not None:
            yield held
            return
        assert self.open_core is not None
        opened = self.open_core()
        try:
            yield opened
        finally:
            opened.close()

    # -- 1-2. join and admit --------------------------------------------------------------
    def join(self, raw: object, *, run_id: int, node_id: int,
             sent: Callable[[RoundSetup], F64] | None,
             previous: tuple[int, int | None] | None = None,
             erase: Callable[[], None] | None = None) -> Joined:
        """Parse and check the setup, then admit and charge the round (raises
        :class:`fl.round_setup.SetupError`, :class:`Replayed` or
        :class:`dp.policy.PolicyRefused`); the runtime trains only after this returns.
        ``sent``: the arrays the runtime received, flattened in the setup's layout (raising
        ``ValueError`` when they do not match it); None when they arrive later, with the
        masked-input request (the Flower node: :meth:`check_sent` there, before it trains).
        ``previous``: the unfinished round this
        one replaces (its charge id and the last stage the site answered in it, None if it
        never advertised): once the new setup is known not to be a replay, that round is
        abandoned (:meth:`abandon`) before the new one is charged. ``erase``: the runtime's
        way to forget that round; called in the same step, before its charge is withdrawn,
        so a withdrawn round can answer nothing more even when the new setup is refused
        (tests/security/test_review_session_refused_replacement.py)."""
        setup = RoundSetup.from_bytes(raw)
        if setup.run_id != run_id:
            raise SetupError(f"the setup names run {setup.run_id}; this site is in run "
                             f"{run_id}")
        client_id = setup.client_id(node_id)
        if setup.security == "malicious" and self.signing_key is None:
            raise SetupError("a malicious-mode round needs this site's signing key")
        identity = check_identity(setup, client_id, self.signing_key, self.trusted_keys)
        config = setup.config(encoded_dim(setup))
        arrays = None if sent is None else self.check_sent(setup, sent)
        release = round_release(setup)  # refuses a setup whose encoding cannot hold it
        if self.check_setup is not None:
            self.check_setup(setup, config)
        session_id = derive_session_id(config, tuple(range(1, setup.num_clients + 1)),
                                       setup.context())
        admitted = self.admit(Terms(
            session_id, f"{self.runtime} run {setup.run_id} round {setup.server_round}",
            num_clients=setup.num_clients, threshold=setup.threshold,
            neighbors=setup.neighbors, security=setup.security,
            charge=lambda core, label: core.admit(release(core.policy),
                                                  secagg_threshold=setup.threshold,
                                                  label=label),
            authenticated=setup.security == "malicious"),  # enrolled keys only
            previous, erase)
        return Joined(admitted.key, admitted.charge, setup, client_id,
                      config, arrays if setup.privacy.relative else None, identity)

    @staticmethod
    def check_sent(setup: RoundSetup, sent: Callable[[RoundSetup], F64]) -> F64:
        """The arrays the runtime received (``sent``, flattened in the setup's layout),
        or :class:`fl.round_setup.SetupError` when they do not have the setup's layout."""
        try:
            return sent(setup)
        except ValueError as exc:
            raise SetupError(f"the arrays sent do not match the round setup: {exc}") from None

    def admit(self, terms: Terms, previous: tuple[int, int | None] | None = None,
              erase: Callable[[], None] | None = None) -> Admitted:
        """The join's privacy gate, in the same order in every runtime, before anything of
        the site's data is computed (a runtime whose rounds are not a
        :class:`~fl.round_setup.RoundSetup`, the site role, calls it with its own
        :class:`Terms` once it parsed and checked its task): the protocol parameters
        against the site's own margins (:meth:`fl.site.core.SiteCore.check_protocol`), the
        replay rule, the unfinished round ``previous`` abandoned (its charge id and last
        stage, see :meth:`join`), then the write-ahead charge (``terms.charge``, given the
        round's label). Raises :class:`dp.policy.PolicyRefused` or :class:`Replayed`;
        nothing is charged then."""
        with self._held() as core:
            if terms.authenticated is not None:
                core.authenticated_roster = terms.authenticated
            core.check_protocol(num_clients=terms.num_clients, threshold=terms.threshold,
                                neighbors=terms.neighbors, security=terms.security)
            refuse_replay(core, terms.key, terms.what)
            if previous is not None:
                if erase is not None:  # first: a refused new setup leaves nothing to answer
                    erase()
                self.abandon(previous[1], previous[0], "replaced by a newer round's setup "
                             "before its masked input existed", core)
            charge = terms.charge(core, label_of(terms.what, terms.key))
        return Admitted(terms.key, charge.id)

    # -- 4. encode --------------------------------------------------------------------------
    def encode(self, joined: Joined, arrays: F64, metrics: Mapping[str, float],
               weight: float) -> U64:
        """The site's secure-aggregation input from its trained arrays (with its noise share
        under distributed DP, :func:`fl.round_reply.encode_reply`)."""
        return encode_reply(joined.setup, arrays, dict(metrics), weight, joined.sent)

    # -- 5. advertise -------------------------------------------------------------------------
    def client(self, client_id: int, vector: U64 | None, *, config: Config,
               roster: Iterable[int], context: bytes, nonce: bytes = b"",
               identity: Mapping[str, Any] | None = None) -> Client:
        """The round's ``secagg.Client`` on the encoded input (None: given later, at the
        masked-input request, ``Client.provide_input``), with the site's identity
        (``identity``: :func:`fl.round_reply.check_identity`'s keys in malicious mode)."""
        return Client(config, client_id, vector, roster=roster, context=context, nonce=nonce,
                      **dict(identity or {}))

    def advertise(self, joined: Joined, vector: U64 | None) -> tuple[Client, bytes]:
        """Start the round's client on the encoded input (None: the runtime trains at the
        masked-input request and gives it then, ``Client.provide_input``, as the Flower
        node does): its public-key advertisement is the only reply."""
        setup = joined.setup
        client = self.client(joined.client_id, vector, config=joined.config,
                             roster=range(1, setup.num_clients + 1), context=setup.context(),
                             nonce=setup.nonce, identity=joined.identity)
        return client, encode(client.advertise())

    # -- 6. answer ----------------------------------------------------------------------------
    def answer(self, client: Client, payload: bytes, charge: int) -> Any:
        """The client's answer to one stage message; on a protocol abort before its masked
        input existed the round's charge is withdrawn (the caller erases the round)."""
        try:
            return client.handle(payload)
        except ProtocolAbort as exc:
            self.abandon(client, charge, f"the round aborted: {exc}")
            raise

    def answer_with_proof(self, client: Client, payload: bytes, charge: int
                          ) -> tuple[bytes | None, Any]:
        """:meth:`answer`, and in a round with input validation (the setup's ``norm_bound``,
        docs/protocol.md 10) the encoded ``InputProof`` the runtime sends before the masked
        input it answers (None otherwise, and for every other stage)."""
        message = self.answer(client, payload, charge)
        if client.config.norm_bound is None or not isinstance(message, MaskedInput):
            return None, message
        stream = client.stream(payload)  # the same answer again, with its proof
        if not isinstance(stream, MaskedStream) or stream.proof is None:
            return None, message
        return encode(stream.proof), message

    # -- 7. erase / withdraw -----------------------------------------------------------------
    def end(self, admitted: Admitted, client: Client | int | None, reason: str) -> None:
        """The admitted round ended for this site (done, aborted, refused at its start, or
        left): :meth:`abandon` it (the runtime erases its secrets)."""
        self.abandon(client, admitted.charge, reason)

    def abandon(self, client: Client | int | None, charge: int, reason: str,
                core: SiteCore | None = None) -> None:
        """A joined round ends here (aborted, or replaced by a newer setup): its charge is
        withdrawn when the masked input never existed. ``client``: the round's client, or
        the last stage the site answered in it (None: it never advertised)."""
        stage = (None if client is None else client if isinstance(client, int)
                 else int(client.stage))
        if stage is None or stage < Stage.MASKED_INPUT:
            self.not_sent(charge, reason, core)

    def not_sent(self, charge: int, reason: str, core: SiteCore | None = None) -> None:
        """The withdrawal rule: the round's masked input never left the site (for a reason
        that does not depend on its data): withdraw its charge ``charge`` (ledger id,
        :meth:`fl.site.core.SiteCore.withdraw`). ``core``: the site's core if the caller
        holds it open."""
        with self._held(core) as own:
            own.withdraw(charge, reason)
