"""Mismatch metrics between the sparse sampler and the dense policy.

Notation: q = pi_sampler (the sparse rollout's distribution, the one tokens were drawn from),
p = pi_old_dense (the dense scorer), rho_t = p(y_t) / q(y_t) for the sampled token y_t, and
``log_ratio = log p(y_t) - log q(y_t)``. All statistics are over valid (unpadded) tokens only.

KL(q || p) estimators from samples y ~ q (Schulman, "Approximating KL divergence", 2020):
    k1 = mean(-log rho)                      unbiased, high variance, can be negative
    k3 = mean(rho - 1 - log rho)             unbiased, low variance, always >= 0
Chi-square: chi2(p || q) = E_q[rho^2] - 1, estimated by mean(rho^2) - 1.
PPL ratio: exp(mean NLL under p) / exp(mean NLL under q) = exp(k1), token-weighted over the batch.

Sparrow tail statistic: the 5th percentile over tokens of a per-token agreement score between the
sparse and the dense next-token distributions, agreement = 1 - TV(p, q) = sum_v min(p(v), q(v)).
 * Exact (``tv_agreement``) when both full distributions are known, e.g. in calibration probes.
 * Approximation (``sampled_agreement``) when only the sampled token's log-probs are known:
   a_t = min(1, rho_t). Since E_{y~q}[min(1, p(y)/q(y))] = sum_y min(p(y), q(y)) = 1 - TV(p, q),
   a_t is an unbiased single-sample estimate of the position's agreement, so its batch mean is
   unbiased; its 5th percentile, however, is the tail of a noisier quantity (a mean-preserving
   spread of the exact scores) and is typically lower, i.e. conservative. Calibrate with
   ``tv_agreement`` on probes when the exact tail matters.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from correction._tensor import (as_mask, check_finite, check_shape, masked_max, masked_mean,
                                masked_min, masked_quantile)

SPARROW_QUANTILE = 0.05


def tv_agreement(logp_a: Tensor, logp_b: Tensor) -> Tensor:
    """Exact per-position agreement 1 - TV = sum_v min(p_a(v), p_b(v)) of two next-token
    distributions given as log-probs over the vocabulary (last dim). Returns shape ``[...]``
    with values in [0, 1]. Inputs need not be normalised exactly; each is renormalised."""
    if logp_a.shape != logp_b.shape:
        raise ValueError(f"logp_b has shape {tuple(logp_b.shape)}; expected {tuple(logp_a.shape)}")
    check_finite("logp_a", logp_a.masked_fill(logp_a == float("-inf"), 0.0))
    check_finite("logp_b", logp_b.masked_fill(logp_b == float("-inf"), 0.0))
    p = torch.softmax(logp_a.double(), dim=-1)
    q = torch.softmax(logp_b.double(), dim=-1)
    return torch.minimum(p, q).sum(-1).clamp(0.0, 1.0).to(logp_a.dtype)


def sampled_agreement(log_ratio: Tensor, clamp: float = 20.0) -> Tensor:
    """Single-sample estimate min(1, rho_t) of the per-position agreement 1 - TV (see module doc).
    ``log_ratio`` = log p_dense(y_t) - log q_sampler(y_t)."""
    return torch.exp(log_ratio.clamp(-clamp, clamp)).clamp(max=1.0)


def sparrow_tail(agreement: Tensor, mask: Tensor, q: float = SPARROW_QUANTILE) -> float:
    """The Sparrow tail statistic: the ``q``-quantile (default 5th percentile) of per-token
    agreement scores over valid tokens; 1.0 (perfect agreement) when there is none."""
    valid = as_mask(mask, agreement)
    return masked_quantile(agreement, valid, q, empty=1.0)


def mismatch_metrics(sampler_logp: Tensor, old_logp: Tensor, mask: Tensor, clamp: float = 20.0,
                     prefix: str = "mismatch/") -> dict[str, float]:
    """Per-batch mismatch between sampler (q) and dense (p) log-probs of the sampled tokens.

    Keys (prefixed): k1, k3, chi2, ppl_sampler, ppl_old, ppl_ratio, rho_mean, rho_min, rho_max,
    abs_log_ratio_mean, frac_clamped (|log rho| > clamp), agreement_mean, agreement_p5 (Sparrow
    tail, sampled-token approximation), num_tokens. With no valid token the statistics take
    their no-mismatch values (rho 1, KL 0, agreement 1, PPL 1) and num_tokens is 0.
    Raises ValueError naming the tensor on NaN/inf at valid positions.
    """
    valid = as_mask(mask, sampler_logp)
    check_shape("old_logp", old_logp, sampler_logp.shape)
    check_finite("sampler_logp", sampler_logp, valid)
    check_finite("old_logp", old_logp, valid)
    s = torch.where(valid, sampler_logp.detach().double(), 0.0)
    o = torch.where(valid, old_logp.detach().double(), 0.0)
    lr = o - s
    lrc = lr.clamp(-clamp, clamp)
    rho = torch.exp(lrc)
    n = int(valid.sum())
    k1 = float(masked_mean(-lr, valid))
    agree = sampled_agreement(lr, clamp)
    out = {
        "k1": k1,
        "k3": float(masked_mean(rho - 1.0 - lrc, valid)),
        "chi2": float(masked_mean(rho * rho, valid, empty=1.0)) - 1.0,
        "ppl_sampler": _exp(float(masked_mean(-s, valid))),
        "ppl_old": _exp(float(masked_mean(-o, valid))),
        "ppl_ratio": _exp(k1),
        "rho_mean": float(masked_mean(rho, valid, empty=1.0)),
        "rho_min": masked_min(rho, valid, empty=1.0),
        "rho_max": masked_max(rho, valid, empty=1.0),
        "abs_log_ratio_mean": float(masked_mean(lr.abs(), valid)),
        "frac_clamped": float(masked_mean((lr.abs() > clamp).double(), valid)),
        "agreement_mean": float(masked_mean(agree, valid, empty=1.0)),
        "agreement_p5": masked_quantile(agree, valid, SPARROW_QUANTILE, empty=1.0),
        "num_tokens": float(n),
    }
    return {prefix + k: v for k, v in out.items()}


def dropped_signal(advantages: Tensor, mask: Tensor, keep: Tensor,
                   prefix: str = "correction/") -> dict[str, float]:
    """Which policy-gradient signal the correction's rejection and veto remove.

    A token's signal is |A_i| of its row (GRPO: one advantage per sequence). ``signal_dropped_pos``
    is sum |A_i| over valid tokens off ``keep`` / sum |A_i| over valid tokens, over rows with
    A_i > 0; ``signal_dropped_neg`` the same over rows with A_i < 0 (0.0 where such rows carry no
    signal). Equal shares mean the correction thins the batch evenly; a veto that falls mostly on
    one sign shifts the update towards the other (e.g. dropping failures the sparse cache caused).
    ``advantages`` [B]; ``mask`` (valid response tokens) and ``keep`` (the loss mask) [B, T].
    """
    valid = as_mask(mask, mask)
    kept = as_mask(keep, valid, "keep") & valid
    check_shape("advantages", advantages, valid.shape[:1])
    check_finite("advantages", advantages)
    a = advantages.detach().double().abs()[:, None]
    out = {}
    for name, rows in (("pos", advantages > 0), ("neg", advantages < 0)):
        total = float((a * (valid & rows[:, None])).sum())
        dropped = float((a * (valid & ~kept & rows[:, None])).sum())
        out[f"signal_dropped_{name}"] = dropped / total if total > 0 else 0.0
    return {prefix + k: v for k, v in out.items()}


def _exp(x: float) -> float:
    return math.exp(min(x, 700.0))
