"""Training settings: everything ``secagg train`` is told, in one typed object (no torch)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from secagg.config import SECURITY_MODES, Config

DP_MODES = ("none", "site", "distributed")
UNITS = ("patient", "record", "patient-idp")
MODELS = ("logreg", "mlp", "cnn")  # fl.models.MODELS (kept here without torch)
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
    adaptive_clip: float | None = None
    clip_count_stddev: float | None = None
    scaler_file: str | None = None
    budget_column: str | None = None
    max_records_per_patient: int | None = None
    """``--unit patient-idp``: a patient's first K records are kept, the rest never sampled
    (its rate group is then at most K records; dp.idp.group_patients)."""
    feature_bounds: str | None = None
    """``--feature-bounds FILE``: public per-feature ranges for the noised scaler
    (:mod:`fl.private_scaler`)."""
    scaler_epsilon: float | None = None
    """The noised feature statistics' share of ``--epsilon`` (default 10 %)."""
    security: str = "semi-honest"
    """secagg's mode for the rounds: ``malicious`` when the coordinator has the sites'
    public keys (``--peer-keys``, fl/identity.py); it sets the threshold
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
        if self.accountant not in ("rdp", "prv", "pld"):
            problems.append(f"--accountant {self.accountant}: use rdp, prv or pld")
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
        if self.adaptive_clip is not None and self.dp == "distributed":
            problems.append("--adaptive-clip is available with --dp site")
        if self.clip_count_stddev is not None and not self.clip_count_stddev > 0:
            problems.append(f"--clip-count-stddev {self.clip_count_stddev}: need > 0")
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
        if not 0 <= self.drop_rate < 1:
            problems.append(f"--drop-rate {self.drop_rate}: need a fraction in [0, 1)")
        if self.local_epochs < 1:
            problems.append(f"--local-epochs {self.local_epochs}: need at least 1")
        if self.fedprox_mu < 0:
            problems.append(f"--fedprox-mu {self.fedprox_mu}: need mu >= 0")
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
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def cohort_size(self) -> int:
        return self.cohort or self.sites

    @property
    def secagg_threshold(self) -> int:
        """The rounds' secure-aggregation threshold: the smallest safe one for the cohort in
        ``security`` mode (the distributed noise is calibrated to it)."""
        return int(Config(num_clients=self.cohort_size, dim=1,
                          security=self.security).threshold or 2)

    @property
    def release_accountant(self) -> str:
        """The accountant of the federation's own budget and plan (``--accountant pld`` is
        patient-idp's per-group accountant, fl/idp.py; the run's other releases use rdp)."""
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
