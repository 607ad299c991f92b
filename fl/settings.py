"""Training settings: everything ``secagg train`` is told, in one typed object (no torch)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from dp import MODE_DISTRIBUTED, MODE_NONE, MODE_SITE, UNITS, accountant_names
from dp import MODES as DP_MODES
from secagg import SECURITY_MODES, Config

# fl.models.MODELS (kept here without torch)
MODELS = ("logreg", "mlp", "cnn", "cox", "discrete-time")
STRATEGIES = ("fedavg", "fedprox", "scaffold", "fedadam", "fedyogi", "fedadagrad")
"""``--strategy``: the local step and the server's use of the secure sum (fl/strategies.py)."""
SURVIVAL_DATASETS = ("tcga-brca",)
SCALING = ("auto", "secure", "none")


@dataclass(frozen=True)
class TrainSettings:
    """Options of one federated training run; defaults are those of ``secagg train``."""

    sites: int = 5
    rounds: int = 20
    dataset: str = "breast-cancer"
    csv: str | None = None
    patient_column: str | None = None
    label_column: str | None = None
    dp: str = "none"
    epsilon: float | None = None
    delta: float = 1e-5
    unit: str = "patient"
    drop_rate: float = 0.0
    broker: str = "embedded"
    seed: int = 0
    local_epochs: int = 1
    fedprox_mu: float = 0.0
    lr: float = 0.1
    server_lr: float = 1.0
    batch_size: int = 32
    model: str = "logreg"
    alpha: float = 0.5
    test_fraction: float = 0.2
    clip_norm: float = 1.0
    sample_rate: float = 0.1
    noise_multiplier: float | None = None
    site_steps: int | None = None
    cohort: int | None = None
    ehr_patients: int = 1000
    scaling: str = "auto"
    max_attempts: int = 5
    checkpoint: str | None = None
    resume: bool = False
    verify: bool = True
    accountant: str = "rdp"
    max_units: int | None = None
    expected_batch: float | None = None
    norm_bound: float | None = None
    """``--norm-bound``: input validation (docs/protocol.md 10): each site proves its row
    ``[n x, n]`` within this L2 bound, its weight non-negative (``--dp none``; FedAvg or
    FedProx); a site whose proof fails is left out and named."""
    """``--expected-batch B`` (site DP): the operator's declared expected units per DP-SGD
    step, public; the noised sum is divided by it. None: the sum (lr per unit)."""
    adaptive_clip: float | None = None
    clip_count_stddev: float | None = None
    scaler_file: str | None = None
    budget_column: str | None = None
    max_records_per_patient: int | None = None
    """``--unit patient-idp``: a patient's first K records are kept, the rest never sampled
    (the declared record classes are accounted_records(1..K); None: dp.idp.DEFAULT_MAX_RECORDS)."""
    budget_classes: tuple[float, ...] | None = None
    """``--budget-classes E1,E2,...`` (with ``--budget-column``): the declared target classes;
    a patient's budget is rounded down to one (dp.idp.IdpClasses)."""
    feature_bounds: str | None = None
    """``--feature-bounds FILE``: public per-feature ranges for the noised scaler
    (:mod:`fl.plan.scaler`)."""
    scaler_epsilon: float | None = None
    """The noised feature statistics' share of ``--epsilon`` (default 10 %)."""
    strategy: str = "fedavg"
    """fedavg, fedprox (needs ``fedprox_mu > 0``), scaffold, or a server optimizer of Reddi
    et al. 2021 (fedadam, fedyogi, fedadagrad) applied to the securely aggregated update."""
    local_steps: int | None = None
    """Local minibatch updates per round (FLamby's ``num_updates``); None: ``local_epochs``."""
    server_beta1: float = 0.9
    server_beta2: float = 0.999
    server_tau: float = 1e-8
    """The server optimizers' momentum, second-moment decay and adaptivity (fedadam etc.)."""
    site_weights: float | None = None
    """``--site-weights LAMBDA`` (distributed DP on a survival dataset): DP-FedAvg+'s
    heterogeneity-aware site weights ``exp(-lambda W1)``, computed from DP releases only
    (:mod:`dp.site_weights`, :mod:`fl.plan.weights`)."""
    min_site_weight: float = 0.5
    max_site_weight: float = 1.0
    """The site weights' clip ``[w_min, w_max]``; the noise is calibrated to ``w_max`` x clip."""
    weights_epsilon: float | None = None
    """The weights' release's share of ``--epsilon`` (default 25 %)."""
    security: str = "semi-honest"
    """secagg's mode for the rounds: ``malicious`` when the coordinator has the sites'
    public keys (``--peer-keys``, fl/site/identity.py); it sets the threshold
    (:attr:`secagg_threshold`)."""

    def __post_init__(self) -> None:
        """Every problem at once: one ``ValueError`` naming each option to change."""
        problems = [problem for check in _CHECKS for problem in check(self)]
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def survival(self) -> bool:
        """A survival task (Cox model, C-index) rather than classification."""
        return self.dataset in SURVIVAL_DATASETS and self.csv is None

    @property
    def cohort_size(self) -> int:
        return self.cohort or self.sites

    @property
    def secagg_threshold(self) -> int:
        """The rounds' secure-aggregation threshold: the smallest safe one for the cohort in
        ``security`` mode (the distributed noise is calibrated to it)."""
        return int(Config(num_clients=self.cohort_size, dim=1,
                          security=self.security).threshold)

    @property
    def release_accountant(self) -> str:
        """The accountant of the federation's own budget and plan (``--accountant pld`` is
        patient-idp's per-group accountant, fl/site/idp.py; the run's other releases use rdp)."""
        return "rdp" if self.accountant == "pld" else self.accountant

    @property
    def steps_per_round(self) -> int:
        """Site-mode DP-SGD steps per round: ``local_epochs`` passes in expectation."""
        return self.site_steps or max(1, math.ceil(self.local_epochs / self.sample_rate))

    def fingerprint(self) -> dict[str, Any]:
        """Settings a checkpoint must agree with (not where it runs or how long)."""
        skip = {"broker", "checkpoint", "resume", "verify", "max_attempts", "rounds"}
        data = {k: v for k, v in asdict(self).items() if k not in skip}
        if self.dp != MODE_NONE and (self.noise_multiplier is None or self.unit == "patient-idp"):
            data["rounds"] = self.rounds  # the noise (patient-idp: the rates) was planned for it
        return data


