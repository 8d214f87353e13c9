"""PODS max-variance down-sampling.

Xu et al., "Not All Rollouts are Useful: Down-Sampling Rollouts in LLM Reinforcement Learning"
(2025): generate n rollouts per prompt, train on the m whose rewards have maximal variance.

For a multiset r of n rewards, the size-m subset S maximising
    Var(S) = (1/m) * sum_{i in S} r_i^2 - ((1/m) * sum_{i in S} r_i)^2
consists of the k largest and the m-k smallest values for some k in [0, m]: swapping an
element strictly inside the range of S for one outside it never lowers the spread. With r
sorted ascending and prefix sums P1 (of r) and P2 (of r^2), the candidate for k has
    s1(k) = P1[m-k] + P1[n] - P1[n-k],   s2(k) = P2[m-k] + P2[n] - P2[n-k],
    Var(k) = s2(k)/m - (s1(k)/m)^2,
so one sort plus an O(m) scan gives the optimum: O(n log n) in total.

Numerics: the rewards are centred on their mean first (the variance does not change), so the
prefix sums do not cancel catastrophically when rewards sit far from 0 (an offset of 1e6 makes
r^2 ~ 1e12, where float64 resolves only ~1e-4), and candidates within a tolerance *relative to the
largest variance* count as tied, so rewards of scale 1e-6 (variances ~1e-12) are compared as
finely as rewards of scale 1.
"""
from __future__ import annotations

import numpy as np

RTOL = 1e-9   # variances this close (relative to the largest) are ties


def max_variance_subset(rewards, m: int) -> np.ndarray:
    """Indices (into `rewards`, ascending) of the m rewards with maximal population variance.

    Ties between equally good k are broken towards the smallest k (fewest top rewards), so
    the answer is deterministic. m >= n returns all indices.
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    n = r.size
    if m <= 0:
        return np.zeros(0, dtype=np.int64)
    if m >= n:
        return np.arange(n, dtype=np.int64)
    order = np.argsort(r, kind="stable")
    rs = r[order] - r.mean()             # centred: the same variances, no cancellation
    p1 = np.concatenate(([0.0], np.cumsum(rs)))
    p2 = np.concatenate(([0.0], np.cumsum(rs * rs)))
    k = np.arange(m + 1)
    s1 = p1[m - k] + p1[n] - p1[n - k]
    s2 = p2[m - k] + p2[n] - p2[n - k]
    var = s2 / m - (s1 / m) ** 2
    # Floating noise between equal-variance choices must not flip the pick: the first k within a
    # tolerance relative to the best variance (scale-free) wins.
    top = var.max()
    best = int(np.flatnonzero(var >= top - RTOL * abs(top))[0])
    chosen = np.concatenate((order[: m - best], order[n - best:]))
    return np.sort(chosen)


def subset_variance(rewards, idx) -> float:
    """Population variance of rewards[idx] (for metrics and tests)."""
    r = np.asarray(rewards, dtype=np.float64)[np.asarray(idx, dtype=np.int64)]
    return float(r.var()) if r.size else 0.0
