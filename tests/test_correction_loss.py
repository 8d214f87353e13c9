"""GRPO advantages and policy_loss: closed forms, aggregation, KL/entropy, empty and all-rejected
batches, gradients, NaN/inf."""
from __future__ import annotations

import math

import pytest
import torch

from correction import (AdvantageConfig, CorrectionConfig, KLEstimator, LossAggregation,
                        LossConfig, correct, grpo_advantages, kl_penalty, policy_loss)

torch.set_num_threads(1)

T = torch.tensor


def cfg_with(**loss) -> CorrectionConfig:
    return CorrectionConfig(loss=LossConfig(**loss))


# --- advantages ---------------------------------------------------------------------------------

def test_grpo_group_mean_and_std():
    r = T([1.0, 0.0, 1.0, 1.0, 0.5, 2.0, 4.0, 6.0])
    g = T([7, 7, 3, 3, 9, 5, 5, 5])
    adv, m = grpo_advantages(r, g, AdvantageConfig(eps=1e-12))
    s2 = math.sqrt(0.5)                     # unbiased std of {0, 1}
    expect = [0.5 / s2, -0.5 / s2, 0, 0, 0, -1.0, 0.0, 1.0]     # std of {2,4,6} = 2
    assert torch.allclose(adv, T(expect), atol=1e-6)
    assert m["adv/num_groups"] == 4
    assert m["adv/frac_zero_groups"] == pytest.approx(2 / 4)    # equal rewards + singleton


def test_grpo_without_std_and_with_correction_config():
    r = T([1.0, 0.0, 3.0])
    g = T([0, 0, 1])
    cfg = CorrectionConfig()
    cfg.advantage.normalize_std = False
    adv, _ = grpo_advantages(r, g, cfg)
    assert adv.tolist() == [0.5, -0.5, 0.0]


def test_grpo_errors_and_empty():
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages(T([1.0, float("nan")]), T([0, 0]), AdvantageConfig())
    with pytest.raises(ValueError, match="group_index"):
        grpo_advantages(T([1.0, 0.0]), T([0]), AdvantageConfig())
    adv, m = grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long), AdvantageConfig())
    assert adv.numel() == 0 and all(math.isfinite(v) for v in m.values())


# --- policy loss: closed form -------------------------------------------------------------------

def test_on_policy_loss_is_minus_weighted_advantage_token_mean():
    old = torch.full((2, 3), -1.0)
    new = old.clone().requires_grad_(True)
    adv = T([1.0, -2.0])
    w = T([[1.0, 2.0, 0.5], [1.0, 1.0, 9.0]])
    keep = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, m = policy_loss(new, old, adv, w, keep, CorrectionConfig())
    # -(1 * (1 + 2 + 0.5) + (-2) * (1 + 1)) / 5 = -(3.5 - 4) / 5
    assert loss.item() == pytest.approx(0.1)
    loss.backward()
    # d/dnew of -A w r at r = 1 is -A w / n; the padded token (weight 9) gets nothing
    assert torch.allclose(new.grad, T([[-0.2, -0.4, -0.1], [0.4, 0.4, 0.0]]))
    assert m["loss/clipfrac"] == 0.0 and m["loss/num_kept_tokens"] == 5


def test_seq_mean_aggregation():
    old = torch.zeros(2, 3)
    adv = T([1.0, 1.0])
    w = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    keep = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    cfg = cfg_with(aggregation=LossAggregation.SEQ_MEAN)
    loss, _ = policy_loss(old.clone(), old, adv, w, keep, cfg)
    assert loss.item() == pytest.approx(-(2.0 + 4.0) / 2)      # seq means 2 and 4
    loss_tok, _ = policy_loss(old.clone(), old, adv, w, keep, CorrectionConfig())
    assert loss_tok.item() == pytest.approx(-10.0 / 4)