def _rounds(s: TrainSettings) -> Iterator[str]:
    """The federation's shape: sites, rounds, attempts."""
    if s.sites < 2:
        yield f"--sites {s.sites}: need at least 2 sites"
    if s.rounds < 1:
        yield f"--rounds {s.rounds}: need at least 1"
    if s.max_attempts < 1:
        yield f"--max-attempts {s.max_attempts}: need at least 1"


def _privacy_mode(s: TrainSettings) -> Iterator[str]:
    """The privacy mode, what asks for one (a budget, a noise), and the accountant for it."""
    if s.dp not in DP_MODES:
        yield f"--dp {s.dp}: use one of {', '.join(DP_MODES)}"
    if s.dp != MODE_NONE and s.epsilon is None and s.noise_multiplier is None:
        yield f"--dp {s.dp} needs --epsilon (the total budget per patient)"
    if s.dp == MODE_NONE and (s.epsilon is not None or s.noise_multiplier is not None
                           or s.adaptive_clip is not None):
        yield ("--epsilon/--noise-multiplier/--adaptive-clip without --dp would train without "
               "privacy: add --dp site or --dp distributed")
    if s.accountant not in accountant_names():
        yield f"--accountant {s.accountant}: use one of {', '.join(accountant_names())}"
    elif s.unit == "patient-idp" and s.accountant == "prv":
        yield ("--unit patient-idp accounts its rate groups with rdp or pld "
               "(dp-accounting's PLD of the patient's mixture), not prv")
    elif s.accountant == "pld" and s.unit != "patient-idp":
        yield ("--accountant pld is for --unit patient-idp's rate groups; the "
               "sampled Gaussian of the other units uses rdp or prv")
    elif s.accountant == "prv" and s.dp == MODE_DISTRIBUTED:
        yield ("--accountant prv composes only the sampled Gaussian (--dp site); distributed "
               "rounds are accounted with rdp")


def _adaptive_clip(s: TrainSettings) -> Iterator[str]:
    """The private clip's quantile, and the distributed state checkpoints do not hold."""
    if s.adaptive_clip is not None and not 0 < s.adaptive_clip < 1:
        yield f"--adaptive-clip {s.adaptive_clip}: a quantile in (0, 1)"
    if s.dp == MODE_DISTRIBUTED and s.checkpoint is not None and (
            s.adaptive_clip is not None or s.site_weights is not None):
        yield ("--adaptive-clip/--site-weights with --dp distributed keep state (the clip, the "
               "weights' release) that checkpoints do not hold yet: run without --checkpoint")


