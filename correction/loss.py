"""GRPO advantages and the PPO-style policy loss with Sparse-RL weights and rejection mask.

Policy loss per kept token t of sequence i (Schulman et al. 2017; Sparse-RL, Luo et al. 2026):

    r_t   = exp(clamp(new_logp_t - old_logp_t, -c, c))                       (c = log_ratio_clamp)
    pg_t  = w_t * max(-A_i r_t, -A_i clip(r_t, 1 - eps_low, 1 + eps_high))
            (dual clip, if dual_clip_c is set and A_i < 0:
             pg_t = w_t * min(max(-A_i r_t, -A_i clip(r_t, ...)), -A_i dual_clip_c), Ye et al. 2020)
    kl_t  = KL estimator of KL(pi_theta || pi_ref) at the sampled token (k3 by default:
            exp(ref - new) - (ref - new) - 1, Schulman 2020)
    l_t   = pg_t + kl_coef * kl_t - entropy_coef * H_t
    loss  = token_mean: sum_{kept} l_t / #kept
            seq_mean:   mean over sequences i with a kept token of (sum_{t kept in i} l_t / #kept_i)
    (with ``denominator`` given, the division is by it instead of #kept resp. #sequences, so that
    micro-batches of one global batch add up to the global mean)

w_t are the detached IS weights from ``correct`` (Sparse-RL's truncated, normalised rho_t) and the
kept tokens are ``loss_mask > 0``: rejected / vetoed tokens leave numerator and denominator. The KL
and entropy terms are masked but not importance weighted. With no kept token the loss is an exact,
differentiable 0 (its gradient is all zeros), never NaN.
"""
from __future__ import annotations

import torch
from torch import Tensor

from correction._tensor import as_mask, check_finite, check_shape, frac, masked_mean, zero_outside
from correction.config import AdvantageConfig, CorrectionConfig, KLEstimator, LossAggregation


def grpo_advantages(rewards: Tensor, group_index: Tensor,
                    cfg: AdvantageConfig | CorrectionConfig) -> tuple[Tensor, dict[str, float]]:
    """Group-relative advantages (GRPO, Shao et al. 2024).

    A_i = r_i - mean_{j in g(i)} r_j, divided by (std_{j in g(i)} r_j + eps) if
    ``cfg.normalize_std`` (unbiased std, as ``torch.std``). Groups of size 1 get A = 0; groups
    with equal rewards get A = 0. ``group_index`` [B] holds arbitrary integer group ids.
    ``cfg`` is an ``AdvantageConfig`` or a ``CorrectionConfig`` (its ``advantage`` part).
    Raises ValueError naming ``rewards`` on NaN/inf. Returns (adv [B] float, adv/* metrics).
    """
    if isinstance(cfg, CorrectionConfig):
        cfg = cfg.advantage
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B]; got shape {tuple(rewards.shape)}")
    check_shape("group_index", group_index, rewards.shape)
    check_finite("rewards", rewards)
    r = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32))
    if r.numel() == 0:
        return r.clone(), {"adv/mean": 0.0, "adv/std": 0.0, "adv/reward_mean": 0.0,
                           "adv/frac_zero_groups": 0.0, "adv/num_groups": 0.0}
    _, inv = torch.unique(group_index, return_inverse=True)
    g = int(inv.max()) + 1
    zeros = torch.zeros(g, dtype=r.dtype, device=r.device)
    count = zeros.index_add(0, inv, torch.ones_like(r))
    mean = zeros.index_add(0, inv, r) / count
    dev = r - mean[inv]
    sq = zeros.index_add(0, inv, dev * dev)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    adv = dev / (std[inv] + cfg.eps) if cfg.normalize_std else dev
    adv = torch.where(count[inv] > 1, adv, torch.zeros_like(adv))
    zero_groups = (count < 2) | (std == 0)
    metrics = {
        "adv/mean": float(adv.mean()),
        "adv/std": float(adv.std()) if adv.numel() > 1 else 0.0,
        "adv/reward_mean": float(r.mean()),
        "adv/frac_zero_groups": frac(zero_groups.sum(), g),
        "adv/num_groups": float(g),
    }
    return adv, metrics


