"""Importance weights and rejection for sparse rollouts (Sparse-RL, Luo et al., ACL 2026).

Per valid response token t of sequence i the mismatch ratio is

    rho_t = pi_old_dense(y_t | y_<t) / pi_sparse(y_t | y_<t),
    log rho_t = old_logp_t - sampler_logp_t,

with pi_sparse the rollout's (compressed-KV) distribution the token was sampled from and
pi_old_dense the dense scorer's. Before any ``exp`` the log-ratio is clamped to
[-log_ratio_clamp, log_ratio_clamp] (default +-20); comparisons with bounds (rejection band, veto,
masks) use the unclamped log-ratio.

``correct`` dispatches on ``CorrectionMethod`` to one function per method:

sparse_rl (default; Sparse-RL: sparsity-aware rejection sampling + importance reweighting)
    1. weights per ``cfg.is_`` (``is_.enabled = false``: w_t = 1): level token  w_t = rho_t;  sequence  w_t = prod_{s in i} rho_s;
       geometric  w_t = exp(mean_{s in i} log rho_s); then mode truncate  min(w, U);
       clip  clamp(w, L, U);  mask: tokens with w outside [L, U] leave the loss mask (and its
       denominator), as the reference's tis_mode=mask (defaults: token, truncate, U = 1.5).
    2. rejection per ``cfg.rejection``: at level token, token t leaves the loss mask if rho_t
       not in [0.5, 1.5]; at level sequence / geometric the band applies to prod_t rho_t /
       exp(mean_t log rho_t) and a sequence outside it leaves whole (the reference's rs_level);
       at every level sequence i is vetoed (all its tokens leave the mask) if any raw
       rho_t < 1e-4. Rejected tokens leave the loss denominator too (``loss_mask`` = 0).
    3. normalisation (``is_.normalize``): w <- w / m, at level token m = mean_S(w) over the
       batch's tokens S; at level sequence / geometric m = the mean over the batch's sequences of
       each sequence's mean weight over its tokens in S (each sequence counts once, as slime's
       ``compute_mis_weights`` does). S by default (``is_.normalize_over = kept``) is the tokens
       left after rejection, so the weights entering the loss average exactly 1 (token level).
       ``valid`` takes every valid token before rejection instead, as the public Sparse-RL code
       does (with mode mask, their out-of-band weights count there too, as in the reference);
       the kept weights then average about, not exactly, 1.
    4. floor (``rejection.min_kept_share`` = f > 0; not in the reference): if fewer than a share
       f of the batch's sequences keep a token after steps 1-2, no token is kept, so the batch
       makes no optimizer step instead of a full one on the few sequences left.
none          w_t = 1, nothing rejected.
tis           w_t = min(rho_t, tis.cap) (cap 2.0; truncated IS, Yao et al. 2025), nothing rejected.
icepop        w_t = rho_t * 1[icepop.lower <= rho_t <= icepop.upper] (masked IS, IcePop); masked
              tokens get weight 0 but stay in the loss denominator.
seq_mask_tis  sequence i leaves the loss mask if exp(mean_t log rho_t) is outside
              [seq_mask_tis.lower, seq_mask_tis.upper]; kept tokens get
              min(rho_t, seq_mask_tis.cap).

Weights never carry gradient (they are computed from detached log-probs) and are 0 wherever
``loss_mask`` is 0. Padding (mask 0) never counts, even if it holds NaN; NaN/inf at a valid
position raises ValueError naming the tensor.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from correction._tensor import (as_mask, check_finite, check_shape, frac, masked_max,
                                masked_mean, masked_min, masked_sum, zero_outside)
from correction.config import (CorrectionConfig, CorrectionMethod, ISConfig, ISLevel, ISMode,
                               NormalizeOver, RejectionConfig)
from correction.metrics import mismatch_metrics


@dataclass
class CorrectionResult:
    weights: Tensor             # [B, T] detached IS weights, 0 where loss_mask is 0
    loss_mask: Tensor           # [B, T] float: mask minus rejected / vetoed tokens
    metrics: dict[str, float]   # mismatch/* and correction/* (floats)


@dataclass
class MethodOutput:
    """What a method function returns (bool tensors are [B, T] unless noted)."""
    weights: Tensor             # [B, T] weights before normalisation
    keep: Tensor                # tokens that stay in the loss mask
    truncated: Tensor           # weight changed by a truncate / clip bound
    masked: Tensor              # weight zeroed by a mask bound (token stays in the mask)
    rejected: Tensor            # left the loss mask by a token-level band
    vetoed: Tensor              # [B] sequences removed as a whole
    normalize: bool = False     # rescale to mean 1 over kept tokens
    normalize_over_valid: bool = False   # ... over all valid tokens (pre-rejection) instead
    normalize_per_sequence: bool = False  # ... each sequence's mean weight counted once
    min_kept_share: float = 0.0  # below this share of sequences keeping a token, keep nothing


def log_ratio(sampler_logp: Tensor, old_logp: Tensor, valid: Tensor) -> Tensor:
    """log rho = old_logp - sampler_logp at valid positions, 0 elsewhere; detached, >= float32."""
    dtype = torch.promote_types(sampler_logp.dtype, torch.float32)
    lr = old_logp.detach().to(dtype) - sampler_logp.detach().to(dtype)
    return zero_outside(lr, valid)


def level_log_weights(lr: Tensor, valid: Tensor, level: ISLevel) -> Tensor:
    """Log of the unbounded weight at ``level`` (token / sequence product / geometric mean),
    broadcast to [B, T]; 0 outside ``valid``."""
    level = ISLevel(level)
    if level == ISLevel.TOKEN:
        return zero_outside(lr, valid)
    total = masked_sum(lr, valid, dim=1)
    if level == ISLevel.GEOMETRIC:
        total = total / valid.sum(1).clamp(min=1)
    return zero_outside(total[:, None].expand_as(lr), valid)


def bounded_weights(log_w: Tensor, valid: Tensor, mode: ISMode, lower: float | Tensor,
                    upper: float | Tensor, clamp: float) -> tuple[Tensor, Tensor, Tensor]:
    """Apply ``mode`` to w = exp(clamp(log_w)); bounds may be floats or tensors broadcastable to
    [B, T] (e.g. per-row bounds). Returns (weights, truncated, masked), 0/False off ``valid``."""
    w = torch.exp(log_w.clamp(-clamp, clamp))
    lo = torch.as_tensor(lower, dtype=w.dtype, device=w.device)
    hi = torch.as_tensor(upper, dtype=w.dtype, device=w.device)
    mode = ISMode(mode)
    none = torch.zeros_like(valid)
    if mode == ISMode.TRUNCATE:
        truncated = valid & (w > hi)
        out, masked = torch.minimum(w, hi.expand_as(w)), none
    elif mode == ISMode.CLIP:
        truncated = valid & ((w > hi) | (w < lo))
        out, masked = torch.maximum(torch.minimum(w, hi.expand_as(w)), lo.expand_as(w)), none
    else:
        masked = valid & ((w > hi) | (w < lo))
        out, truncated = torch.where(masked, torch.zeros_like(w), w), none
    return zero_outside(out, valid), truncated, masked


def importance_weights(lr: Tensor, valid: Tensor, cfg: ISConfig,
                       clamp: float = 20.0) -> tuple[Tensor, Tensor, Tensor]:
    """Weights per ``ISConfig`` (level, mode, lower, upper) from the log-ratio; no normalisation.
    Returns (weights, truncated, masked)."""
    log_w = level_log_weights(lr, valid, cfg.level)
    return bounded_weights(log_w, valid, cfg.mode, cfg.lower, cfg.upper, clamp)


def log_bound(lower: float) -> float:
    """log of a band's lower bound; a bound of 0 (validation allows it) rejects nothing: -inf."""
    return math.log(lower) if lower > 0 else -math.inf


