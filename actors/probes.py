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
              micro_batch: int, budgets: list[int] | None = None):
    """alpha per response token for each (prompt, response), ``micro_batch`` rows per replay (a
    replay holds rows x length x vocabulary floats). With ``budgets``: {budget: alphas} with the
    engine at each single budget in turn (the dense replay is shared; the engine's own schedule is
    restored afterwards); without: the alphas at the engine's schedule."""
    saved = list(engine.budgets)
    out: dict = {b: [] for b in (budgets or [None])}
    try:
        for i in range(0, len(prompts), micro_batch):
            p, r = prompts[i:i + micro_batch], responses[i:i + micro_batch]
            ref = dense.replay(p, r, params)
            for b in out:
                if b is not None:
                    engine.set_budgets([b])
                out[b] += [tv_agreement(s, d).tolist()
                           for s, d in zip(engine.replay(p, r, params), ref)]
    finally:
        engine.set_budgets(saved)
    return out if budgets else out[None]


def candidate_budgets(kv, longest: int) -> list[int]:
    """The budgets probes are replayed at: ``rollout.kv.probe_budgets``, else every half bin from
    the smallest the policy allows up to ``longest`` (a sequence's most tokens: the budget that
    never compresses, whose agreement is exactly 1, so the planner can always fall back to it)."""
    if kv.probe_budgets:
        return sorted({int(b) for b in kv.probe_budgets})
    floor = max(kv.obs_window, kv.sink_tokens) + 1
    step = max(1, kv.bin_tokens // 2)
    top = -(-longest // step) * step
    return [b for b in range(step, top + 1, step) if b >= floor] or [max(floor, top)]
