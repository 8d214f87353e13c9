"""Closed-form checks of correction.correct: every method, IS level and mode, rejection, veto,
normalisation, padding, gradients, NaN/inf."""
from __future__ import annotations

import math

import pytest
import torch

from correction import (CorrectionConfig, CorrectionMethod, ISConfig, ISLevel, ISMode,
                        NormalizeOver, RejectionConfig, correct)
from correction.config import IcePopConfig, SeqMaskTISConfig, TISConfig

torch.set_num_threads(1)

# rho per token; None = padding. Row 1 is shorter (two padded positions).
RHO = [[1.0, 2.0, 0.25, 1.2], [0.6, 1.6, None, None]]


def batch(rho=RHO, base: float = -1.0, pad_value: float = 0.0):
    """(sampler_logp, old_logp, mask) with old - sampler = log rho at valid positions."""
    s = torch.full((len(rho), len(rho[0])), base, dtype=torch.float64)
    o = s.clone()
    m = torch.zeros_like(s, dtype=torch.bool)
    for i, row in enumerate(rho):
        for t, r in enumerate(row):
            if r is None:
                s[i, t] = o[i, t] = pad_value
            else:
                o[i, t] = base + math.log(r)
                m[i, t] = True
    return s, o, m


def sparse(level=ISLevel.TOKEN, mode=ISMode.TRUNCATE, lower=0.0, upper=1.5, normalize=False,
           rejection=False) -> CorrectionConfig:
    return CorrectionConfig(is_=ISConfig(level=level, mode=mode, lower=lower, upper=upper,
                                         normalize=normalize),
                            rejection=RejectionConfig(enabled=rejection))


def expect(result, weights, loss_mask=None):
    w = torch.tensor(weights, dtype=torch.float64)
    assert torch.allclose(result.weights, w, atol=1e-6), result.weights
    if loss_mask is not None:
        assert torch.equal(result.loss_mask, torch.tensor(loss_mask, dtype=torch.float64))


M_ALL = [[1, 1, 1, 1], [1, 1, 0, 0]]


@pytest.mark.parametrize("mode,lower,upper,weights", [
    (ISMode.TRUNCATE, 0.0, 1.5, [[1.0, 1.5, 0.25, 1.2], [0.6, 1.5, 0, 0]]),
    (ISMode.CLIP, 0.5, 1.5, [[1.0, 1.5, 0.5, 1.2], [0.6, 1.5, 0, 0]]),
    (ISMode.MASK, 0.5, 1.5, [[1.0, 0.0, 0.0, 1.2], [0.6, 0.0, 0, 0]]),
])
def test_token_level_modes(mode, lower, upper, weights):
    """mask: out-of-band tokens leave the loss mask (and its denominator), as the reference's
    tis_mode=mask does."""
    r = correct(*batch(), sparse(ISLevel.TOKEN, mode, lower, upper))
    keep = [[1, 0, 0, 1], [1, 0, 0, 0]] if mode == ISMode.MASK else M_ALL
    expect(r, weights, keep)


@pytest.mark.parametrize("mode,lower,upper,w0,w1", [
    # products: row 0 = 1 * 2 * 0.25 * 1.2 = 0.6, row 1 = 0.6 * 1.6 = 0.96
    (ISMode.TRUNCATE, 0.0, 1.5, 0.6, 0.96),
    (ISMode.TRUNCATE, 0.0, 0.9, 0.6, 0.9),
    (ISMode.CLIP, 0.7, 1.5, 0.7, 0.96),
    (ISMode.MASK, 0.7, 1.5, 0.0, 0.96),
])
def test_sequence_level_modes(mode, lower, upper, w0, w1):
    r = correct(*batch(), sparse(ISLevel.SEQUENCE, mode, lower, upper))
    keep = [[0, 0, 0, 0], [1, 1, 0, 0]] if mode == ISMode.MASK else M_ALL   # row 0: 0.6 < 0.7
    expect(r, [[w0] * 4, [w1, w1, 0, 0]], keep)


@pytest.mark.parametrize("mode,lower,upper", [
    (ISMode.TRUNCATE, 0.0, 1.5), (ISMode.TRUNCATE, 0.0, 0.9), (ISMode.CLIP, 0.9, 1.5),
    (ISMode.MASK, 0.9, 1.5)])
