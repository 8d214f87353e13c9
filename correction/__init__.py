"""Correction library: makes sparse (compressed-KV) rollouts trainable.

Pure, typed functions over torch tensors (no Ray / DeepSpeed / vLLM imports):
  * ``correct``            IS weights + rejection mask + mismatch metrics (Sparse-RL default)
  * ``staleness_correct``  the same with the sparsity / staleness split for asynchronous rollouts
  * ``grpo_advantages``    group-relative advantages
  * ``policy_loss``        PPO clipped surrogate with the IS weights and rejection mask applied
  * ``tv_agreement`` / ``sampled_agreement`` / ``sparrow_tail``  agreement scores and their tail
  * ``dropped_signal``     the advantage-weighted share of tokens rejection and veto remove
"""
from correction.config import (AdvantageConfig, CorrectionConfig, CorrectionMethod, IcePopConfig,
                               ISConfig, ISLevel, ISMode, KLEstimator, LagScaling, LossAggregation,
                               LossConfig, NormalizeOver, RejectionConfig, SeqMaskTISConfig,
                               StalenessConfig, TISConfig)
from correction.loss import aggregate, grpo_advantages, kl_penalty, policy_loss
from correction.metrics import (dropped_signal, mismatch_metrics, sampled_agreement, sparrow_tail,
                                tv_agreement)
from correction.staleness import lag_factor, staleness_bounds, staleness_correct
from correction.weights import (METHODS, CorrectionResult, correct, importance_weights,
                                normalize_weights, rejection_mask)

__all__ = [
    "AdvantageConfig", "CorrectionConfig", "CorrectionMethod", "CorrectionResult", "IcePopConfig",
    "ISConfig", "ISLevel", "ISMode", "KLEstimator", "LagScaling", "LossAggregation", "LossConfig",
    "METHODS", "NormalizeOver", "RejectionConfig", "SeqMaskTISConfig", "StalenessConfig",
    "TISConfig", "aggregate", "correct", "dropped_signal", "grpo_advantages", "importance_weights",
    "kl_penalty", "lag_factor", "mismatch_metrics", "normalize_weights", "policy_loss",
    "rejection_mask", "sampled_agreement", "sparrow_tail", "staleness_bounds", "staleness_correct",
    "tv_agreement",
]