def rejection_mask(lr: Tensor, valid: Tensor,
                   cfg: RejectionConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Sparsity-aware rejection: returns (keep [B,T], rejected [B,T], vetoed [B]).

    rejected_t = r_t < lower or r_t > upper (bounds inclusive: r_t = upper is kept), r the ratio
    at ``cfg.level`` (rho_t, or its sequence's product / geometric mean on every token of it);
    vetoed_i   = any valid t in i with rho_t < veto_threshold; keep = valid & ~rejected & ~vetoed.
    """
    if not cfg.enabled:
        return valid.clone(), torch.zeros_like(valid), torch.zeros_like(valid.any(dim=1))
    level_lr = level_log_weights(lr, valid, cfg.level)   # token: lr itself; else per sequence
    rejected = valid & ((level_lr < log_bound(cfg.lower)) | (level_lr > math.log(cfg.upper)))
    if cfg.veto_threshold > 0:
        vetoed = (valid & (lr < math.log(cfg.veto_threshold))).any(dim=1)
    else:
        vetoed = torch.zeros_like(valid.any(dim=1))
    keep = valid & ~rejected & ~vetoed[:, None]
    return keep, rejected, vetoed


def normalize_weights(weights: Tensor, keep: Tensor, over: Tensor | None = None,
                      per_sequence: bool = False) -> tuple[Tensor, float]:
    """w / mean_over(w) (``over`` defaults to ``keep``), zeroed off ``keep``; so with the default
    the kept weights average 1. ``per_sequence``: the mean is over the sequences with a token in
    ``over`` of each one's mean weight there (each sequence counts once). Unchanged if that mean
    is 0 (nothing kept or every weight masked). Returns (weights, scale applied)."""
    over = keep if over is None else over
    if per_sequence:
        has = over.any(dim=1)
        seq_mean = masked_sum(weights, over, dim=1) / over.sum(dim=1).clamp(min=1)
        mean = masked_mean(seq_mean, has)
    else:
        mean = masked_mean(weights, over)
    if float(mean) <= 0.0:
        return zero_outside(weights, keep), 1.0
    return zero_outside(weights / mean, keep), float(1.0 / mean)


# --- one function per method ------------------------------------------------------------------

def _none_false(valid: Tensor) -> tuple[Tensor, Tensor]:
    return torch.zeros_like(valid), torch.zeros_like(valid.any(dim=1))


def method_sparse_rl(lr: Tensor, valid: Tensor, cfg: CorrectionConfig) -> MethodOutput:
    """Sparse-RL: IS weights per ``cfg.is_`` + rejection/veto per ``cfg.rejection``."""
    keep, rejected, vetoed = rejection_mask(lr, valid, cfg.rejection)
    if not cfg.is_.enabled:  # rejection alone
        no_tok = torch.zeros_like(valid)
        return MethodOutput(valid.to(lr.dtype), keep, no_tok, no_tok, rejected, vetoed,
                            min_kept_share=cfg.rejection.min_kept_share)
    w, truncated, masked = importance_weights(lr, valid, cfg.is_, cfg.log_ratio_clamp)
    if ISMode(cfg.is_.mode) == ISMode.MASK:
        # out of band: out of the loss mask; the weight keeps its (safety-bounded) value, which
        # only a normalisation over valid tokens sees, as in the reference
        keep = keep & ~masked
        raw = torch.exp(level_log_weights(lr, valid, cfg.is_.level)
                        .clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
        w = torch.where(masked, raw, w)
    return MethodOutput(w, keep, truncated, masked, rejected, vetoed, normalize=cfg.is_.normalize,
                        normalize_over_valid=NormalizeOver(cfg.is_.normalize_over)
                        == NormalizeOver.VALID,
                        normalize_per_sequence=ISLevel(cfg.is_.level) != ISLevel.TOKEN,
                        min_kept_share=cfg.rejection.min_kept_share)


def method_none(lr: Tensor, valid: Tensor, cfg: CorrectionConfig) -> MethodOutput:
    """No correction: unit weights on every valid token."""
    no_tok, no_seq = _none_false(valid)
    return MethodOutput(valid.to(lr.dtype), valid.clone(), no_tok, no_tok, no_tok, no_seq)


def method_tis(lr: Tensor, valid: Tensor, cfg: CorrectionConfig) -> MethodOutput:
    """Truncated IS: w_t = min(rho_t, cap); nothing rejected."""
    w, truncated, masked = bounded_weights(lr, valid, ISMode.TRUNCATE, 0.0, cfg.tis.cap,
                                           cfg.log_ratio_clamp)
    no_tok, no_seq = _none_false(valid)
    return MethodOutput(w, valid.clone(), truncated, masked, no_tok, no_seq)


def method_icepop(lr: Tensor, valid: Tensor, cfg: CorrectionConfig) -> MethodOutput:
    """Masked IS (IcePop): w_t = rho_t inside [lower, upper], else 0 (token stays in the mask)."""
    w, truncated, masked = bounded_weights(lr, valid, ISMode.MASK, cfg.icepop.lower,
                                           cfg.icepop.upper, cfg.log_ratio_clamp)
    no_tok, no_seq = _none_false(valid)
    return MethodOutput(w, valid.clone(), truncated, masked, no_tok, no_seq)


def method_seq_mask_tis(lr: Tensor, valid: Tensor, cfg: CorrectionConfig) -> MethodOutput:
    """Sequence mask on the geometric-mean ratio, then token TIS on the kept sequences."""
    c = cfg.seq_mask_tis
    geo = masked_sum(lr, valid, dim=1) / valid.sum(dim=1).clamp(min=1)
    has = valid.any(dim=1)
    out = has & ((geo < log_bound(c.lower)) | (geo > math.log(c.upper)))
    keep = valid & ~out[:, None]
    w, truncated, masked = bounded_weights(lr, keep, ISMode.TRUNCATE, 0.0, c.cap,
                                           cfg.log_ratio_clamp)
    return MethodOutput(w, keep, truncated, masked, torch.zeros_like(valid), out)


METHODS: dict[CorrectionMethod, Callable[[Tensor, Tensor, CorrectionConfig], MethodOutput]] = {
    CorrectionMethod.SPARSE_RL: method_sparse_rl,
    CorrectionMethod.NONE: method_none,
    CorrectionMethod.TIS: method_tis,
    CorrectionMethod.ICEPOP: method_icepop,
    CorrectionMethod.SEQ_MASK_TIS: method_seq_mask_tis,
}


# --- entry point --------------------------------------------------------------------------------

def check_inputs(sampler_logp: Tensor, old_logp: Tensor, mask: Tensor,
                 old_name: str = "old_logp") -> Tensor:
    """Shape checks ([B, T], equal), finiteness at valid positions; returns the bool mask."""
    if sampler_logp.dim() != 2:
        raise ValueError(f"sampler_logp must be [B, T]; got shape {tuple(sampler_logp.shape)}")
    check_shape(old_name, old_logp, sampler_logp.shape)
    valid = as_mask(mask, sampler_logp)
    check_finite("sampler_logp", sampler_logp, valid)
    check_finite(old_name, old_logp, valid)
    return valid


def finish(out: MethodOutput, valid: Tensor, dtype: torch.dtype,
           prefix: str = "correction/") -> tuple[Tensor, Tensor, dict[str, float]]:
    """Apply the floor (``out.min_kept_share``), zero the weights off ``keep``, normalise if
    asked, and compute the correction/* metrics. Returns (weights detached, loss_mask float,
    metrics)."""
    keep = out.keep & valid
    has = valid.any(dim=1)
    seqs_kept = frac((keep.any(dim=1) & has).sum(), has.sum())
    floored = out.min_kept_share > 0 and bool(has.any()) and seqs_kept < out.min_kept_share
    if floored:
        keep = torch.zeros_like(keep)
    scale = 1.0
    if out.normalize:
        over = valid if out.normalize_over_valid else keep
        weights, scale = normalize_weights(zero_outside(out.weights, valid), keep, over,
                                           out.normalize_per_sequence)
    else:
        weights = zero_outside(out.weights, keep)
    weights = weights.detach().to(dtype)
    n_valid, n_keep = valid.sum(), keep.sum()
    vetoed = out.vetoed & has
    mean_w = float(masked_mean(weights, keep))
    mean_w2 = float(masked_mean(weights * weights, keep))
    chi2 = mean_w2 / mean_w ** 2 - 1.0 if mean_w > 0 else 0.0
    m = {
        "weight_mean": mean_w,
        "weight_min": masked_min(weights, keep),
        "weight_max": masked_max(weights, keep),
        "weight_chi2": chi2,
        "ess_frac": 1.0 / (1.0 + chi2) if mean_w > 0 else 0.0,
        "norm_scale": scale,
        "frac_truncated": frac((out.truncated & valid).sum(), n_valid),
        "frac_masked": frac((out.masked & valid).sum(), n_valid),
        "frac_rejected": frac((out.rejected & valid).sum(), n_valid),
        "frac_vetoed": frac(vetoed.sum(), has.sum()),
        "frac_vetoed_tokens": frac((valid & vetoed[:, None]).sum(), n_valid),
        "frac_kept": frac(n_keep, n_valid),
        "frac_seqs_kept": seqs_kept,          # before the floor
        "batch_floored": float(floored),      # 1: under the floor, nothing kept
        "num_valid_tokens": float(n_valid),
        "num_kept_tokens": float(n_keep),
        "num_seqs": float(valid.shape[0]),
    }
    return weights, keep.to(dtype), {prefix + k: v for k, v in m.items()}


def correct(sampler_logp: Tensor, old_logp: Tensor, mask: Tensor,
            cfg: CorrectionConfig) -> CorrectionResult:
    """Importance weights, loss mask and mismatch metrics for a batch of sparse rollouts.

    Args:
        sampler_logp: [B, T] log pi_sparse(y_t) recorded by the rollout (0 / anything at padding).
        old_logp: [B, T] log pi_old_dense(y_t) from the dense scorer.
        mask: [B, T] bool or float, valid response tokens (> 0).
        cfg: ``CorrectionConfig``; ``cfg.method`` picks the function (see module doc).
    Returns:
        ``CorrectionResult(weights, loss_mask, metrics)``; weights are detached and 0 off the loss
        mask; loss_mask is float (dtype of the weights: the inputs' float dtype, at least float32).
    Raises:
        ValueError naming ``sampler_logp`` / ``old_logp`` / ``mask`` on NaN/inf at a valid
        position or on a shape mismatch.
    """
    valid = check_inputs(sampler_logp, old_logp, mask)
    lr = log_ratio(sampler_logp, old_logp, valid)
    out = METHODS[CorrectionMethod(cfg.method)](lr, valid, cfg)
    weights, loss_mask, metrics = finish(out, valid, lr.dtype)
    metrics.update(mismatch_metrics(sampler_logp, old_logp, valid, cfg.log_ratio_clamp))
    return CorrectionResult(weights, loss_mask, metrics)