def kl_penalty(new_logp: Tensor, ref_logp: Tensor, estimator: KLEstimator,
               clamp: float = 20.0) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) at tokens y_t (Schulman 2020), differentiable
    in ``new_logp``: k1 = new - ref; k2 = (new - ref)^2 / 2; k3 = exp(ref - new) - (ref - new) - 1
    with ref - new clamped to [-clamp, clamp] (k3 >= 0, low variance)."""
    d = new_logp - ref_logp
    est = KLEstimator(estimator)
    if est == KLEstimator.K1:
        return d
    if est == KLEstimator.K2:
        return 0.5 * d * d
    x = (-d).clamp(-clamp, clamp)
    return torch.exp(x) - x - 1.0


def aggregate(values: Tensor, keep: Tensor, how: LossAggregation,
              denominator: float | None = None) -> Tensor:
    """token_mean: sum over kept / #kept; seq_mean: mean over sequences with a kept token of their
    kept-token mean. ``denominator`` replaces #kept (token_mean) or #sequences with a kept token
    (seq_mean), e.g. the global count when a batch is split into micro-batches.
    0 (differentiable) when nothing is kept."""
    how = LossAggregation(how)
    if how == LossAggregation.TOKEN_MEAN:
        total, n = zero_outside(values, keep).sum(), keep.sum()
    else:
        per_seq = zero_outside(values, keep).sum(1) / keep.sum(1).clamp(min=1)
        has = keep.any(1)
        total, n = zero_outside(per_seq, has).sum(), has.sum()
    if denominator is not None:
        return total / max(float(denominator), 1e-8)
    return total / n.clamp(min=1)


def _check_loss_inputs(new_logp: Tensor, old_logp: Tensor, advantages: Tensor, weights: Tensor,
                       keep: Tensor, ref_logp: Tensor | None, entropy: Tensor | None) -> Tensor:
    """Shapes and finiteness at kept positions; returns advantages broadcast to [B, T]."""
    if new_logp.dim() != 2:
        raise ValueError(f"new_logp must be [B, T]; got shape {tuple(new_logp.shape)}")
    shape = new_logp.shape
    for name, x in (("old_logp", old_logp), ("weights", weights), ("ref_logp", ref_logp),
                    ("entropy", entropy)):
        if x is not None:
            check_shape(name, x, shape)
            check_finite(name, x, keep)
    check_finite("new_logp", new_logp, keep)
    if advantages.dim() == 1:
        check_shape("advantages", advantages, shape[:1])
        advantages = advantages[:, None].expand(shape)
    check_shape("advantages", advantages, shape)
    check_finite("advantages", advantages, keep)
    return advantages


def policy_loss(new_logp: Tensor, old_logp: Tensor, advantages: Tensor, weights: Tensor,
                loss_mask: Tensor, cfg: CorrectionConfig, ref_logp: Tensor | None = None,
                entropy: Tensor | None = None, *,
                denominator: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with IS weights and rejection mask (formula in the module doc).

    Args:
        new_logp: [B, T] log pi_theta(y_t), with gradient.
        old_logp: [B, T] log pi_old_dense(y_t) (the scorer's; the PPO anchor).
        advantages: [B] (or [B, T]) e.g. from ``grpo_advantages``.
        weights: [B, T] IS weights from ``correct`` (detached here in any case).
        loss_mask: [B, T] kept tokens (> 0) from ``correct``.
        cfg: ``CorrectionConfig`` (uses ``loss`` and ``log_ratio_clamp``).
        ref_logp: [B, T] reference log-probs; needed when ``loss.kl_coef > 0``.
        entropy: [B, T] per-token entropy of pi_theta (with gradient) for the bonus.
        denominator: keyword-only; divide by this instead of this batch's kept-token count
            (token_mean) or kept-sequence count (seq_mean) -- pass the global count when
            accumulating gradients over micro-batches (the loss/* means in the metrics are then
            this micro-batch's share too). None: this batch's own count.
    Returns:
        (scalar loss tensor, loss/* metrics). Raises ValueError naming the tensor on NaN/inf at a
        kept position, a shape mismatch, or kl_coef > 0 without ``ref_logp``.
    """
    lc = cfg.loss
    keep = as_mask(loss_mask, new_logp, "loss_mask")
    adv = _check_loss_inputs(new_logp, old_logp, advantages, weights, keep, ref_logp, entropy)
    if lc.kl_coef > 0 and ref_logp is None:
        raise ValueError("ref_logp is None but correction.loss.kl_coef > 0")
    c = cfg.log_ratio_clamp
    new = zero_outside(new_logp, keep).to(torch.promote_types(new_logp.dtype, torch.float32))
    log_r = (new - zero_outside(old_logp.detach(), keep)).clamp(-c, c)
    ratio = torch.exp(log_r)
    a = zero_outside(adv.detach().to(ratio.dtype), keep)
    w = zero_outside(weights.detach().to(ratio.dtype), keep)
    pg1 = -a * ratio
    pg2 = -a * ratio.clamp(1.0 - lc.clip_eps_low, 1.0 + lc.clip_eps_high)
    pg = torch.maximum(pg1, pg2)
    clipped = keep & (pg2 > pg1)
    dual = torch.zeros_like(keep)
    if lc.dual_clip_c is not None:
        cap = -a * lc.dual_clip_c
        dual = keep & (a < 0) & (pg > cap)
        pg = torch.where(a < 0, torch.minimum(pg, cap), pg)
    per_tok = w * pg
    loss = aggregate(per_tok, keep, lc.aggregation, denominator)
    pg_loss = float(loss.detach())
    metrics = {"loss/pg": pg_loss, "loss/clipfrac": frac(clipped.sum(), keep.sum()),
               "loss/dual_clipfrac": frac(dual.sum(), keep.sum())}
    if ref_logp is not None:
        kl = kl_penalty(new, zero_outside(ref_logp.detach(), keep), lc.kl_estimator, c)
        kl_mean = aggregate(kl, keep, lc.aggregation, denominator)
        metrics["loss/kl_ref"] = float(kl_mean.detach())
        if lc.kl_coef > 0:
            loss = loss + lc.kl_coef * kl_mean
    if entropy is not None:
        ent = aggregate(zero_outside(entropy, keep), keep, lc.aggregation, denominator)
        metrics["loss/entropy"] = float(ent.detach())
        if lc.entropy_coef > 0:
            loss = loss - lc.entropy_coef * ent
    metrics.update({
        "loss/total": float(loss.detach()),
        "loss/ratio_mean": float(masked_mean(ratio.detach(), keep, empty=1.0)),
        "loss/ratio_max": float(zero_outside(ratio.detach(), keep).max()) if keep.any() else 1.0,
        "loss/approx_kl_old": float(masked_mean(-log_r.detach(), keep)),
        "loss/num_kept_tokens": float(keep.sum()),
    })
    return loss, metrics
