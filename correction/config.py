"""Config of the correction library (``correction`` section of TrainConfig).

Dataclasses usable as OmegaConf structured configs: method choices are ``enum.Enum``s with string
values (YAML writes the value, e.g. ``method: icepop``), nested sections use ``default_factory``.
``validate(prefix)`` raises ``common.errors.ConfigError`` naming the dotted key, e.g.
``correction.rejection.lower``.

The defaults are the Sparse-RL recipe (Luo et al., ACL 2026): token-level truncated importance
weights ``min(rho_t, 1.5)`` normalised to mean 1 over the batch, rejection of tokens with
``rho_t`` outside ``[0.5, 1.5]`` and a veto of every sequence holding a token with ``rho_t < 1e-4``,
where ``rho_t = pi_old_dense(y_t) / pi_sparse(y_t)``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.errors import ConfigError
from common.validate import check_range, check_enum


class CorrectionMethod(str, enum.Enum):
    """Which correction ``correction.correct`` applies (one function per member)."""
    SPARSE_RL = "sparse_rl"         # IS weights per ``is_`` + rejection/veto per ``rejection``
    NONE = "none"                   # weights 1, nothing rejected (metrics still reported)
    TIS = "tis"                     # truncated IS: min(rho_t, tis.cap) (Yao et al. 2025)
    ICEPOP = "icepop"               # masked IS: rho_t inside [icepop.lower, icepop.upper], else 0
    SEQ_MASK_TIS = "seq_mask_tis"   # sequence mask on geometric-mean rho + token TIS


class ISLevel(str, enum.Enum):
    """Granularity of the importance weight."""
    TOKEN = "token"           # w_t = rho_t
    SEQUENCE = "sequence"     # w_t = prod_s rho_s over the sequence's valid tokens
    GEOMETRIC = "geometric"   # w_t = exp(mean_s log rho_s) over the sequence's valid tokens


class ISMode(str, enum.Enum):
    """How a weight outside the bounds is handled."""
    TRUNCATE = "truncate"   # min(w, upper)
    CLIP = "clip"           # clamp(w, lower, upper)
    MASK = "mask"           # w if lower <= w <= upper else 0


class NormalizeOver(str, enum.Enum):
    """Which tokens' mean the batch normalisation divides by."""
    KEPT = "kept"     # tokens left after rejection: the weights entering the loss average 1
    VALID = "valid"   # every valid token, before rejection (the public Sparse-RL/slime code)


class KLEstimator(str, enum.Enum):
    """Per-token estimators of KL(pi_theta || pi_ref) from samples (Schulman 2020)."""
    K1 = "k1"   # log pi - log pi_ref              (unbiased, high variance, can be < 0)
    K2 = "k2"   # 0.5 * (log pi - log pi_ref)^2    (biased, >= 0)
    K3 = "k3"   # r - 1 - log r, r = pi_ref / pi   (unbiased, low variance, >= 0)


class LossAggregation(str, enum.Enum):
    TOKEN_MEAN = "token_mean"   # sum over kept tokens / number of kept tokens in the batch
    SEQ_MEAN = "seq_mean"       # mean over sequences (with a kept token) of their kept-token mean


class LagScaling(str, enum.Enum):
    """How the staleness bounds widen with the version lag l (bounds exp(+-f(l) * log U))."""
    CONSTANT = "constant"   # f(l) = 1
    LINEAR = "linear"       # f(l) = max(l, 1)
    SQRT = "sqrt"           # f(l) = sqrt(max(l, 1))


_enum = check_enum  # shared: coerce a string to the Enum or name the key


def _bounds(prefix: str, lower: float, upper: float, upper_min: float = 1.0) -> None:
    check_range(f"{prefix}.lower", lower, lo=0.0, hi=1.0)
    check_range(f"{prefix}.upper", upper, lo=upper_min)
    if upper <= lower:
        raise ConfigError(f"{prefix}.upper", upper, f"a number > lower ({lower})")


