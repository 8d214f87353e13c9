"""Probes: the exact per-token agreement of sparse rollouts with the dense policy (issue 14).

A probe is a rollout sequence replayed teacher-forced (``NativeEngine.replay``) through the sparse
engine and through a dense-cache engine over the same weights; at every response token the two full
next-token distributions give the agreement alpha_t = sum_v min(p_sparse(v), p_dense(v)) = 1 - TV
(``correction.metrics.tv_agreement``). Replaying at the schedule in use gives the sampled sequence's
own alpha (the kept sets follow from the row's own cache, so they are the generation's); replaying
at each candidate budget (one budget at every position) gives the re-planner's table, budget x
position bin -> alphas (``schedule.plan``). Only alphas leave the actor, never distributions.
"""
from __future__ import annotations

import math

import torch

from correction.metrics import tv_agreement


def probe_rows(n: int, share: float) -> list[int]:
    """Which of ``n`` sequences of one rollout call are probes: ``ceil(share * n)`` of them, evenly
    spaced from the first (deterministic, so a resumed run probes the same samples)."""
    k = min(n, math.ceil(share * n - 1e-9)) if share > 0 else 0
    return sorted({(i * n) // k for i in range(k)}) if k else []


def agreement(engine, dense, prompts: list[list[int]], responses: list[list[int]], params,
              micro_batch: int) -> list[list[float]]:
    """alpha per response token for each (prompt, response), ``micro_batch`` rows per replay (the
    replays hold rows x length x vocabulary floats)."""
    out = []
    for i in range(0, len(prompts), micro_batch):
        p, r = prompts[i:i + micro_batch], responses[i:i + micro_batch]
        for s, d in zip(engine.replay(p, r, params), dense.replay(p, r, params)):
            out.append(tv_agreement(s, d).tolist())
    return out


def candidate_budgets(kv) -> list[int]:
    """The budgets probes are replayed at: ``rollout.kv.probe_budgets``, else eighths of the
    configured budget from a quarter to twice it (at least the policy's forced slots + 1)."""
    if kv.probe_budgets:
        return sorted({int(b) for b in kv.probe_budgets})
    floor = max(kv.obs_window, kv.sink_tokens) + 1
    base = max(kv.bin_budgets())
    return sorted({max(floor, round(base * k / 8)) for k in range(2, 17)})


def probe_table(engine, dense, prompts, responses, params, budgets: list[int],
                micro_batch: int) -> dict[int, list[list[float]]]:
    """{budget: alpha per token of every probe} with the engine at one budget everywhere; the
    engine's own schedule is restored afterwards."""
    saved = list(engine.budgets)
    try:
        table = {}
        for b in budgets:
            engine.set_budgets([b])
            table[b] = agreement(engine, dense, prompts, responses, params, micro_batch)
        return table
    finally:
        engine.set_budgets(saved)