def _site_weights(s: TrainSettings) -> Iterator[str]:
    """DP-FedAvg+'s site weights: their model, clip and share of the budget."""
    if s.site_weights is not None:
        if not (s.site_weights >= 0 and math.isfinite(s.site_weights)):
            yield f"--site-weights {s.site_weights}: lambda >= 0"
        if s.dp != MODE_DISTRIBUTED or s.model != "discrete-time" or (
                s.dataset not in SURVIVAL_DATASETS) or s.unit != "patient":
            yield ("--site-weights goes with --dp distributed, --unit patient and --model "
                   "discrete-time on a survival dataset (the released scalar is a patient's "
                   "observed-time interval on the model's public grid)")
        if not (0 < s.min_site_weight <= s.max_site_weight and math.isfinite(s.max_site_weight)):
            yield (f"--min-site-weight {s.min_site_weight} / "
                   f"--max-site-weight {s.max_site_weight}: need 0 < min <= max")
    if s.weights_epsilon is not None and (
            s.site_weights is None or not s.weights_epsilon > 0
            or (s.epsilon is not None and not s.weights_epsilon < s.epsilon)):
        yield (f"--weights-epsilon {s.weights_epsilon}: a positive share of "
               "--epsilon, below it, with --site-weights")


def _noised_counts(s: TrainSettings) -> Iterator[str]:
    """The noised clip count, the divisor of site-mode sums, the bound on a site's units."""
    if s.clip_count_stddev is not None and not s.clip_count_stddev > 0:
        yield f"--clip-count-stddev {s.clip_count_stddev}: need > 0"
    if s.expected_batch is not None and not (
            math.isfinite(s.expected_batch) and s.expected_batch > 0):
        yield f"--expected-batch {s.expected_batch}: need a positive number"
    if s.dp == MODE_SITE and s.adaptive_clip is not None and s.expected_batch is None:
        yield ("--adaptive-clip with --dp site divides the noised clip count by the declared "
               "expected batch: add --expected-batch B (patients per step per site, a public "
               "figure)")
    if s.max_units is not None and s.max_units < 1:
        yield f"--max-units {s.max_units}: need at least 1"


def _feature_scaling(s: TrainSettings) -> Iterator[str]:
    """Feature scaling: public, noised (its share of the budget) or exact (no DP)."""
    if s.scaler_file is not None and s.scaling == "secure":
        yield "--scaler (public statistics) and --scaling secure contradict: give one"
    if s.scaler_epsilon is not None and not (
            s.scaler_epsilon > 0 and math.isfinite(s.scaler_epsilon)):
        yield f"--scaler-epsilon {s.scaler_epsilon}: need a positive number"
    if s.scaler_epsilon is not None and s.dp == MODE_NONE:
        yield ("--scaler-epsilon without --dp: the feature statistics are "
               "noised only in the DP modes")
    if s.dp != MODE_NONE and s.scaling == "secure":
        yield ("--scaling secure releases exact feature sums outside the privacy "
               "budget: with --dp use pre-scaled data or --scaling none")


def _budget_and_unit(s: TrainSettings) -> Iterator[str]:
    """The budget, the privacy unit (and patient-idp's options), the security mode."""
    if s.epsilon is not None and not (s.epsilon > 0 and math.isfinite(s.epsilon)):
        yield f"--epsilon {s.epsilon}: need a positive number"
    if not 0 < s.delta < 1:
        yield f"--delta {s.delta}: need a value in (0, 1), e.g. 1e-5"
    if s.unit not in UNITS:
        yield f"--unit {s.unit}: use one of {', '.join(UNITS)}"
    if s.security not in SECURITY_MODES:
        yield f"security {s.security!r}: use one of {SECURITY_MODES}"
    if s.unit == "patient-idp" and s.dp != MODE_SITE:
        yield ("--unit patient-idp needs --dp site (individual sampling rates are accounted "
               "for the Gaussian; distributed mode's integer noise has no such analysis: "
               "docs/patient_privacy.md section 5)")
    if s.max_records_per_patient is not None and (
            s.unit != "patient-idp" or s.max_records_per_patient < 1):
        yield (f"--max-records-per-patient {s.max_records_per_patient}: a "
               "count >= 1, with --unit patient-idp")
    if s.budget_column is not None and (s.unit != "patient-idp" or s.csv is None):
        yield "--budget-column goes with --unit patient-idp and --csv"
    if s.budget_classes is not None and (
            s.budget_column is None
            or not all(math.isfinite(e) and e > 0 for e in s.budget_classes)):
        yield "--budget-classes: positive epsilons, with --budget-column"