@dataclass
class ISConfig:
    """Importance weights of the ``sparse_rl`` method (``correction.is_``)."""
    # false: unit weights, rejection alone corrects (verl's rollout_is: null with rollout_rs set)
    enabled: bool = True
    level: ISLevel = ISLevel.TOKEN
    mode: ISMode = ISMode.TRUNCATE
    lower: float = 0.0        # clip / mask only
    upper: float = 1.5        # the cap U (paper: 1.5)
    # rescale to mean 1 over the batch (see normalize_over): over tokens at level token, over
    # sequences (each sequence's mean weight once) at level sequence / geometric, as the
    # reference code's tis_batch_normalize does
    normalize: bool = True
    # kept (ours: the weights entering the loss average exactly 1) or valid (the reference code:
    # every valid token before rejection; the paper presets use it)
    normalize_over: NormalizeOver = NormalizeOver.KEPT

    def validate(self, prefix: str = "correction.is_") -> None:
        _enum(f"{prefix}.level", ISLevel, self.level)
        _enum(f"{prefix}.mode", ISMode, self.mode)
        _enum(f"{prefix}.normalize_over", NormalizeOver, self.normalize_over)
        _bounds(prefix, self.lower, self.upper)


@dataclass
class RejectionConfig:
    """Sparsity-aware rejection of the ``sparse_rl`` method (``correction.rejection``)."""
    enabled: bool = True
    # the ratio the band is applied to: token (rho_t, rejects tokens), sequence (prod_t rho_t) or
    # geometric (exp mean_t log rho_t): the last two reject whole sequences (reference: rs_level)
    level: ISLevel = ISLevel.TOKEN
    lower: float = 0.5              # ratios < lower leave the loss mask
    upper: float = 1.5              # ratios > upper leave the loss mask
    veto_threshold: float = 1e-4    # a token with rho_t < this removes its whole sequence
    # a floor on what the veto and the band leave: a batch in which fewer than this share of the
    # sequences keep a token trains on nothing (every token leaves the loss mask, so the learner
    # takes no optimizer step) rather than a full step on the few left; 0 = off (the reference)
    min_kept_share: float = 0.0

    def validate(self, prefix: str = "correction.rejection") -> None:
        _enum(f"{prefix}.level", ISLevel, self.level)
        _bounds(prefix, self.lower, self.upper)
        check_range(f"{prefix}.veto_threshold", self.veto_threshold, lo=0.0, hi=1.0)
        check_range(f"{prefix}.min_kept_share", self.min_kept_share, lo=0.0, hi=1.0)


@dataclass
class TISConfig:
    """Truncated IS comparator (``correction.tis``): w_t = min(rho_t, cap), nothing rejected."""
    cap: float = 2.0

    def validate(self, prefix: str = "correction.tis") -> None:
        check_range(f"{prefix}.cap", self.cap, lo=1.0)


@dataclass
class IcePopConfig:
    """Masked IS comparator (``correction.icepop``): w_t = rho_t inside [lower, upper], else 0."""
    lower: float = 0.5
    upper: float = 5.0

    def validate(self, prefix: str = "correction.icepop") -> None:
        _bounds(prefix, self.lower, self.upper)


@dataclass
class SeqMaskTISConfig:
    """Sequence-mask TIS (``correction.seq_mask_tis``): a sequence whose geometric-mean ratio
    exp(mean_t log rho_t) lies outside [lower, upper] leaves the loss mask; kept tokens get
    min(rho_t, cap)."""
    cap: float = 2.0
    lower: float = 0.8
    upper: float = 1.25

    def validate(self, prefix: str = "correction.seq_mask_tis") -> None:
        check_range(f"{prefix}.cap", self.cap, lo=1.0)
        _bounds(prefix, self.lower, self.upper)


@dataclass
class StalenessConfig:
    """Staleness split for asynchronous rollouts (``correction.staleness``), used by
    ``correction.staleness_correct``. At lag l the staleness part u_t is bounded by
    [lower ** f(l), upper ** f(l)] (see ``LagScaling``); samples with l > max_lag are rejected.

    ``enabled``: the learner applies the split to every batch that carries
    ``dense_sampler_logprobs`` (pi_dense at the sampler's version; needs
    ``rollout.dense_logprobs=true``); otherwise, and by default, it applies ``correct`` to
    (sampler, old) log-probs as before."""
    enabled: bool = False
    max_lag: int = 4
    mode: ISMode = ISMode.TRUNCATE
    lower: float = 0.5
    upper: float = 2.0
    lag_scaling: LagScaling = LagScaling.SQRT

    def validate(self, prefix: str = "correction.staleness") -> None:
        check_range(f"{prefix}.max_lag", self.max_lag, lo=0)
        _enum(f"{prefix}.mode", ISMode, self.mode)
        _enum(f"{prefix}.lag_scaling", LagScaling, self.lag_scaling)
        _bounds(prefix, self.lower, self.upper)


