"""Hand-built attention patterns: each policy keeps what its definition says."""
from __future__ import annotations

import math

import pytest
import torch

from actors.config import KVConfig
from actors.native.policies import LayerView, redundancy, select, window_logits

torch.set_num_threads(1)
NEG = float("-inf")


def view(s=20, n=None, hkv=2, d=8, **kw):
    n = torch.tensor([s] if n is None else n)
    r = n.shape[0]
    keys = kw.pop("keys", torch.randn(r, hkv, s, d))
    pos = torch.arange(s).expand(r, hkv, s).clone()
    return LayerView(keys=keys, pos=pos, n=n, **kw)


def kept(idx, row=0, head=0):
    return idx[row, head].tolist()


def test_streaming_keeps_sinks_and_recent_window():
    idx = select("streaming", KVConfig(policy="streaming", sink_tokens=2), 8, view(20, n=[20, 15]))
    assert kept(idx) == [0, 1, 14, 15, 16, 17, 18, 19] == kept(idx, head=1)
    assert kept(idx, row=1) == [0, 1, 9, 10, 11, 12, 13, 14]      # only 15 valid slots


def test_h2o_keeps_recent_half_and_heavy_hitters_per_head():
    acc = torch.rand(1, 2, 20) * 0.1
    acc[0, 0, [3, 7, 11, 2]] = torch.tensor([5.0, 4.0, 3.0, 2.0])
    acc[0, 1, [0, 9, 4, 5]] = torch.tensor([5.0, 4.0, 3.0, 2.0])
    acc[0, :, 16:] = 0.0                      # recent tokens are kept whatever their score
    idx = select("h2o", KVConfig(policy="h2o", recent_ratio=0.5), 8, view(20, acc=acc))
    assert kept(idx, head=0) == [2, 3, 7, 11, 16, 17, 18, 19]
    assert kept(idx, head=1) == [0, 4, 5, 9, 16, 17, 18, 19]


def window(s, w, hot, hkv=2, g=2):
    """Window logits [1,Hkv,g,w,S]: every window query prefers the keys in hot[h]."""
    logits = torch.zeros(1, hkv, g, w, s)
    for h, keys in enumerate(hot):
        logits[0, h, :, :, keys] = 6.0
    return logits


def test_snapkv_keeps_window_and_most_attended_keys():
    cfg = KVConfig(policy="snapkv", obs_window=4, pool_kernel=1)
    win = window(20, 4, [[1, 5, 9, 12], [0, 2, 4, 6]])
    idx = select("snapkv", cfg, 8, view(20, win=win))
    assert kept(idx, head=0) == [1, 5, 9, 12, 16, 17, 18, 19]
    assert kept(idx, head=1) == [0, 2, 4, 6, 16, 17, 18, 19]


def test_snapkv_pooling_keeps_the_neighbourhood_of_a_spike():
    cfg = KVConfig(policy="snapkv", obs_window=4, pool_kernel=3)
    win = torch.zeros(1, 1, 1, 4, 20)
    win[..., 8] = 9.0                      # one key gets nearly all attention
    win[..., 2] = 2.0                      # a weaker isolated one
    idx = select("snapkv", cfg, 7, view(20, hkv=1, win=win))
    assert kept(idx) == [7, 8, 9, 16, 17, 18, 19]   # the spike's neighbours beat key 2


def test_snapkv_group_heads_are_averaged():
    cfg = KVConfig(policy="snapkv", obs_window=2, pool_kernel=1)
    win = torch.zeros(1, 1, 2, 2, 10)
    win[0, 0, 0, :, 3] = 8.0               # query head 0 of the group likes key 3
    win[0, 0, 1, :, 5] = 8.0               # query head 1 likes key 5
    idx = select("snapkv", cfg, 4, view(10, hkv=1, win=win))
    assert kept(idx) == [3, 5, 8, 9]


def test_window_logits_are_causal_by_absolute_position():
    q = torch.randn(1, 2, 4, 8)
    keys = torch.randn(1, 1, 6, 8)
    pos = torch.tensor([[[0, 1, 5, 7, 8, 9]]])         # slots after evictions
    logits = window_logits(q, torch.tensor([10]), keys, pos, torch.tensor([6]), 1.0)
    # ring slot j holds position p with p % 4 == j among positions 6..9
    qpos = {0: 8, 1: 9, 2: 6, 3: 7}
    for j, p in qpos.items():
        visible = torch.isfinite(logits[0, 0, :, j]).all(dim=0)
        assert visible.tolist() == [kp <= p for kp in pos[0, 0].tolist()]


def test_rkv_redundancy_keeps_the_latest_copy_of_a_repeated_key():
    s, d = 12, 16
    keys = torch.eye(d)[:s].clone()[None, None]         # orthogonal: no redundancy
    dup = torch.eye(d)[15]
    for slot in (2, 5, 7):
        keys[0, 0, slot] = dup                          # three copies of one key
    red = redundancy(keys, torch.tensor([s]))[0, 0]
    assert red[2] > red[5] > red[7] and torch.isclose(red[7], red[0])
    cfg = KVConfig(policy="rkv", obs_window=2, pool_kernel=1, rkv_lambda=0.1)
    win = torch.zeros(1, 1, 1, 2, s)                    # uniform importance
    idx = select("rkv", cfg, s - 2, view(s, hkv=1, d=d, keys=keys, win=win))
    assert kept(idx) == [i for i in range(s) if i not in (2, 5)]


