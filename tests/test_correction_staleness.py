"""Staleness-aware correction: the sparsity x staleness split, lag-dependent bounds, max lag."""
from __future__ import annotations

import math

import pytest
import torch

from correction import (CorrectionConfig, CorrectionMethod, ISMode, LagScaling, StalenessConfig,
                        correct, staleness_bounds, staleness_correct)

torch.set_num_threads(1)


def logps(s_rho, u_rho):
    """sampler, dense_v, dense_new with dense_v/sampler = s_rho and dense_new/dense_v = u_rho."""
    s = torch.full((len(s_rho), len(s_rho[0])), -1.0, dtype=torch.float64)
    v = s + torch.tensor(s_rho, dtype=torch.float64).log()
    n = v + torch.tensor(u_rho, dtype=torch.float64).log()
    return s, v, n


def plain(method=CorrectionMethod.SPARSE_RL, **st) -> CorrectionConfig:
    cfg = CorrectionConfig(method=method, staleness=StalenessConfig(**st))
    cfg.is_.normalize = False
    cfg.rejection.enabled = False
    return cfg


def test_lag_zero_reduces_to_correct():
    s, v, _ = logps([[1.0, 1.3, 2.0], [0.4, 1.0, 1.1]], [[1.0] * 3] * 2)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    cfg = CorrectionConfig()
    a = staleness_correct(s, v, v, mask, torch.tensor([3, 3]), 3, cfg)
    b = correct(s, v, mask, cfg)
    assert torch.allclose(a.weights, b.weights) and torch.equal(a.loss_mask, b.loss_mask)
    assert a.metrics["staleness/k3"] == 0.0 and a.metrics["staleness/lag_mean"] == 0.0
    for k, val in b.metrics.items():
        assert a.metrics[k] == pytest.approx(val)


def test_weight_is_product_of_sparsity_and_staleness_parts():
    s_rho = [[1.2, 2.0, 0.9]]
    u_rho = [[1.1, 0.8, 3.0]]
    s, v, n = logps(s_rho, u_rho)
    cfg = plain(upper=2.0, lag_scaling=LagScaling.CONSTANT)
    r = staleness_correct(s, v, n, torch.ones(1, 3), torch.tensor([5]), 6, cfg)
    expect = [min(a, 1.5) * min(b, 2.0) for a, b in zip(s_rho[0], u_rho[0])]
    assert torch.allclose(r.weights, torch.tensor([expect], dtype=torch.float64))
    assert r.metrics["staleness/frac_truncated"] == pytest.approx(1 / 3)
    assert r.metrics["correction/frac_truncated"] == pytest.approx(1 / 3)   # sparsity part
    assert r.metrics["staleness/rho_max"] == pytest.approx(3.0)
    assert r.metrics["mismatch/rho_max"] == pytest.approx(2.0)


@pytest.mark.parametrize("scaling,lag,cap", [
    (LagScaling.CONSTANT, 4, 2.0), (LagScaling.LINEAR, 1, 2.0), (LagScaling.LINEAR, 2, 4.0),
    (LagScaling.SQRT, 4, 4.0), (LagScaling.SQRT, 0, 2.0)])
def test_staleness_bounds_depend_on_lag(scaling, lag, cap):
    s, v, n = logps([[1.0]], [[10.0]])
    cfg = plain(CorrectionMethod.NONE, upper=2.0, lower=0.5, lag_scaling=scaling, max_lag=8)
    r = staleness_correct(s, v, n, torch.ones(1, 1), torch.tensor([10]), 10 + lag, cfg)
    assert r.weights.item() == pytest.approx(cap)
    lo, hi = staleness_bounds(torch.tensor([lag]), 0.5, 2.0, scaling)
    assert hi.item() == pytest.approx(cap) and lo.item() == pytest.approx(1 / cap)


