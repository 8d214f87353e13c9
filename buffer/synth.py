"""Synthetic rollout rows (the rollout actor's dict format) for tests and bench/buffer.py."""
from __future__ import annotations

import numpy as np


def synthetic_rows(n_groups: int, group_size: int, *, prompt_len=(8, 16), response_len=(4, 32),
                   version: int = 0, seed: int = 0, prefix: str = "g", first_group: int = 0,
                   vocab: int = 32000) -> list[dict]:
    """Rows as RolloutActor.rollout returns them: python lists, G rows per group.

    Lengths are uniform in the given inclusive ranges; rewards are 0/1; sample ids are
    f"{prefix}{group}-{i}" so tests can reason about them.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(first_group, first_group + n_groups):
        p = rng.integers(1, vocab, int(rng.integers(prompt_len[0], prompt_len[1] + 1)))
        for i in range(group_size):
            r_len = int(rng.integers(response_len[0], response_len[1] + 1))
            rows.append(dict(
                sample_id=f"{prefix}{g}-{i}", group_id=f"{prefix}{g}", prompt_idx=g,
                prompt_ids=p.tolist(), response_ids=rng.integers(1, vocab, r_len).tolist(),
                sampler_logprobs=(-rng.random(r_len, dtype=np.float32)).tolist(),
                reward=float(rng.integers(0, 2)), policy_version=version, kv_policy="streaming",
                kv_budget=64, kept_ratio=0.5, finish_reason="length", gen_time_s=0.01,
                logprob_mode="processed"))
    return rows


def dense_scores(batch, seed: int = 0) -> list[np.ndarray]:
    """Fake scorer output for a pending_scoring() batch: one float32 array per row."""
    rng = np.random.default_rng(seed)
    return [-rng.random(n, dtype=np.float32) for n in batch.column("response_len").to_pylist()]
