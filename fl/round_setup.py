"""What the server asks of a site for one securely aggregated round, and its checks: the
round setup that every runtime without the ``secagg train`` roles sends with its train
message (the Flower adapter, :mod:`fl.flower`; the NVFlare runtime, :mod:`fl.nvflare`), its
wire codec, and whether its encoding can hold the round (:func:`encoded_dim`). A site's reply
to it and what the round releases: :mod:`fl.round_reply`; how a server plans it:
:mod:`fl.round_plan`.

The server side (:mod:`fl.flower.server`, :mod:`fl.nvflare.server`) sends one
:class:`RoundSetup` with the train message of a round; every site of the round receives the
same bytes. The setup is public:
the roster of node ids (a Flower node id, or the id :mod:`fl.nvflare` derives from a site
name; a node's secagg client id is its position plus one), the
protocol parameters, the layout of the reply's arrays, the metrics that are averaged
securely, the weight key and the privacy mode (:data:`dp.policy.MODES`, the vocabulary of
the site role's :class:`fl.contribution.RoundTask` too: ``none``, an exact sum in fixed
point; ``distributed``, the distributed-DP integer encoding of :mod:`dp.encoding`). Its
canonical bytes are the round's ``context``, so the session id every party derives
(docs/architecture.md section 9) binds all of it, the run id, the server round and a fresh
server nonce: a node that was told something else cannot complete the round with the
others.

:meth:`RoundSetup.from_bytes` validates every field and raises :class:`SetupError` (a
``ValueError`` that says what is wrong) on anything malformed; nothing is half-built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from dp import EncodingParams
from fl.codec import FixedPointCodec
from fl.errors import FLError
from fl.modes import (
    ENCODING_KEYS,
    PrivacyMode,
    SumEncoding,
    encoding_fields,
    mode_names,
    privacy_mode,
    read_encoding,
)
from fl.modes import DpSpec as DpSpec  # the setup's encoding, said here too
from fl.vector import ArraySpec
from secagg import (
    MAX_BITS,
    MIN_BITS,
    SECURITY_MODES,
    Config,
    RoundNonce,
)
from transport import fields

VERSION = 2
"""The setup's wire version (2: the privacy mode named as :data:`dp.policy.MODES` names it,
key ``mode``; version 1 said ``encoding``, ``fixed``/``ddp``)."""
SETUP_MODES = mode_names(in_setup=True)
"""The built-in privacy modes a round setup runs (of :data:`dp.policy.MODES`; site DP needs
the site role's per-patient training, :class:`fl.contribution.RoundTask`); a mode registered
later (:func:`fl.modes.register`) with ``in_setup`` runs too."""
MAX_ARRAYS = 1 << 12
MAX_DIM = 1 << 28
MAX_SETUP_BYTES = 1 << 22
DTYPES = ("float16", "float32", "float64")


class SetupError(FLError, ValueError):
    """A round setup is malformed or unsafe; the node refuses the round."""


@dataclass(frozen=True)
class RoundSetup:
    run_id: int
    server_round: int
    nonce: bytes
    roster: tuple[int, ...]
    threshold: int
    neighbors: int | None
    bits: int
    security: str
    arrays: tuple[ArraySpec, ...]
    metrics: tuple[str, ...]
    weight_key: str
    mode: str
    """The round's privacy mode: a registered :class:`fl.modes.PrivacyMode` that a setup
    runs (:data:`SETUP_MODES`)."""
    frac_bits: int = 0
    dp: DpSpec | None = None
    dropout_rate: float = 0.0
    corrupt_rate: float = 0.0
    verify_keys: tuple[bytes, ...] = ()
    norm_bound: float | None = None
    """Input validation (opt-in; docs/protocol.md 10.6): each site proves in zero knowledge
    that what it masks is within this L2 bound (fixed point: on its row ``[w x, w m, w]``;
    distributed DP: the clip, and nothing else). :attr:`input_bound` is its integer form."""
    round_nonce: RoundNonce | None = field(default=None, compare=False, repr=False)
    """The host's side only (never on the wire): the single-use :class:`secagg.RoundNonce`
    whose value is :attr:`nonce`, for the round's ``Server(nonce=setup.round_nonce)``."""

    # --- derived ----------------------------------------------------------------------------

    @property
    def num_clients(self) -> int:
        return len(self.roster)

    @property
    def model_dim(self) -> int:
        return sum(spec.size for spec in self.arrays)

    def client_id(self, node_id: int) -> int:
        """The secagg client id of a Flower node (its position in the roster, plus one)."""
        try:
            return self.roster.index(node_id) + 1
        except ValueError:
            raise SetupError(f"node {node_id} is not in this round's roster") from None

    def node_of(self, client_id: int) -> int:
        return self.roster[client_id - 1]

    @property
    def privacy(self) -> PrivacyMode:
        """The round's privacy mode (:mod:`fl.modes`)."""
        mode = privacy_mode(self.mode, SetupError)
        if not mode.in_setup:
            raise SetupError(f"privacy mode {self.mode!r}: a round setup runs one of "
                             f"{mode_names(in_setup=True)}")
        return mode

    def encoding(self) -> SumEncoding:
        """How this round's rows become the integers a node masks: one row per node,
        ``[arrays, metrics]`` and its weight (fixed point), or the noised mode's encoding."""
        return SumEncoding(width=self.model_dim + len(self.metrics), sites=self.num_clients,
                           bits=self.bits, frac_bits=self.frac_bits,
                           params=dp_params(self) if self.dp is not None else None,
                           norm_bound=self.norm_bound)

    def _bound(self) -> tuple[int | None, int | None]:
        try:
            return self.privacy.bound(self.encoding())
        except ValueError as exc:
            raise SetupError(f"norm_bound: {exc}") from None

    @property
    def input_bound(self) -> int | None:
        """The integer L2 bound every site proves (``secagg.Config(norm_bound=)``) from
        :attr:`norm_bound` and the encoding (:meth:`fl.modes.PrivacyMode.bound`); None: no
        validation."""
        return self._bound()[0]

    def config(self, dim: int) -> Config:
        """The secagg configuration (``dim`` is the encoded length, see fl.flower.encoding)."""
        # a sparse graph is checked against the rates it was derived for (Bell et al.)
        rates: dict[str, Any] = ({} if self.neighbors is None else
                                 {"dropout_rate": self.dropout_rate,
                                  "corrupt_rate": self.corrupt_rate})
        # fixed point with a bound: the row's last coordinate, its weight, is proved
        # non-negative too (docs/protocol.md 10.7); a distributed-DP row is rotated
        bound, weight = self._bound()
        try:
            return Config(num_clients=self.num_clients, threshold=self.threshold, dim=dim,
                          bits=self.bits, neighbors=self.neighbors, security=self.security,
                          norm_bound=bound, weight_index=weight, **rates)
        except ValueError as exc:
            raise SetupError(f"unsafe or invalid protocol parameters: {exc}") from None

    def peer_keys(self) -> dict[int, bytes]:
        """Client id -> Ed25519 verification key (malicious mode; empty otherwise)."""
        return {i + 1: key for i, key in enumerate(self.verify_keys)}

    def context(self) -> bytes:
        """The bytes every party hands secagg as ``context`` (the whole setup)."""
        return self.to_bytes()

    # --- wire -------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {
            "v": VERSION, "run": self.run_id, "round": self.server_round, "nonce": self.nonce,
            "roster": list(self.roster), "t": self.threshold, "k": self.neighbors or 0,
            "bits": self.bits, "security": self.security,
            "arrays": [[s.name, list(s.shape), s.dtype] for s in self.arrays],
            "metrics": list(self.metrics), "weight": self.weight_key,
            "mode": self.mode, "frac_bits": self.frac_bits,
            "dp": None if self.dp is None else list(encoding_fields(self.dp).values()),
            "rates": [self.dropout_rate, self.corrupt_rate],
            "vk": list(self.verify_keys),
        }
        if self.norm_bound is not None:  # absent: the setup's bytes are as without it
            body["nb"] = self.norm_bound
        return fields.pack_map(body)

    @classmethod
    def from_bytes(cls, raw: object) -> RoundSetup:
        if not isinstance(raw, bytes):
            raise SetupError(f"the round setup must be bytes, got {type(raw).__name__}")
        if len(raw) > MAX_SETUP_BYTES:
            raise SetupError(f"the round setup has {len(raw)} bytes; at most "
                             f"{MAX_SETUP_BYTES} are accepted")
        body = fields.unpack_map(raw, MAX_SETUP_BYTES, error=SetupError,
                                 max_array_len=fields.MAX_ROSTER, max_str_len=1 << 12,
                                 what="the round setup")
        setup = cls._parse(body)
        if setup.to_bytes() != raw:
            raise SetupError("the round setup is not in canonical form")
        return setup

    @classmethod
    def _parse(cls, body: dict[str, Any]) -> RoundSetup:
        if body.get("v") != VERSION:
            raise SetupError(f"round setup version {body.get('v')!r}; this node speaks "
                             f"version {VERSION}: upgrade secagg on the older side")
        roster = _int_list(body, "roster", 1 << 64, fields.MAX_ROSTER)
        if len(roster) < 2 or len(set(roster)) != len(roster):
            raise SetupError("the roster needs at least two distinct node ids")
        nonce = body.get("nonce")
        if not isinstance(nonce, bytes) or len(nonce) != 32:
            raise SetupError("the nonce must be 32 bytes")
        arrays = body.get("arrays")
        if not isinstance(arrays, list) or not 1 <= len(arrays) <= MAX_ARRAYS:
            raise SetupError(f"the array layout needs 1..{MAX_ARRAYS} entries")
        specs = tuple(_array_spec(item) for item in arrays)
        if len({s.name for s in specs}) != len(specs):
            raise SetupError("the array layout repeats a name")
        if sum(s.size for s in specs) > MAX_DIM:
            raise SetupError(f"the arrays hold more than {MAX_DIM} values")
        metrics = body.get("metrics")
        if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics) \
                or len(set(metrics)) != len(metrics) or len(metrics) > 256:
            raise SetupError("metrics must be a list of at most 256 distinct names")
        weight = _str(body, "weight")
        if weight in metrics:
            raise SetupError("the weight key cannot also be an averaged metric")
        mode = _str(body, "mode")
        if mode not in mode_names(in_setup=True):
            raise SetupError(f"privacy mode {mode!r}: a round setup runs one of "
                             f"{mode_names(in_setup=True)}")
        privacy = privacy_mode(mode, SetupError)
        security = _str(body, "security")
        if security not in SECURITY_MODES:
            raise SetupError(f"security {security!r}: use one of {SECURITY_MODES}")
        keys = body.get("vk")
        if not isinstance(keys, list) or not all(isinstance(k, bytes) and len(k) == 32
                                                 for k in keys):
            raise SetupError("verify keys must be a list of 32-byte Ed25519 public keys")
        if security == "malicious" and (len(keys) != len(roster)
                                        or len(set(keys)) != len(keys)):
            raise SetupError("a malicious-mode setup needs one distinct verify key per node")
        if security == "semi-honest" and keys:
            raise SetupError("a semi-honest setup carries no verify keys")
        k = _int(body, "k", 0, fields.MAX_ROSTER)
        frac_bits = _int(body, "frac_bits", 0, 62)
        dp = (_dp_spec(body.get("dp"), sum(s.size for s in specs) + 1) if privacy.noised
              else None)
        if privacy.noised and metrics:
            raise SetupError("metrics cannot be averaged under distributed DP (they carry "
                             "no noise); send none")
        if not privacy.noised and body.get("dp") is not None:
            raise SetupError(f"an exact-sum round (mode {mode}) carries no DP parameters")
        if dp is not None and dp.bits != _int(body, "bits", MIN_BITS, MAX_BITS):
            raise SetupError("the DP encoding's modulus (dp bits) must be the secure sum's "
                             "(bits): a sum over a wider modulus than the encoding's does not "
                             "wrap as the noise calibration assumes")
        rates = body.get("rates")
        if not isinstance(rates, list) or len(rates) != 2:
            raise SetupError("the setup needs [dropout_rate, corrupt_rate]")
        named = {"dropout_rate": rates[0], "corrupt_rate": rates[1]}
        dropout_rate = _float(named, "dropout_rate", 0.0, 0.999)
        corrupt_rate = _float(named, "corrupt_rate", 0.0, 0.999)
        norm_bound = None if "nb" not in body else _float(body, "nb", 0.0, low_open=True)
        if norm_bound is not None and dp is not None and norm_bound != dp.clip_norm:
            # the site's refusal must not depend on its data: under DP only the clip,
            # which every honest contribution meets by construction (fl.input_bound)
            raise SetupError(f"norm_bound={norm_bound} in a distributed-DP round: the bound "
                             f"a site proves is the DP clip ({dp.clip_norm}), nothing else")
        return cls(run_id=_int(body, "run", 0, (1 << 64) - 1),
                   server_round=_int(body, "round", 0, (1 << 63) - 1), nonce=nonce,
                   roster=tuple(roster), threshold=_int(body, "t", 1, fields.MAX_ROSTER),
                   neighbors=k or None, bits=_int(body, "bits", MIN_BITS, MAX_BITS),
                   security=security,
                   arrays=specs, metrics=tuple(metrics), weight_key=weight,
                   mode=mode, frac_bits=frac_bits, dp=dp,
                   dropout_rate=dropout_rate, corrupt_rate=corrupt_rate,
                   verify_keys=tuple(keys), norm_bound=norm_bound)