def test_geometric_level_modes(mode, lower, upper):
    g0, g1 = 0.6 ** 0.25, 0.96 ** 0.5      # 0.8801, 0.9798
    def bound(g):
        if mode == ISMode.TRUNCATE:
            return min(g, upper)
        if mode == ISMode.CLIP:
            return min(max(g, lower), upper)
        return g if lower <= g <= upper else 0.0
    r = correct(*batch(), sparse(ISLevel.GEOMETRIC, mode, lower, upper))
    keep = [[0, 0, 0, 0], [1, 1, 0, 0]] if mode == ISMode.MASK else M_ALL   # row 0: 0.88 < 0.9
    expect(r, [[bound(g0)] * 4, [bound(g1), bound(g1), 0, 0]], keep)


def test_sparse_rl_default_recipe():
    """Token TIS at 1.5 + rejection outside [0.5, 1.5] + normalisation over kept tokens."""
    r = correct(*batch(), CorrectionConfig())
    # kept: row 0 tokens 0 (1.0) and 3 (1.2); row 1 token 0 (0.6) -> mean 2.8 / 3
    mean = 2.8 / 3
    expect(r, [[1.0 / mean, 0, 0, 1.2 / mean], [0.6 / mean, 0, 0, 0]],
           [[1, 0, 0, 1], [1, 0, 0, 0]])
    assert r.metrics["correction/frac_rejected"] == pytest.approx(3 / 6)
    assert r.metrics["correction/frac_kept"] == pytest.approx(3 / 6)
    assert r.metrics["correction/frac_vetoed"] == 0.0
    assert r.metrics["correction/weight_mean"] == pytest.approx(1.0)
    assert r.metrics["correction/norm_scale"] == pytest.approx(1 / mean)
    assert r.metrics["correction/frac_truncated"] == pytest.approx(2 / 6)   # rho 2.0 and 1.6


def test_normalize_over_valid_tokens_like_the_reference_code():
    cfg = CorrectionConfig()
    cfg.is_.normalize_over = NormalizeOver.VALID
    r = correct(*batch(), cfg)
    mean = (1.0 + 1.5 + 0.25 + 1.2 + 0.6 + 1.5) / 6      # truncated weights of all valid tokens
    expect(r, [[1.0 / mean, 0, 0, 1.2 / mean], [0.6 / mean, 0, 0, 0]],
           [[1, 0, 0, 1], [1, 0, 0, 0]])
    assert r.metrics["correction/norm_scale"] == pytest.approx(1 / mean)


def test_rejection_band_is_inclusive_and_explicit():
    cfg = sparse(rejection=True)
    r = correct(*batch([[0.49, 0.51, 1.49, 1.51]]), cfg)
    assert r.loss_mask.tolist() == [[0.0, 1.0, 1.0, 0.0]]


def test_a_lower_bound_of_zero_rejects_nothing_below():
    """lower = 0 passes validation, so it must run: no token (or sequence) is below it."""
    cfg = sparse(rejection=True)
    cfg.rejection.lower, cfg.rejection.upper = 0.0, 1e9
    r = correct(*batch([[1e-3, 0.2, 1.0, 30.0]]), cfg)
    assert r.loss_mask.tolist() == [[1.0, 1.0, 1.0, 1.0]]
    cfg = CorrectionConfig(method=CorrectionMethod.SEQ_MASK_TIS,
                           seq_mask_tis=SeqMaskTISConfig(lower=0.0, upper=1.25))
    r = correct(*batch([[1e-3, 1e-3, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]]), cfg)
    assert r.loss_mask.tolist() == [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]


def test_veto_removes_exactly_its_sequence():
    rho = [[1.0, 1.1, 1e-5, 1.0], [1.0, 0.9, 1.05, None], [1.2, 1.0, None, None]]
    r = correct(*batch(rho), CorrectionConfig())
    assert r.loss_mask.tolist() == [[0, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]]
    assert r.weights[0].abs().sum() == 0
    assert r.metrics["correction/frac_vetoed"] == pytest.approx(1 / 3)
    assert r.metrics["correction/frac_vetoed_tokens"] == pytest.approx(4 / 9)


