import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from buffer.pods import max_variance_subset, subset_variance


def brute_force(r, m):
    return max(np.var(np.asarray(r, dtype=np.float64)[list(c)])
               for c in itertools.combinations(range(len(r)), m))


def check(r, m, rel=0.0):
    idx = max_variance_subset(r, m)
    assert len(idx) == min(m, len(r)) and len(set(idx.tolist())) == len(idx)
    assert np.all(np.diff(idx) > 0)
    if m < len(r):
        assert subset_variance(r, idx) == pytest.approx(brute_force(r, m), abs=1e-9, rel=rel)


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_random(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 11))
    m = int(rng.integers(1, n + 1))
    kind = seed % 3
    if kind == 0:
        r = rng.normal(size=n)
    elif kind == 1:
        r = rng.integers(0, 2, n).astype(float)                # binary rewards
    else:
        r = rng.integers(0, 3, n).astype(float) / 2            # many ties
    check(r, m)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.5]), min_size=1, max_size=9),
       st.integers(1, 9))
def test_matches_brute_force_ties(r, m):
    check(r, m)


def test_binary_rewards_balance_classes():
    r = [1, 1, 1, 1, 1, 1, 0, 0]
    idx = max_variance_subset(r, 4)
    assert sorted(np.asarray(r)[idx].tolist()) == [0, 0, 1, 1]


def test_edges():
    assert max_variance_subset([3.0, 1.0], 5).tolist() == [0, 1]
    assert max_variance_subset([], 2).tolist() == []
    assert max_variance_subset([1.0, 2.0], 0).tolist() == []
    assert max_variance_subset([2.0, 2.0, 2.0], 2).size == 2       # all tied: any pair


def test_large_input_fast():
    r = np.random.default_rng(0).normal(size=200_000)
    idx = max_variance_subset(r, 1000)
    assert idx.size == 1000


@pytest.mark.parametrize("scale,offset", [(1e-6, 0.0), (1e-6, 1.0), (1.0, 1e6), (1e-3, 1e6),
                                          (1e6, 0.0)])
@pytest.mark.parametrize("seed", range(12))
def test_max_variance_at_any_reward_scale_and_offset(scale, offset, seed):
    """Rewards of scale 1e-6 (variances ~1e-12, below any absolute tolerance) and offsets of 1e6
    (where uncentred sums of squares cancel) still give the brute-force maximum, and the same
    subset (up to ties) as the same rewards at scale 1 / offset 0."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 10))
    m = int(rng.integers(1, n))
    base = rng.normal(size=n) if seed % 2 else rng.integers(0, 3, n).astype(float)
    r = offset + scale * base
    check(r, m, rel=1e-6)
    picked = max_variance_subset(r, m)
    assert subset_variance(base, picked) == pytest.approx(brute_force(base, m), rel=1e-6, abs=1e-12)