def test_rkv_importance_dominates_with_lambda_one():
    cfg = KVConfig(policy="rkv", obs_window=2, pool_kernel=1, rkv_lambda=1.0)
    win = torch.zeros(1, 1, 2, 2, 10)
    win[0, 0, 0, :, 1] = 8.0
    win[0, 0, 1, :, 6] = 7.0                           # max over the group's query heads
    idx = select("rkv", cfg, 4, view(10, hkv=1, win=win))
    assert kept(idx) == [1, 6, 8, 9]


def test_invalid_slots_are_never_kept():
    cfg = KVConfig(policy="h2o", recent_ratio=0.25)
    acc = torch.zeros(2, 1, 16)
    acc[:, :, 12:] = 100.0                             # garbage beyond row 1's valid slots
    idx = select("h2o", cfg, 8, view(16, n=[16, 10], hkv=1, acc=acc))
    assert max(kept(idx, row=1)) < 10 and kept(idx, row=1)[-2:] == [8, 9]


# ---- as the reference code computes them (SnapKV; R-KV as deployed in Sparse-RL's SGLang) --------

def test_snapkv_softmax_is_over_the_prefix_keys_only():
    """Query 0 looks almost only at a window key (logit 20) and, among the prefix, at key 3;
    query 1 mildly prefers prefix key 5. Over all keys (the old rule) query 0's prefix mass is
    ~e^-18 and key 5 wins; over the prefix only (the reference) key 3 gets 0.51 of query 0's
    attention against key 5's 0.28 of query 1's, and wins."""
    win = torch.zeros(1, 1, 1, 2, 10)
    win[0, 0, 0, 0, 9], win[0, 0, 0, 0, 3] = 20.0, 2.0
    win[0, 0, 0, 1, 5] = 1.0
    cfg = KVConfig(policy="snapkv", obs_window=2, pool_kernel=1)
    assert kept(select("snapkv", cfg, 3, view(10, hkv=1, win=win))) == [3, 8, 9]


def test_snapkv_pools_prefix_scores_with_zero_padding_not_the_window():
    """The window's own keys draw most attention; the prefix key next to the window must not
    inherit it through the pool (kernel 3). Prefix scores (softmax over slots 0..7 of logits 0
    except slot 1 at 2.0): p1 = e^2 / (e^2 + 7); pooled slot k = (p_{k-1} + p_k + p_{k+1}) / 3
    with zeros beyond the prefix, so slots 0..2 (which see p1) beat slot 7."""
    win = torch.zeros(1, 1, 1, 4, 12)
    win[..., 8:] = 9.0
    win[..., 1] = 2.0
    cfg = KVConfig(policy="snapkv", obs_window=4, pool_kernel=3)
    assert kept(select("snapkv", cfg, 7, view(12, hkv=1, win=win))) == [0, 1, 2, 8, 9, 10, 11]


def _redundancy_by_hand(keys: torch.Tensor) -> torch.Tensor:
    """The deployed cal_similarity, one key row at a time (S x S loops): cosine similarity,
    diagonal 0; in row i zero the last j with sim > 0.5, or j = 0 when there is none; mean of
    each column over the S rows; softmax."""
    k = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
    s = k.shape[0]
    sim = [[0.0 if i == j else float(k[i] @ k[j]) for j in range(s)] for i in range(s)]
    for i in range(s):
        hits = [j for j in range(s) if sim[i][j] > 0.5]
        sim[i][hits[-1] if hits else 0] = 0.0
    col = torch.tensor([sum(sim[i][j] for i in range(s)) / s for j in range(s)])
    return torch.softmax(col, dim=0)


def test_rkv_redundancy_is_the_deployed_rule():
    # k3 has no similar key: its similarity to slot 0 (0.3) is dropped, as the deployed code does
    keys = torch.tensor([[1.0, 0, 0], [0.8, 0.6, 0], [0.4, 0.9165, 0], [0.3, 0, 0.9539]])
    got = redundancy(keys[None, None], torch.tensor([4]))[0, 0]
    torch.testing.assert_close(got, _redundancy_by_hand(keys), rtol=0, atol=1e-6)
    # column 0: rows 1 and 2 (row 0 is the diagonal, row 3's 0.3 dropped); column 1: only row
    # 3's 0.24 (rows 0 and 2 drop theirs, their latest similar key)
    col0, col1 = (0.8 + 0.4) / 4, 0.24 / 4
    assert float(got[0] / got[1]) == pytest.approx(math.exp(col0 - col1), rel=1e-4)
    g = torch.Generator().manual_seed(0)
    for s in (5, 9, 17):
        keys = torch.randn(s, 4, generator=g)
        got = redundancy(keys[None, None], torch.tensor([s]))[0, 0]
        torch.testing.assert_close(got, _redundancy_by_hand(keys), rtol=0, atol=1e-6)