def test_kept_share_floor_keeps_nothing_below_it_and_changes_nothing_above():
    """rejection.min_kept_share: with 1 of 3 sequences left after the veto (share 1/3) a floor
    above 1/3 keeps no token (weights 0, batch_floored 1); at or below 1/3 the result is the
    floor-less one; 0 (the default) is off."""
    rho = [[1.0, 1e-5, 1.0], [1.1, 1.0, 1e-6], [1.0, 1.2, None]]
    base = correct(*batch(rho), CorrectionConfig())
    assert base.loss_mask.tolist() == [[0, 0, 0], [0, 0, 0], [1, 1, 0]]
    assert base.metrics["correction/frac_seqs_kept"] == pytest.approx(1 / 3)
    assert base.metrics["correction/batch_floored"] == 0.0
    for floor in (0.2, 1 / 3):
        r = correct(*batch(rho), CorrectionConfig(rejection=RejectionConfig(min_kept_share=floor)))
        assert torch.equal(r.loss_mask, base.loss_mask) and torch.equal(r.weights, base.weights)
        assert r.metrics == base.metrics
    r = correct(*batch(rho), CorrectionConfig(rejection=RejectionConfig(min_kept_share=0.34)))
    assert r.loss_mask.sum() == 0 and r.weights.abs().sum() == 0
    assert r.metrics["correction/batch_floored"] == 1.0
    assert r.metrics["correction/frac_seqs_kept"] == pytest.approx(1 / 3)   # before the floor
    assert r.metrics["correction/frac_vetoed"] == pytest.approx(2 / 3)      # the veto's own
    assert r.metrics["correction/frac_kept"] == 0.0
    # the band counts too: a sequence whose every token is rejected keeps nothing
    rho = [[1.0, 1.0], [2.0, 0.4], [1.0, 1.0]]
    cfg = CorrectionConfig(rejection=RejectionConfig(min_kept_share=0.7))
    r = correct(*batch(rho), cfg)
    assert r.metrics["correction/frac_seqs_kept"] == pytest.approx(2 / 3)
    assert r.loss_mask.sum() == 0
    # a batch with no valid token is not "floored": there was nothing to keep
    empty = correct(*batch([[None, None]]), cfg)
    assert empty.metrics["correction/batch_floored"] == 0.0


def test_veto_threshold_and_disabled_rejection():
    rho = [[1.0, 2e-4], [1.0, 1.0]]
    cfg = CorrectionConfig(rejection=RejectionConfig(lower=1e-6, upper=10.0, veto_threshold=1e-4))
    assert correct(*batch(rho), cfg).loss_mask.tolist() == [[1, 1], [1, 1]]
    cfg.rejection.veto_threshold = 3e-4
    assert correct(*batch(rho), cfg).loss_mask.tolist() == [[0, 0], [1, 1]]
    cfg.rejection.enabled = False
    assert correct(*batch(rho), cfg).loss_mask.tolist() == [[1, 1], [1, 1]]


def test_comparators_closed_form():
    b = batch()
    expect(correct(*b, CorrectionConfig(method=CorrectionMethod.NONE)),
           [[1, 1, 1, 1], [1, 1, 0, 0]], M_ALL)
    expect(correct(*b, CorrectionConfig(method="tis")),
           [[1.0, 2.0, 0.25, 1.2], [0.6, 1.6, 0, 0]], M_ALL)
    expect(correct(*b, CorrectionConfig(method="tis", tis=TISConfig(cap=1.5))),
           [[1.0, 1.5, 0.25, 1.2], [0.6, 1.5, 0, 0]], M_ALL)
    r = correct(*b, CorrectionConfig(method="icepop", icepop=IcePopConfig(lower=0.5, upper=1.5)))
    expect(r, [[1.0, 0, 0, 1.2], [0.6, 0, 0, 0]], M_ALL)      # masked tokens stay in the mask
    assert r.metrics["correction/frac_masked"] == pytest.approx(3 / 6)
    # geometric means: row 0 0.880, row 1 0.980 -> band [0.9, 1.1] drops row 0
    cfg = CorrectionConfig(method="seq_mask_tis",
                           seq_mask_tis=SeqMaskTISConfig(cap=1.5, lower=0.9, upper=1.1))
    r = correct(*b, cfg)
    expect(r, [[0, 0, 0, 0], [0.6, 1.5, 0, 0]], [[0, 0, 0, 0], [1, 1, 0, 0]])
    assert r.metrics["correction/frac_vetoed"] == pytest.approx(1 / 2)


