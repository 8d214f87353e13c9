"""Mismatch metrics: KL estimators, chi-square, PPL ratio, exact and sampled agreement, the
Sparrow tail statistic."""
from __future__ import annotations

import math

import pytest
import torch

from correction import (dropped_signal, mismatch_metrics, sampled_agreement, sparrow_tail,
                        tv_agreement)

torch.set_num_threads(1)


def test_closed_form_estimators():
    rho = [2.0, 0.5, 1.0]
    s = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], dtype=torch.float64)
    o = s.clone()
    o[0, :3] += torch.log(torch.tensor(rho, dtype=torch.float64))
    mask = torch.tensor([[True, True, True, False]])
    m = mismatch_metrics(s, o, mask)
    lr = [math.log(r) for r in rho]
    assert m["mismatch/k1"] == pytest.approx(-sum(lr) / 3)
    assert m["mismatch/k3"] == pytest.approx(sum(r - 1 - math.log(r) for r in rho) / 3)
    assert m["mismatch/chi2"] == pytest.approx(sum(r * r for r in rho) / 3 - 1)
    assert m["mismatch/ppl_sampler"] == pytest.approx(math.exp(3.5 / 3))
    assert m["mismatch/ppl_old"] == pytest.approx(math.exp(-(o[0, :3].sum().item()) / 3))
    assert m["mismatch/ppl_ratio"] == pytest.approx(
        m["mismatch/ppl_old"] / m["mismatch/ppl_sampler"])
    assert m["mismatch/rho_mean"] == pytest.approx(3.5 / 3)
    assert m["mismatch/rho_min"] == pytest.approx(0.5)
    assert m["mismatch/rho_max"] == pytest.approx(2.0)
    assert m["mismatch/agreement_mean"] == pytest.approx(2.5 / 3)     # min(1, rho)
    assert m["mismatch/num_tokens"] == 3


def test_no_mismatch_and_empty_values():
    z = torch.zeros(2, 3)
    m = mismatch_metrics(z, z, torch.ones(2, 3))
    assert m["mismatch/k1"] == 0 and m["mismatch/k3"] == 0 and m["mismatch/chi2"] == 0
    assert m["mismatch/agreement_p5"] == 1.0 and m["mismatch/ppl_ratio"] == 1.0
    e = mismatch_metrics(z, z, torch.zeros(2, 3))
    assert e["mismatch/num_tokens"] == 0 and e["mismatch/rho_mean"] == 1.0
    assert all(math.isfinite(v) for v in e.values())


def test_tv_agreement_exact():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]])
    got = tv_agreement(p.log(), q.log())
    assert torch.allclose(got, torch.tensor([0.6, 1.0, 0.0]), atol=1e-6)
    tv = 0.5 * (p - q).abs().sum(-1)
    assert torch.allclose(got, 1 - tv, atol=1e-6)


def test_sampled_agreement_is_unbiased_for_exact_agreement():
    """E_{y~q}[min(1, p(y)/q(y))] = sum_y min(p, q) = 1 - TV, computed exactly over the vocab."""
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        p = torch.softmax(torch.randn(16, generator=g, dtype=torch.float64) * 2, -1)
        q = torch.softmax(torch.randn(16, generator=g, dtype=torch.float64) * 2, -1)
        expected = (q * sampled_agreement(p.log() - q.log())).sum()
        assert expected.item() == pytest.approx(tv_agreement(p.log(), q.log()).item(), abs=1e-9)


def test_sparrow_tail_is_fifth_percentile_over_valid_tokens():
    a = torch.linspace(0, 1, 101).reshape(1, 101)
    assert sparrow_tail(a, torch.ones_like(a)) == pytest.approx(0.05)
    padded = torch.cat([a, torch.zeros(1, 50)], dim=1)      # padding zeros must not drag the tail
    mask = torch.cat([torch.ones(1, 101), torch.zeros(1, 50)], dim=1)
    assert sparrow_tail(padded, mask) == pytest.approx(0.05)
    assert sparrow_tail(a, torch.zeros_like(a)) == 1.0


def test_metrics_reject_non_finite():
    s = torch.zeros(1, 2)
    o = torch.tensor([[0.0, float("nan")]])
    with pytest.raises(ValueError, match="old_logp"):
        mismatch_metrics(s, o, torch.ones(1, 2))
    with pytest.raises(ValueError, match="logp_a"):
        tv_agreement(torch.tensor([float("nan"), 0.0]), torch.zeros(2))


def test_dropped_signal_closed_form():
    """|A|-weighted share of valid tokens off the loss mask, per advantage sign; padding and
    zero-advantage rows never count."""
    adv = torch.tensor([1.0, 2.0, -0.5, -1.5, 0.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    keep = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]],
                        dtype=torch.float32)
    m = dropped_signal(adv, mask, keep)
    # positive rows: 3 tokens x 1 (one dropped) + 2 tokens x 2 (none dropped)
    assert m["correction/signal_dropped_pos"] == pytest.approx(1.0 / 7.0)
    # negative rows: 4 x 0.5 (a vetoed row: all dropped) + 2 x 1.5 (one dropped)
    assert m["correction/signal_dropped_neg"] == pytest.approx((2.0 + 1.5) / 5.0)
    # keep outside the mask (padding) is ignored
    assert dropped_signal(adv, mask, keep + (mask == 0).float()) == m


def test_dropped_signal_edges_and_errors():
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert dropped_signal(torch.zeros(2), mask, torch.zeros(2, 3)) == {
        "correction/signal_dropped_pos": 0.0, "correction/signal_dropped_neg": 0.0}
    assert dropped_signal(torch.tensor([1.0, -1.0]), mask, mask) == {
        "correction/signal_dropped_pos": 0.0, "correction/signal_dropped_neg": 0.0}
    with pytest.raises(ValueError, match="advantages has shape"):
        dropped_signal(torch.zeros(3), mask, mask)
    with pytest.raises(ValueError, match="keep has shape"):
        dropped_signal(torch.zeros(2), mask, torch.ones(2, 4))
    with pytest.raises(ValueError, match="advantages has non-finite"):
        dropped_signal(torch.tensor([float("nan"), 1.0]), mask, mask)