def _training(s: TrainSettings) -> Iterator[str]:
    """Drop-outs, local training and the strategy (with its server optimizer)."""
    if not 0 <= s.drop_rate < 1:
        yield f"--drop-rate {s.drop_rate}: need a fraction in [0, 1)"
    if s.local_epochs < 1:
        yield f"--local-epochs {s.local_epochs}: need at least 1"
    if not (s.fedprox_mu >= 0 and math.isfinite(s.fedprox_mu)):
        yield f"--fedprox-mu {s.fedprox_mu}: need mu >= 0"
    if not (s.lr > 0 and math.isfinite(s.lr)):
        yield f"--lr {s.lr}: need a positive number"
    if not (s.server_lr > 0 and math.isfinite(s.server_lr)):
        yield f"--server-lr {s.server_lr}: need a positive number"
    if s.batch_size < 1:
        yield f"--batch-size {s.batch_size}: need at least 1"
    if not (s.alpha > 0 and math.isfinite(s.alpha)):
        yield f"--alpha {s.alpha}: need a positive Dirichlet concentration"
    if s.strategy not in STRATEGIES:
        yield f"--strategy {s.strategy}: use one of {', '.join(STRATEGIES)}"
    if s.strategy == "fedprox" and not s.fedprox_mu > 0:
        yield "--strategy fedprox needs --fedprox-mu > 0"
    if s.strategy in ("fedprox", "scaffold") and s.dp != MODE_NONE:
        yield (f"--strategy {s.strategy} trains without --dp (SCAFFOLD's control variates and "
               "FedProx's local steps are not private); with --dp use fedavg or a server "
               "optimizer")
    if s.strategy == "scaffold" and s.checkpoint is not None:
        yield ("--strategy scaffold keeps control variates at the sites that "
               "checkpoints do not hold yet: run it without --checkpoint")
    if s.local_steps is not None and s.local_steps < 1:
        yield f"--local-steps {s.local_steps}: need at least 1"
    if not (0 <= s.server_beta1 < 1 and 0 <= s.server_beta2 < 1 and s.server_tau > 0):
        yield "server optimizer: need 0 <= beta1, beta2 < 1 and tau > 0"


def _dataset_and_model(s: TrainSettings) -> Iterator[str]:
    """The model fits the dataset (survival or classification); the scaling is known."""
    if s.dataset in SURVIVAL_DATASETS and s.csv is None:
        if s.dp != MODE_NONE and s.model == "cox":
            yield (f"--dataset {s.dataset} --model cox runs without --dp: the partial likelihood "
                   "couples the patients of a batch, so per-patient clipping does not bound one "
                   "patient's influence; use --model discrete-time (a sum of per-patient terms)")
        if s.sites != 6:
            yield (f"--sites {s.sites}: {s.dataset}'s sites are its 6 "
                   "natural centers (give 6 or leave --sites out)")
        if s.model not in ("cox", "discrete-time"):
            yield f"--dataset {s.dataset} is a survival task: --model cox or discrete-time"
    elif s.model in ("cox", "discrete-time"):
        yield f"--model {s.model} goes with a survival dataset (--dataset tcga-brca)"
    if s.model not in MODELS:
        yield f"--model {s.model}: use one of {', '.join(MODELS)}"
    if s.scaling not in SCALING:
        yield f"--scaling {s.scaling}: use one of {', '.join(SCALING)}"


def _dp_sgd(s: TrainSettings) -> Iterator[str]:
    """DP-SGD's sampling rate and clip norm."""
    if not 0 < s.sample_rate <= 1:
        yield f"--sample-rate {s.sample_rate}: need a value in (0, 1]"
    if not s.clip_norm > 0:
        yield f"--clip-norm {s.clip_norm}: need a positive number"