@pytest.mark.parametrize("method", list(CorrectionMethod))
@pytest.mark.parametrize("level", list(ISLevel))
def test_rho_one_gives_unit_weights_nothing_rejected(method, level):
    s, o, m = batch([[1.0, 1.0, 1.0], [1.0, None, None]])
    cfg = CorrectionConfig(method=method)
    cfg.is_.level = level
    r = correct(s, o, m, cfg)
    assert torch.equal(r.weights, m.double())
    assert torch.equal(r.loss_mask, m.double())
    assert r.metrics["mismatch/k1"] == 0.0 and r.metrics["mismatch/k3"] == 0.0
    assert r.metrics["correction/frac_kept"] == 1.0


def test_padding_never_counts():
    clean = correct(*batch(), CorrectionConfig())
    for pad in (float("nan"), float("inf"), -float("inf"), 123.0):
        dirty = correct(*batch(pad_value=pad), CorrectionConfig())
        assert torch.equal(dirty.weights, clean.weights)
        assert torch.equal(dirty.loss_mask, clean.loss_mask)
        assert dirty.metrics == clean.metrics


def test_float_mask_accepted():
    s, o, m = batch()
    a = correct(s, o, m, CorrectionConfig())
    b = correct(s, o, m.float(), CorrectionConfig())
    assert torch.equal(a.weights, b.weights) and torch.equal(a.loss_mask, b.loss_mask)


def test_weights_carry_no_gradient():
    s, o, m = batch()
    s = s.clone().requires_grad_(True)
    o = o.clone().requires_grad_(True)
    r = correct(s, o, m, CorrectionConfig())
    assert not r.weights.requires_grad and r.weights.grad_fn is None
    assert not r.loss_mask.requires_grad


@pytest.mark.parametrize("name,index,value", [
    ("sampler_logp", 0, float("nan")), ("old_logp", 1, float("nan")),
    ("sampler_logp", 0, -float("inf")), ("old_logp", 1, float("inf"))])
def test_non_finite_at_valid_position_raises(name, index, value):
    b = list(batch())
    b[index][0, 1] = value
    with pytest.raises(ValueError, match=name):
        correct(*b, CorrectionConfig())


def test_shape_mismatch_raises():
    s, o, m = batch()
    with pytest.raises(ValueError, match="old_logp"):
        correct(s, o[:, :2], m, CorrectionConfig())
    with pytest.raises(ValueError, match="mask"):
        correct(s, o, m[:1], CorrectionConfig())


def test_log_ratio_clamped_before_exp():
    s = torch.tensor([[-60.0, -1.0]])
    o = torch.tensor([[-1.0, -60.0]])
    m = torch.ones_like(s, dtype=torch.bool)
    cfg = sparse(ISLevel.TOKEN, ISMode.CLIP, 0.0, 1e12)
    r = correct(s, o, m, cfg)
    assert torch.allclose(r.weights, torch.tensor([[math.exp(20), math.exp(-20)]]), rtol=1e-5)
    assert r.metrics["mismatch/frac_clamped"] == 1.0
    assert all(math.isfinite(v) for v in r.metrics.values())


@pytest.mark.parametrize("method", list(CorrectionMethod))
def test_empty_inputs(method):
    for shape in ((2, 0), (0, 3), (0, 0)):
        z = torch.zeros(shape)
        r = correct(z, z, z.bool(), CorrectionConfig(method=method))
        assert r.weights.shape == shape and r.loss_mask.shape == shape
        assert all(math.isfinite(v) for v in r.metrics.values())
    z = torch.zeros(2, 3)
    r = correct(z, z, z.bool(), CorrectionConfig())
    assert r.weights.sum() == 0 and r.metrics["correction/num_valid_tokens"] == 0


