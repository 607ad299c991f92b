"""Training settings: everything ``secagg train`` is told, in one typed object (no torch)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from dp import MODES as DP_MODES
from dp import UNITS, accountant_names
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
        problems = []
        if self.sites < 2:
            problems.append(f"--sites {self.sites}: need at least 2 sites")
        if self.rounds < 1:
            problems.append(f"--rounds {self.rounds}: need at least 1")
        if self.max_attempts < 1:
            problems.append(f"--max-attempts {self.max_attempts}: need at least 1")
        if self.dp not in DP_MODES:
            problems.append(f"--dp {self.dp}: use one of {', '.join(DP_MODES)}")
        if self.dp != "none" and self.epsilon is None and self.noise_multiplier is None:
            problems.append(f"--dp {self.dp} needs --epsilon (the total budget per patient)")
        if self.dp == "none" and (self.epsilon is not None or self.noise_multiplier is not None
                                  or self.adaptive_clip is not None):
            problems.append("--epsilon/--noise-multiplier/--adaptive-clip without --dp would "
                            "train without privacy: add --dp site or --dp distributed")
        if self.accountant not in accountant_names():
            problems.append(f"--accountant {self.accountant}: use one of "
                            f"{', '.join(accountant_names())}")
        elif self.unit == "patient-idp" and self.accountant == "prv":
            problems.append("--unit patient-idp accounts its rate groups with rdp or pld "
                            "(dp-accounting's PLD of the patient's mixture), not prv")
        elif self.accountant == "pld" and self.unit != "patient-idp":
            problems.append("--accountant pld is for --unit patient-idp's rate groups; the "
                            "sampled Gaussian of the other units uses rdp or prv")
        elif self.accountant == "prv" and self.dp == "distributed":
            problems.append("--accountant prv composes only the sampled Gaussian (--dp site); "
                            "distributed rounds are accounted with rdp")
        if self.adaptive_clip is not None and not 0 < self.adaptive_clip < 1:
            problems.append(f"--adaptive-clip {self.adaptive_clip}: a quantile in (0, 1)")
        if self.dp == "distributed" and self.checkpoint is not None and (
                self.adaptive_clip is not None or self.site_weights is not None):
            problems.append("--adaptive-clip/--site-weights with --dp distributed keep state "
                            "(the clip, the weights' release) that checkpoints do not hold "
                            "yet: run without --checkpoint")
        if self.site_weights is not None:
            if not (self.site_weights >= 0 and math.isfinite(self.site_weights)):
                problems.append(f"--site-weights {self.site_weights}: lambda >= 0")
            if self.dp != "distributed" or self.model != "discrete-time" or (
                    self.dataset not in SURVIVAL_DATASETS) or self.unit != "patient":
                problems.append("--site-weights goes with --dp distributed, --unit patient and "
                                "--model discrete-time on a survival dataset (the released "
                                "scalar is a patient's observed-time interval on the model's "
                                "public grid)")
            if not (0 < self.min_site_weight <= self.max_site_weight
                    and math.isfinite(self.max_site_weight)):
                problems.append(f"--min-site-weight {self.min_site_weight} / "
                                f"--max-site-weight {self.max_site_weight}: need 0 < min <= max")
        if self.weights_epsilon is not None and (
                self.site_weights is None or not self.weights_epsilon > 0
                or (self.epsilon is not None and not self.weights_epsilon < self.epsilon)):
            problems.append(f"--weights-epsilon {self.weights_epsilon}: a positive share of "
                            "--epsilon, below it, with --site-weights")
        if self.clip_count_stddev is not None and not self.clip_count_stddev > 0:
            problems.append(f"--clip-count-stddev {self.clip_count_stddev}: need > 0")
        if self.expected_batch is not None and not (math.isfinite(self.expected_batch)
                                                    and self.expected_batch > 0):
            problems.append(f"--expected-batch {self.expected_batch}: need a positive number")
        if (self.dp == "site" and self.adaptive_clip is not None
                and self.expected_batch is None):
            problems.append("--adaptive-clip with --dp site divides the noised clip count by "
                            "the declared expected batch: add --expected-batch B (patients "
                            "per step per site, a public figure)")
        if self.max_units is not None and self.max_units < 1:
            problems.append(f"--max-units {self.max_units}: need at least 1")
        if self.scaler_file is not None and self.scaling == "secure":
            problems.append("--scaler (public statistics) and --scaling secure contradict: "
                            "give one")
        if self.scaler_epsilon is not None and not (
                self.scaler_epsilon > 0 and math.isfinite(self.scaler_epsilon)):
            problems.append(f"--scaler-epsilon {self.scaler_epsilon}: need a positive number")
        if self.scaler_epsilon is not None and self.dp == "none":
            problems.append("--scaler-epsilon without --dp: the feature statistics are "
                            "noised only in the DP modes")
        if self.dp != "none" and self.scaling == "secure":
            problems.append("--scaling secure releases exact feature sums outside the privacy "
                            "budget: with --dp use pre-scaled data or --scaling none")
        if self.epsilon is not None and not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            problems.append(f"--epsilon {self.epsilon}: need a positive number")
        if not 0 < self.delta < 1:
            problems.append(f"--delta {self.delta}: need a value in (0, 1), e.g. 1e-5")
        if self.unit not in UNITS:
            problems.append(f"--unit {self.unit}: use one of {', '.join(UNITS)}")
        if self.security not in SECURITY_MODES:
            problems.append(f"security {self.security!r}: use one of {SECURITY_MODES}")
        if self.unit == "patient-idp" and self.dp != "site":
            problems.append("--unit patient-idp needs --dp site (individual sampling rates "
                            "are accounted for the Gaussian; distributed mode's integer "
                            "noise has no such analysis: docs/patient_privacy.md section 5)")
        if self.max_records_per_patient is not None and (
                self.unit != "patient-idp" or self.max_records_per_patient < 1):
            problems.append(f"--max-records-per-patient {self.max_records_per_patient}: a "
                            "count >= 1, with --unit patient-idp")
        if self.budget_column is not None and (self.unit != "patient-idp" or self.csv is None):
            problems.append("--budget-column goes with --unit patient-idp and --csv")
        if self.budget_classes is not None and (
                self.budget_column is None
                or not all(math.isfinite(e) and e > 0 for e in self.budget_classes)):
            problems.append("--budget-classes: positive epsilons, with --budget-column")
        if not 0 <= self.drop_rate < 1:
            problems.append(f"--drop-rate {self.drop_rate}: need a fraction in [0, 1)")
        if self.local_epochs < 1:
            problems.append(f"--local-epochs {self.local_epochs}: need at least 1")
        if not (self.fedprox_mu >= 0 and math.isfinite(self.fedprox_mu)):
            problems.append(f"--fedprox-mu {self.fedprox_mu}: need mu >= 0")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            problems.append(f"--lr {self.lr}: need a positive number")
        if not (self.server_lr > 0 and math.isfinite(self.server_lr)):
            problems.append(f"--server-lr {self.server_lr}: need a positive number")
        if self.batch_size < 1:
            problems.append(f"--batch-size {self.batch_size}: need at least 1")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            problems.append(f"--alpha {self.alpha}: need a positive Dirichlet concentration")
        if self.strategy not in STRATEGIES:
            problems.append(f"--strategy {self.strategy}: use one of {', '.join(STRATEGIES)}")
        if self.strategy == "fedprox" and not self.fedprox_mu > 0:
            problems.append("--strategy fedprox needs --fedprox-mu > 0")
        if self.strategy in ("fedprox", "scaffold") and self.dp != "none":
            problems.append(f"--strategy {self.strategy} trains without --dp (SCAFFOLD's "
                            "control variates and FedProx's local steps are not private); "
                            "with --dp use fedavg or a server optimizer")
        if self.strategy == "scaffold" and self.checkpoint is not None:
            problems.append("--strategy scaffold keeps control variates at the sites that "
                            "checkpoints do not hold yet: run it without --checkpoint")
        if self.local_steps is not None and self.local_steps < 1:
            problems.append(f"--local-steps {self.local_steps}: need at least 1")
        if not (0 <= self.server_beta1 < 1 and 0 <= self.server_beta2 < 1
                and self.server_tau > 0):
            problems.append("server optimizer: need 0 <= beta1, beta2 < 1 and tau > 0")
        if self.dataset in SURVIVAL_DATASETS and self.csv is None:
            if self.dp != "none" and self.model == "cox":
                problems.append(f"--dataset {self.dataset} --model cox runs without --dp: the "
                                "partial likelihood couples the patients of a batch, so "
                                "per-patient clipping does not bound one patient's influence; "
                                "use --model discrete-time (a sum of per-patient terms)")
            if self.sites != 6:
                problems.append(f"--sites {self.sites}: {self.dataset}'s sites are its 6 "
                                "natural centers (give 6 or leave --sites out)")
            if self.model not in ("cox", "discrete-time"):
                problems.append(f"--dataset {self.dataset} is a survival task: --model cox "
                                "or discrete-time")
        elif self.model in ("cox", "discrete-time"):
            problems.append(f"--model {self.model} goes with a survival dataset (--dataset "
                            "tcga-brca)")
        if self.model not in MODELS:
            problems.append(f"--model {self.model}: use one of {', '.join(MODELS)}")
        if self.scaling not in SCALING:
            problems.append(f"--scaling {self.scaling}: use one of {', '.join(SCALING)}")
        if not 0 < self.sample_rate <= 1:
            problems.append(f"--sample-rate {self.sample_rate}: need a value in (0, 1]")
        if not self.clip_norm > 0:
            problems.append(f"--clip-norm {self.clip_norm}: need a positive number")
        if self.cohort is not None and not 2 <= self.cohort <= self.sites:
            problems.append(f"--cohort {self.cohort}: need 2 to --sites ({self.sites})")
        if self.csv is not None and (self.patient_column is None or self.label_column is None):
            problems.append("--csv needs --patient-column and --label-column")
        if self.resume and self.checkpoint is None:
            problems.append("--resume needs --checkpoint DIR")
        if self.norm_bound is not None and not (
                math.isfinite(self.norm_bound) and self.norm_bound > 0):
            problems.append(f"--norm-bound {self.norm_bound}: need a positive number")
        elif self.norm_bound is not None and (self.dp != "none" or self.strategy == "scaffold"):
            problems.append("--norm-bound covers --dp none with --strategy fedavg, fedprox or a "
                            "server optimizer (a row [n x, n]); drop it for this mode")
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
        if self.dp != "none" and (self.noise_multiplier is None or self.unit == "patient-idp"):
            data["rounds"] = self.rounds  # the noise (patient-idp: the rates) was planned for it
        return data


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
    private = dp == "distributed"
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