@dataclass
class LossConfig:
    """PPO clipped surrogate, KL to the reference, entropy bonus (``correction.loss``)."""
    clip_eps_low: float = 0.2                 # ratio floor 1 - eps_low
    clip_eps_high: float = 0.2                # ratio ceiling 1 + eps_high (DAPO clip-higher: 0.28)
    dual_clip_c: float | None = None          # dual-clip bound for A < 0 (Ye et al. 2020), > 1
    # weight of KL(pi_theta || pi_ref), pi_ref the initial policy. > 0 makes every scorer load a
    # frozen copy of rollout.model_path and score ref log-probs (cluster/pools.spawn_scorer), so
    # any kl_coef > 0 runs with a reference; policy_loss raises if one is still missing
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.K3
    entropy_coef: float = 0.0                 # bonus: loss -= entropy_coef * entropy
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN

    def validate(self, prefix: str = "correction.loss") -> None:
        check_range(f"{prefix}.clip_eps_low", self.clip_eps_low, lo=0.0, hi=1.0, hi_open=True)
        check_range(f"{prefix}.clip_eps_high", self.clip_eps_high, lo=0.0)
        if self.dual_clip_c is not None:
            check_range(f"{prefix}.dual_clip_c", self.dual_clip_c, lo=1.0, lo_open=True)
        check_range(f"{prefix}.kl_coef", self.kl_coef, lo=0.0)
        _enum(f"{prefix}.kl_estimator", KLEstimator, self.kl_estimator)
        check_range(f"{prefix}.entropy_coef", self.entropy_coef, lo=0.0)
        _enum(f"{prefix}.aggregation", LossAggregation, self.aggregation)


@dataclass
class AdvantageConfig:
    """GRPO group-relative advantages (``correction.advantage``)."""
    normalize_std: bool = True   # divide by the group's (unbiased) reward std + eps
    eps: float = 1e-6

    def validate(self, prefix: str = "correction.advantage") -> None:
        check_range(f"{prefix}.eps", self.eps, lo=0.0, lo_open=True)


@dataclass
class CorrectionConfig:
    """Everything ``correction/`` needs. ``method`` picks the weighting/rejection function; each
    method reads only its own section (sparse_rl: ``is_`` + ``rejection``; tis: ``tis``; icepop:
    ``icepop``; seq_mask_tis: ``seq_mask_tis``; none: nothing)."""
    method: CorrectionMethod = CorrectionMethod.SPARSE_RL
    log_ratio_clamp: float = 20.0   # log rho clamped to [-c, c] before exp
    is_: ISConfig = field(default_factory=ISConfig)
    rejection: RejectionConfig = field(default_factory=RejectionConfig)
    tis: TISConfig = field(default_factory=TISConfig)
    icepop: IcePopConfig = field(default_factory=IcePopConfig)
    seq_mask_tis: SeqMaskTISConfig = field(default_factory=SeqMaskTISConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)

    def validate(self, prefix: str = "correction") -> None:
        _enum(f"{prefix}.method", CorrectionMethod, self.method)
        check_range(f"{prefix}.log_ratio_clamp", self.log_ratio_clamp, lo=1.0, hi=80.0)
        self.is_.validate(f"{prefix}.is_")
        self.rejection.validate(f"{prefix}.rejection")
        self.tis.validate(f"{prefix}.tis")
        self.icepop.validate(f"{prefix}.icepop")
        self.seq_mask_tis.validate(f"{prefix}.seq_mask_tis")
        self.staleness.validate(f"{prefix}.staleness")
        self.loss.validate(f"{prefix}.loss")
        self.advantage.validate(f"{prefix}.advantage")