@pytest.mark.parametrize("ratio,adv,eps_low,eps_high,expect,clipped", [
    (1.5, 1.0, 0.2, 0.2, -1.2, True),      # A > 0: capped at 1 + eps_high
    (1.5, 1.0, 0.2, 0.28, -1.28, True),    # clip-higher
    (0.5, 1.0, 0.2, 0.2, -0.5, False),     # A > 0, ratio below 1 - eps: unclipped (pessimistic)
    (0.5, -1.0, 0.2, 0.2, 0.8, True),      # A < 0: floor at 1 - eps_low
    (1.5, -1.0, 0.2, 0.2, 1.5, False),     # A < 0, ratio above 1 + eps: unclipped
])
def test_ppo_clip_closed_form(ratio, adv, eps_low, eps_high, expect, clipped):
    old = T([[-2.0]])
    new = (old + math.log(ratio)).requires_grad_(True)
    cfg = cfg_with(clip_eps_low=eps_low, clip_eps_high=eps_high)
    loss, m = policy_loss(new, old, T([adv]), T([[1.0]]), T([[1.0]]), cfg)
    assert loss.item() == pytest.approx(expect, rel=1e-5)
    assert m["loss/clipfrac"] == (1.0 if clipped else 0.0)
    loss.backward()
    assert (new.grad.abs().sum().item() == 0.0) == clipped     # clipped branch has no gradient


def test_dual_clip():
    old = T([[-2.0, -2.0]])
    new = old + math.log(4.0)
    cfg = cfg_with(dual_clip_c=3.0)
    loss, m = policy_loss(new, old, T([-1.0]), T([[1.0, 0.5]]), T([[1.0, 1.0]]), cfg)
    assert loss.item() == pytest.approx((3.0 * 1.0 + 3.0 * 0.5) / 2)    # min(4, 3) per token
    assert m["loss/dual_clipfrac"] == 1.0


def test_weights_and_rejection_mask_applied_from_correct():
    s = torch.zeros(1, 3) - 1.0
    o = s + torch.log(T([[1.0, 1.2, 3.0]]))                    # 3.0 is rejected
    r = correct(s, o, torch.ones(1, 3), CorrectionConfig())
    new = o.clone().requires_grad_(True)
    loss, _ = policy_loss(new, o, T([1.0]), r.weights, r.loss_mask, CorrectionConfig())
    # kept weights 1, 1.2 normalised by 1.1 -> mean 1 -> loss -1 over two kept tokens
    assert loss.item() == pytest.approx(-1.0)
    loss.backward()
    assert new.grad[0, 2] == 0.0


@pytest.mark.parametrize("est,fn", [
    (KLEstimator.K1, lambda d: d), (KLEstimator.K2, lambda d: 0.5 * d * d),
    (KLEstimator.K3, lambda d: math.exp(-d) + d - 1.0)])
def test_kl_estimators_closed_form(est, fn):
    new, ref = T([[-1.0, -2.0]]), T([[-1.5, -1.0]])
    got = kl_penalty(new, ref, est)
    assert torch.allclose(got, T([[fn(0.5), fn(-1.0)]]), atol=1e-6)


