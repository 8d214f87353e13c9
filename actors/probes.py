"""Probes: the exact per-token agreement of sparse rollouts with the dense policy (issue 14).

A probe is a rollout sequence replayed teacher-forced (``NativeEngine.replay``) through the sparse
engine, with the dense policy's next-token distributions of the same tokens beside it (one dense
forward, ``DenseReference``); at every response token the two full distributions give the agreement
alpha_t = sum_v min(p_sparse(v), p_dense(v)) = 1 - TV (``correction.metrics.tv_agreement``).
Replaying at the schedule in use gives the sampled sequence's own alpha (the kept sets follow from
the row's own cache, so they are the generation's); replaying at candidate schedules gives the
re-planner its evidence (``schedule.plan``: per candidate schedule, or a table budget x position
bin -> alphas of one budget at every position). Only alphas leave the actor, never distributions.
"""
from __future__ import annotations

import math

import torch


def probe_rows(n: int, share: float) -> list[int]:
    """Which of ``n`` sequences of one rollout call are probes: ``ceil(share * n)`` of them, evenly
    spaced from the first (deterministic, so a resumed run probes the same samples)."""
    k = min(n, math.ceil(share * n - 1e-9)) if share > 0 else 0
    return sorted({(i * n) // k for i in range(k)}) if k else []


class DenseReference:
    """Dense teacher-forced next-token log-probs of (prompt, response) rows, produced step by step
    for ``NativeEngine.replay(..., against=)``: one whole-sequence forward keeps the last layer's
    hidden states (rows x length x hidden), and each step maps only its rows' position through the
    LM head, so no rows x length x vocabulary tensor exists (real vocabularies: 150k)."""

    def __init__(self, model, prompts: list[list[int]], responses: list[list[int]], params):
        from actors.native.model import Decoder

        dec = Decoder(model)
        dec.refresh()
        device = next(model.parameters()).device
        seqs = [p + r for p, r in zip(prompts, responses)]
        total = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), total, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
        valid = torch.arange(total)[None] < torch.tensor([len(s) for s in seqs])[:, None]
        mask = (torch.ones(total, total, dtype=torch.bool).tril()[None] & valid[:, None])
        mask = mask.to(device)[:, None, None]
        positions = torch.arange(total, device=device).expand(len(seqs), total)
        self.hidden = dec.forward_full(ids.to(device), positions, lambda i: mask, head=False)
        self.dec, self.params = dec, params
        self.plen = torch.tensor([len(p) for p in prompts])

    def at(self, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """[R, V] log-probs of response token ``steps[r]`` of prompt ``rows[r]`` (host tensors)."""
        from actors.native.sampling import processed_logprobs

        pos = (self.plen[rows] + steps - 1).to(self.hidden.device)
        x = self.hidden[rows.to(self.hidden.device), pos]
        p = self.params
        return processed_logprobs(self.dec.logits(x), p.temperature, p.top_k, p.top_p)


def agreement(engine, prompts: list[list[int]], responses: list[list[int]], params,
              micro_batch: int, schedules: list[list[int]] | None = None, reference=None):
    """alpha per response token for each (prompt, response), ``micro_batch`` rows per replay
    against the dense reference (``DenseReference`` of ``reference``, default the engine's own
    model; a DistillSparse sampler is measured against the dense base model). With ``schedules``
    (budgets per bin; ``[b]`` is the single budget b): one list of alphas per schedule, the engine
    at each in turn (one dense forward shared; the engine's own schedule is restored afterwards);
    without: the alphas at the engine's schedule."""
    saved = list(engine.budgets)
    runs = [list(s) for s in schedules] if schedules is not None else [None]
    out: list[list] = [[] for _ in runs]
    try:
        for i in range(0, len(prompts), micro_batch):
            p, r = prompts[i:i + micro_batch], responses[i:i + micro_batch]
            ref = DenseReference(engine.model if reference is None else reference, p, r, params)
            for j, sched in enumerate(runs):
                if sched is not None:
                    engine.set_budgets(sched)
                out[j] += [a.tolist() for a in engine.replay(p, r, params, against=ref)]
    finally:
        engine.set_budgets(saved)
    return out if schedules is not None else out[0]


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