def test_bfloat16_inputs_promote_to_float32():
    s, o, m = batch()
    r = correct(s.bfloat16(), o.bfloat16(), m, CorrectionConfig())
    assert r.weights.dtype == torch.float32 and r.loss_mask.dtype == torch.float32


# ---- the reference's options (slime's compute_mis_weights) ----------------------------------------

def test_sequence_level_weights_are_normalised_per_sequence():
    """tis_level=sequence + tis_batch_normalize: the mean over sequences of each sequence's weight
    (0.6 and 0.96 -> 0.78), not the token-weighted mean (0.72)."""
    cfg = sparse(ISLevel.SEQUENCE, ISMode.TRUNCATE, 0.0, 1.5, normalize=True)
    for over in (NormalizeOver.KEPT, NormalizeOver.VALID):   # nothing rejected: the same
        cfg.is_.normalize_over = over
        r = correct(*batch(), cfg)
        expect(r, [[0.6 / 0.78] * 4, [0.96 / 0.78] * 2 + [0, 0]], M_ALL)
        assert r.metrics["correction/norm_scale"] == pytest.approx(1 / 0.78)


def test_geometric_rejection_band_with_the_token_veto():
    """rs_level=geometric: a sequence whose geometric-mean ratio is outside the band leaves whole;
    single tokens outside [lower, upper] no longer matter; the veto still reads raw token ratios."""
    rho = [[1.0, 2.0, 0.25, 1.2],    # geometric mean 0.88: outside [0.9, 1.1] -> rejected
           [0.6, 1.6, None, None],   # 0.98: kept, although 0.6 and 1.6 are outside [0.9, 1.1]
           [1e-5, 1e5, 1.0, 1.0]]    # 1.0: inside the band, but 1e-5 < veto 1e-4 -> vetoed
    cfg = sparse(ISLevel.TOKEN, ISMode.TRUNCATE, 0.0, 1.5)
    cfg.rejection = RejectionConfig(level=ISLevel.GEOMETRIC, lower=0.9, upper=1.1,
                                    veto_threshold=1e-4)
    r = correct(*batch(rho), cfg)
    expect(r, [[0] * 4, [0.6, 1.5, 0, 0], [0] * 4], [[0] * 4, [1, 1, 0, 0], [0] * 4])
    assert r.metrics["correction/frac_vetoed"] == pytest.approx(1 / 3)
    assert r.metrics["correction/frac_rejected"] == pytest.approx(4 / 10)
    cfg.rejection.lower = 0.97                    # row 1: geometric 0.98 in, product 0.96 out
    assert correct(*batch(rho), cfg).loss_mask[1].sum() == 2
    cfg.rejection.level = ISLevel.SEQUENCE
    assert correct(*batch(rho), cfg).loss_mask.sum() == 0


def test_mask_mode_normalised_over_valid_counts_out_of_band_weights():
    """tis_mode=mask + normalisation over valid tokens: out-of-band tokens (2.0, 0.25, 1.6) leave
    the loss mask but their weights stay in the batch mean, as in the reference:
    mean = (1 + 2 + 0.25 + 1.2 + 0.6 + 1.6) / 6."""
    cfg = sparse(ISLevel.TOKEN, ISMode.MASK, 0.5, 1.5, normalize=True)
    cfg.is_.normalize_over = NormalizeOver.VALID
    r = correct(*batch(), cfg)
    m = 6.65 / 6
    expect(r, [[1 / m, 0, 0, 1.2 / m], [0.6 / m, 0, 0, 0]], [[1, 0, 0, 1], [1, 0, 0, 0]])
    assert r.metrics["correction/frac_masked"] == pytest.approx(3 / 6)


def test_rejection_alone_with_unit_weights():
    """is_.enabled=false (verl's rollout_is: null + rollout_rs): weights 1, the band still rejects."""
    cfg = CorrectionConfig()
    cfg.is_.enabled = False
    r = correct(*batch(), cfg)
    expect(r, [[1, 0, 0, 1], [1, 0, 0, 0]], [[1, 0, 0, 1], [1, 0, 0, 0]])