def test_staleness_mask_and_clip_modes():
    s, v, n = logps([[1.0, 1.0, 1.0]], [[0.3, 1.0, 3.0]])
    base = dict(upper=2.0, lower=0.5, lag_scaling=LagScaling.CONSTANT)
    r = staleness_correct(s, v, n, torch.ones(1, 3), torch.tensor([0]), 1,
                          plain(CorrectionMethod.NONE, mode=ISMode.CLIP, **base))
    assert torch.allclose(r.weights, torch.tensor([[0.5, 1.0, 2.0]], dtype=torch.float64))
    r = staleness_correct(s, v, n, torch.ones(1, 3), torch.tensor([0]), 1,
                          plain(CorrectionMethod.NONE, mode=ISMode.MASK, **base))
    assert torch.allclose(r.weights, torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64))
    assert r.metrics["staleness/frac_masked"] == pytest.approx(2 / 3)


def test_samples_beyond_max_lag_are_rejected():
    s, v, n = logps([[1.0, 1.0]] * 3, [[1.0, 1.0]] * 3)
    r = staleness_correct(s, v, n, torch.ones(3, 2), torch.tensor([10, 8, 7]), 10,
                          CorrectionConfig(staleness=StalenessConfig(max_lag=2)))
    assert r.loss_mask.tolist() == [[1, 1], [1, 1], [0, 0]]       # lag 0, 2 (= max) kept, 3 out
    assert r.metrics["staleness/frac_too_stale"] == pytest.approx(1 / 3)
    assert r.metrics["staleness/lag_max"] == 3.0
    assert r.weights[:2].mean().item() == pytest.approx(1.0)


def test_kept_share_floor_counts_the_samples_too_stale():
    """rejection.min_kept_share is applied after the lag bound: 2 of 3 samples kept (one too
    stale) passes a floor of 0.6 and keeps nothing under one of 0.7."""
    s, v, n = logps([[1.0, 1.0]] * 3, [[1.0, 1.0]] * 3)
    version = torch.tensor([10, 8, 7])
    for floor, kept in ((0.6, 4), (0.7, 0)):
        cfg = CorrectionConfig(staleness=StalenessConfig(max_lag=2))
        cfg.rejection.min_kept_share = floor
        r = staleness_correct(s, v, n, torch.ones(3, 2), version, 10, cfg)
        assert r.loss_mask.sum() == kept
        assert r.metrics["correction/frac_seqs_kept"] == pytest.approx(2 / 3)
        assert r.metrics["correction/batch_floored"] == float(kept == 0)


def test_per_sample_new_version_and_errors():
    s, v, n = logps([[1.0], [1.0]], [[1.0], [1.0]])
    r = staleness_correct(s, v, n, torch.ones(2, 1), torch.tensor([1, 1]), torch.tensor([2, 9]),
                          CorrectionConfig(staleness=StalenessConfig(max_lag=4)))
    assert r.loss_mask.tolist() == [[1.0], [0.0]]
    with pytest.raises(ValueError, match="older"):
        staleness_correct(s, v, n, torch.ones(2, 1), torch.tensor([5, 1]), 3, CorrectionConfig())
    bad = n.clone()
    bad[1, 0] = float("nan")
    with pytest.raises(ValueError, match="dense_logp_new"):
        staleness_correct(s, v, bad, torch.ones(2, 1), torch.tensor([1, 1]), 2,
                          CorrectionConfig())
    with pytest.raises(ValueError, match="sampler_version"):
        staleness_correct(s, v, n, torch.ones(2, 1), torch.tensor([1]), 2, CorrectionConfig())


def test_default_staleness_keeps_normalisation_and_rejection():
    s, v, n = logps([[1.0, 1.2, 3.0], [1.0, 1.0, 1.0]], [[1.0, 1.5, 1.0], [0.9, 1.0, 1.0]])
    r = staleness_correct(s, v, n, torch.ones(2, 3), torch.tensor([0, 0]), 1, CorrectionConfig())
    assert r.loss_mask.tolist() == [[1, 1, 0], [1, 1, 1]]        # sparsity rho 3.0 rejected
    kept = r.weights[r.loss_mask > 0]
    assert kept.mean().item() == pytest.approx(1.0)
    raw = torch.tensor([1.0, 1.8, 0.9, 1.0, 1.0])
    assert torch.allclose(kept, (raw / raw.mean()).double())
    assert math.isfinite(r.metrics["staleness/weight_mean"])