def test_kl_and_entropy_terms():
    old = torch.zeros(1, 2) - 1.0
    ref = old - 0.5
    ent = T([[2.0, 4.0]])
    cfg = cfg_with(kl_coef=0.1, entropy_coef=0.01)
    loss, m = policy_loss(old.clone(), old, T([0.0]), torch.ones(1, 2), torch.ones(1, 2), cfg,
                          ref_logp=ref, entropy=ent)
    k3 = math.exp(-0.5) + 0.5 - 1.0
    assert loss.item() == pytest.approx(0.1 * k3 - 0.01 * 3.0, rel=1e-5)
    assert m["loss/kl_ref"] == pytest.approx(k3, rel=1e-5)
    assert m["loss/entropy"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(old.clone(), old, T([0.0]), torch.ones(1, 2), torch.ones(1, 2), cfg)


# --- degenerate batches -------------------------------------------------------------------------

@pytest.mark.parametrize("agg", list(LossAggregation))
@pytest.mark.parametrize("shape", [(2, 0), (0, 4), (3, 4)])
def test_empty_or_all_masked_gives_finite_zero_loss(agg, shape):
    old = torch.zeros(shape)
    new = torch.zeros(shape, requires_grad=True)
    cfg = cfg_with(aggregation=agg, kl_coef=0.1, entropy_coef=0.1)
    loss, m = policy_loss(new, old, torch.ones(shape[0]), torch.ones(shape), torch.zeros(shape),
                          cfg, ref_logp=old, entropy=torch.ones(shape, requires_grad=True))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(new.grad, torch.zeros(shape))
    assert all(math.isfinite(v) for v in m.values())


def test_all_rejected_batch_end_to_end():
    s = torch.full((2, 3), -1.0)
    o = s + math.log(3.0)                                       # every rho = 3 > 1.5
    r = correct(s, o, torch.ones(2, 3), CorrectionConfig())
    assert r.loss_mask.sum() == 0 and r.weights.sum() == 0
    new = o.clone().requires_grad_(True)
    loss, _ = policy_loss(new, o, T([1.0, -1.0]), r.weights, r.loss_mask, CorrectionConfig())
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(new.grad, torch.zeros(2, 3))


def test_padding_nan_in_new_logp_gives_finite_loss_and_grad():
    old = torch.zeros(1, 3)
    new = T([[0.0, 0.0, float("nan")]]).requires_grad_(True)
    loss, _ = policy_loss(new, old, T([1.0]), torch.ones(1, 3), T([[1.0, 1.0, 0.0]]),
                          CorrectionConfig())
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(new.grad).all()


def test_no_gradient_into_weights_or_old_logp():
    old = torch.zeros(1, 2, requires_grad=True)
    w = torch.ones(1, 2, requires_grad=True)
    new = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss(new, old, T([1.0]), w, torch.ones(1, 2), CorrectionConfig())
    loss.backward()
    assert w.grad is None and old.grad is None and new.grad is not None


@pytest.mark.parametrize("name", ["new_logp", "old_logp", "advantages", "weights", "ref_logp",
                                  "entropy"])
def test_non_finite_at_kept_position_raises(name):
    args = {"new_logp": torch.zeros(1, 2), "old_logp": torch.zeros(1, 2),
            "advantages": T([1.0]), "weights": torch.ones(1, 2), "ref_logp": torch.zeros(1, 2),
            "entropy": torch.zeros(1, 2)}
    args[name] = args[name].clone()
    args[name].view(-1)[0] = float("inf") if name == "weights" else float("nan")
    with pytest.raises(ValueError, match=name):
        policy_loss(args["new_logp"], args["old_logp"], args["advantages"], args["weights"],
                    torch.ones(1, 2), CorrectionConfig(), ref_logp=args["ref_logp"],
                    entropy=args["entropy"])


@pytest.mark.parametrize("agg", list(LossAggregation))
def test_micro_batches_with_global_denominator_add_up(agg):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 5, generator=g, dtype=torch.float64)
    new = old + 0.1 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    w = torch.rand(4, 5, generator=g, dtype=torch.float64) + 0.5
    keep = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    cfg = cfg_with(aggregation=agg)
    full, _ = policy_loss(new, old, adv, w, keep, cfg)
    n = float(keep.sum()) if agg == LossAggregation.TOKEN_MEAN else float(keep.any(1).sum())
    parts = [policy_loss(new[i:i + 2], old[i:i + 2], adv[i:i + 2], w[i:i + 2], keep[i:i + 2],
                         cfg, denominator=n)[0] for i in (0, 2)]
    assert sum(parts).item() == pytest.approx(full.item())


def test_bfloat16_new_logp_computed_in_float32():
    old = torch.zeros(1, 2)
    new = torch.zeros(1, 2, dtype=torch.bfloat16, requires_grad=True)
    loss, _ = policy_loss(new, old, T([1.0]), torch.ones(1, 2), torch.ones(1, 2),
                          CorrectionConfig())
    assert loss.dtype == torch.float32
    loss.backward()
    assert new.grad.dtype == torch.bfloat16