_int = partial(fields.integer, error=SetupError, what="setup field")
_float = partial(fields.number, error=SetupError, what="setup field")


def _str(body: dict[str, Any], key: str) -> str:
    value = fields.text(body, key, limit=256, error=SetupError, what="setup field")
    if not value:
        raise SetupError(f"setup field {key!r} must be a non-empty string")
    return value


def _int_list(body: dict[str, Any], key: str, high: int, limit: int) -> list[int]:
    value = body.get(key)
    if not isinstance(value, list) or len(value) > limit or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < high for v in value):
        raise SetupError(f"setup field {key!r} must be a list of at most {limit} "
                         "non-negative integers")
    return value


def _array_spec(item: object) -> ArraySpec:
    if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
            and isinstance(item[1], list) and isinstance(item[2], str)):
        raise SetupError("each array entry must be [name, shape, dtype]")
    name, shape, dtype = item
    if not 0 < len(name) <= 256 or len(shape) > 32 or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_DIM
            for s in shape):
        raise SetupError(f"array {name!r}: a name and a shape of at most 32 sizes")
    if dtype not in DTYPES:
        raise SetupError(f"array {name!r} has dtype {dtype!r}; only {DTYPES} are averaged")
    return ArraySpec(name, tuple(shape), dtype)


def _dp_spec(item: object, dim: int) -> DpSpec:
    """The setup's encoding: :func:`fl.modes.read_encoding` of its wire list (the
    :data:`fl.modes.ENCODING_KEYS` in order) for ``dim`` coordinates."""
    if not isinstance(item, list) or len(item) != len(ENCODING_KEYS):
        raise SetupError(f"a distributed-DP round needs its {len(ENCODING_KEYS)} encoding "
                         "parameters")
    return DpSpec.of(read_encoding(dict(zip(ENCODING_KEYS, item, strict=True)), dim,
                                   error=SetupError, what="DP parameter"))


# --- the setup's encoding: can it hold the round, and how long is its vector ------------

def _fixed(setup: RoundSetup) -> FixedPointCodec:
    """A fixed-point round's codec (:class:`SetupError` when it cannot hold the round)."""
    codec = _codec(setup)
    if not isinstance(codec, FixedPointCodec):
        raise SetupError(f"a round in mode {setup.mode} is not a fixed-point sum")
    return codec


def _codec(setup: RoundSetup) -> Any:
    try:
        return setup.privacy.codec(setup.encoding())
    except ValueError as exc:
        raise SetupError(f"{setup.mode} encoding parameters: {exc}") from None


def validate_fixed(setup: RoundSetup) -> None:
    """Refuse (:class:`SetupError`) encoding parameters that cannot hold the round."""
    _codec(setup)


def dp_params(setup: RoundSetup) -> EncodingParams:
    spec = setup.dp
    if spec is None:
        raise SetupError("a distributed-DP round carries no DP parameters")
    try:
        return spec.params(setup.model_dim + 1)
    except ValueError as exc:
        raise SetupError(f"distributed-DP parameters: {exc}") from None


def encoded_dim(setup: RoundSetup) -> int:
    """The length of the secagg vector of this round."""
    return int(_codec(setup).encoded_dim)