def _inputs(s: TrainSettings) -> Iterator[str]:
    """The cohort, a table's columns, the checkpoint to resume, input validation's bound."""
    if s.cohort is not None and not 2 <= s.cohort <= s.sites:
        yield f"--cohort {s.cohort}: need 2 to --sites ({s.sites})"
    if s.csv is not None and (s.patient_column is None or s.label_column is None):
        yield "--csv needs --patient-column and --label-column"
    if s.resume and s.checkpoint is None:
        yield "--resume needs --checkpoint DIR"
    if s.norm_bound is not None and not (math.isfinite(s.norm_bound) and s.norm_bound > 0):
        yield f"--norm-bound {s.norm_bound}: need a positive number"
    elif s.norm_bound is not None and (s.dp != MODE_NONE or s.strategy == "scaffold"):
        yield ("--norm-bound covers --dp none with --strategy fedavg, fedprox or a "
               "server optimizer (a row [n x, n]); drop it for this mode")


_CHECKS: tuple[Callable[[TrainSettings], Iterator[str]], ...] = (
    _rounds, _privacy_mode, _adaptive_clip, _site_weights, _noised_counts, _feature_scaling,
    _budget_and_unit, _training, _dataset_and_model, _dp_sgd, _inputs)
"""The settings' checks, in the order their problems are reported."""


FLAMBY_TCGA_BRCA: dict[str, dict[str, float]] = {
    "fedavg": {"lr": 0.1},
    "fedprox": {"lr": 0.1, "fedprox_mu": 0.1},
    "scaffold": {"lr": 0.01, "server_lr": 1.0},
    "fedadam": {"lr": 0.01, "server_lr": 0.1},
    "fedyogi": {"lr": 0.01, "server_lr": 0.1},
    "fedadagrad": {"lr": 0.01, "server_lr": 1.0},
}
"""FLamby's learning rates per strategy on Fed-TCGA-BRCA (their ``config_tcga_brca.json``);
every strategy there: SGD at the sites, batch 8, 100 local updates, 5 rounds, 6 centers,
beta1 0.9, beta2 0.999, tau 1e-8."""


TCGA_BRCA_DISTRIBUTED_DP: dict[str, Any] = {
    "strategy": "fedadam", "server_lr": 0.02, "rounds": 40, "sample_rate": 0.5,
    "clip_norm": 1.0}
"""The distributed-DP protocol docs/results.md measures on Fed-TCGA-BRCA (with the
discrete-time model, whose loss is a sum of per-patient terms: the Cox partial likelihood
admits no patient-level DP): FedAdam on the noised secure sum, server lr 0.02, 40 rounds,
patient sample rate 0.5, clip 1.0 (``scripts/tcga_brca.py`` runs it)."""


def dataset_defaults(dataset: str, strategy: str | None = None,
                     dp: str = "none") -> dict[str, Any]:
    """The options a dataset brings when the user does not give them: for ``tcga-brca``
    FLamby's protocol (:data:`FLAMBY_TCGA_BRCA`; ``strategy`` None: FedAvg) and, with
    ``dp="distributed"``, the documented DP protocol on the discrete-time model
    (:data:`TCGA_BRCA_DISTRIBUTED_DP`; ``strategy`` None: its FedAdam); nothing for the
    others."""
    if dataset != "tcga-brca":
        return {} if strategy is None else {"strategy": strategy}
    private = dp == MODE_DISTRIBUTED
    if strategy is None:
        strategy = TCGA_BRCA_DISTRIBUTED_DP["strategy"] if private else "fedavg"
    if strategy not in FLAMBY_TCGA_BRCA:
        raise ValueError(f"--strategy {strategy}: use one of {', '.join(STRATEGIES)}")
    preset = {"sites": 6, "rounds": 5, "batch_size": 8, "local_steps": 100, "model": "cox",
              "scaling": "none", "server_lr": 1.0, "fedprox_mu": 0.0, "strategy": strategy,
              **FLAMBY_TCGA_BRCA[strategy]}
    if private:
        dp_preset = {k: v for k, v in TCGA_BRCA_DISTRIBUTED_DP.items()
                     if k != "strategy" and (k != "server_lr" or strategy == "fedadam")}
        preset |= {"model": "discrete-time", **dp_preset}
    return preset


def tcga_brca_settings(strategy: str = "fedavg", **options: Any) -> TrainSettings:
    """Settings of a Fed-TCGA-BRCA run with FLamby's protocol for ``strategy``; ``options``
    (any :class:`TrainSettings` field) override it."""
    return TrainSettings(**{"dataset": "tcga-brca",
                            **dataset_defaults("tcga-brca", strategy), **options})  # FLamby's
