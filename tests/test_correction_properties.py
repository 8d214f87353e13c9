"""Hypothesis invariants of the correction library (small, fast: max_examples <= 50)."""
from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from correction import (CorrectionConfig, CorrectionMethod, ISConfig, ISLevel, ISMode,
                        correct, grpo_advantages, policy_loss)

torch.set_num_threads(1)
SETTINGS = settings(max_examples=50, deadline=None)


@st.composite
def batches(draw, max_b: int = 4, max_t: int = 6, spread: float = 3.0):
    """(sampler_logp, old_logp, mask) with old = sampler + noise of scale up to ``spread``."""
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(0, max_t))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.floats(0.0, spread))
    g = torch.Generator().manual_seed(seed)
    s = -torch.rand(b, t, generator=g, dtype=torch.float64) * 8.0
    o = s + torch.randn(b, t, generator=g, dtype=torch.float64) * scale
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return s, o, mask


configs = st.builds(
    lambda method, level, mode, normalize: CorrectionConfig(
        method=method, is_=ISConfig(level=level, mode=mode, lower=0.5, upper=1.5,
                                    normalize=normalize)),
    st.sampled_from(list(CorrectionMethod)), st.sampled_from(list(ISLevel)),
    st.sampled_from(list(ISMode)), st.booleans())


@SETTINGS
@given(batches(), configs)
def test_weights_live_on_the_loss_mask(batch, cfg):
    s, o, mask = batch
    r = correct(s, o, mask, cfg)
    assert torch.isfinite(r.weights).all() and (r.weights >= 0).all()
    assert (r.weights[r.loss_mask == 0] == 0).all()
    assert (r.loss_mask <= mask.double()).all()
    assert all(math.isfinite(v) for v in r.metrics.values())


@SETTINGS
@given(batches(), st.sampled_from(list(ISLevel)), st.sampled_from(list(ISMode)))
def test_normalised_weights_have_mean_one_over_kept_tokens(batch, level, mode):
    s, o, mask = batch
    cfg = CorrectionConfig(is_=ISConfig(level=level, mode=mode, lower=0.5, upper=1.5))
    r = correct(s, o, mask, cfg)
    keep = r.loss_mask > 0
    if not keep.any() or r.weights[keep].sum() == 0:
        return
    if level == ISLevel.TOKEN:
        assert abs(r.weights[keep].mean().item() - 1.0) < 1e-9
    else:  # one weight per sequence: each kept sequence's mean counts once
        has = keep.any(1)
        seq = (r.weights * keep).sum(1)[has] / keep.sum(1)[has]
        assert abs(seq.mean().item() - 1.0) < 1e-9


@SETTINGS
@given(batches(), configs)
def test_no_mismatch_means_unit_weights_and_nothing_rejected(batch, cfg):
    s, _, mask = batch
    r = correct(s, s.clone(), mask, cfg)
    assert torch.equal(r.weights, mask.double())
    assert torch.equal(r.loss_mask, mask.double())


@SETTINGS
@given(batches(), configs, st.integers(0, 2**31 - 1))
def test_padding_values_never_matter(batch, cfg, seed):
    s, o, mask = batch
    g = torch.Generator().manual_seed(seed)
    garbage = torch.randn(s.shape, generator=g, dtype=torch.float64) * 1e3
    garbage[garbage > 2e3] = float("nan")
    s2 = torch.where(mask, s, garbage)
    o2 = torch.where(mask, o, -garbage)
    a, b = correct(s, o, mask, cfg), correct(s2, o2, mask, cfg)
    assert torch.equal(a.weights, b.weights) and torch.equal(a.loss_mask, b.loss_mask)
    assert a.metrics == b.metrics


@SETTINGS
@given(batches(), st.floats(1.0, 3.0))
def test_truncated_weights_never_exceed_the_cap(batch, cap):
    s, o, mask = batch
    cfg = CorrectionConfig(is_=ISConfig(upper=cap, normalize=False))
    cfg.rejection.enabled = False
    r = correct(s, o, mask, cfg)
    assert (r.weights <= cap + 1e-12).all()
    rho = torch.exp(o - s)
    assert torch.allclose(r.weights, torch.where(mask, rho.clamp(max=cap), 0.0))


@SETTINGS
@given(batches(min(4, 4), 6, spread=0.3), st.data())
def test_one_catastrophic_token_vetoes_exactly_its_sequence(batch, data):
    s, o, mask = batch
    rows = [i for i in range(mask.shape[0]) if mask[i].any()]
    if not rows:
        return
    i = data.draw(st.sampled_from(rows))
    t = data.draw(st.sampled_from(mask[i].nonzero().flatten().tolist()))
    before = correct(s, o, mask, CorrectionConfig())
    o2 = o.clone()
    o2[i, t] = s[i, t] + math.log(1e-5)
    after = correct(s, o2, mask, CorrectionConfig())
    assert after.loss_mask[i].sum() == 0
    others = [j for j in range(mask.shape[0]) if j != i]
    assert torch.equal(after.loss_mask[others], before.loss_mask[others])


@SETTINGS
@given(batches(spread=5.0), configs, st.integers(0, 2**31 - 1))
def test_policy_loss_always_finite_with_finite_grad(batch, cfg, seed):
    s, o, mask = batch
    g = torch.Generator().manual_seed(seed)
    r = correct(s, o, mask, cfg)
    new = (o + torch.randn(o.shape, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    adv = torch.randn(o.shape[0], generator=g, dtype=torch.float64)
    loss, m = policy_loss(new, o, adv, r.weights, r.loss_mask, cfg, ref_logp=s,
                          entropy=torch.rand(o.shape, generator=g, dtype=torch.float64))
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(new.grad).all()
    assert (new.grad[r.loss_mask == 0] == 0).all()
    assert all(math.isfinite(v) for v in m.values())


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 4), st.floats(-5, 5)), min_size=1, max_size=12),
       st.floats(-3, 3), st.booleans())
def test_grpo_advantages_centre_each_group_and_ignore_shifts(rows, shift, normalize):
    gi = torch.tensor([r[0] for r in rows])
    rew = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    cfg = CorrectionConfig()
    cfg.advantage.normalize_std = normalize
    adv, _ = grpo_advantages(rew, gi, cfg)
    adv2, _ = grpo_advantages(rew + shift, gi, cfg)
    assert torch.allclose(adv, adv2, atol=1e-6)
    for g in gi.unique():
        sel = gi == g
        assert abs(adv[sel].sum().item()) < 1e-6
        if sel.sum() == 1:
            assert adv[sel].item() == 0.0
