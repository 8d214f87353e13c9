"""The rollout batch before it is split over data-parallel learners, and their metrics after.

``prepare_batch`` runs once per rollout batch on the *whole* batch (the driver calls it on the
``buffer.tensors.to_tensors`` output): GRPO advantages and the mismatch correction both normalise
over the batch (IS weights to mean 1 over the kept tokens; advantages within a group), so computing
them before the split makes the update independent of how rows are shared among learners (the
global sums and counts an all-reduce would produce, without one). ``shard_batch`` then gives each
learner whole groups; ``reduce_metrics`` folds the learners' own metrics back into one record.
Imports torch and ``correction`` only (no Ray, no DeepSpeed).
"""
from __future__ import annotations

import torch

# Keys ``prepare_batch`` adds and ``Learner.train_step`` requires.
PREPARED = ("advantages", "is_weights", "loss_mask", "mini_batch")


def prepare_batch(tensors: dict, cfg, learner_version: int,
                  mini_batches: int = 1) -> tuple[dict, dict[str, float]]:
    """Advantages, IS weights and loss mask for the whole batch, and each row's mini-batch (the
    groups, in order, cut into ``mini_batches`` nearly equal runs: one optimiser step each, the
    same whatever the number of learners); returns (tensors + PREPARED keys, adv/*,
    correction/*, mismatch/* metrics).

    ``cfg`` is the ``CorrectionConfig``. With ``cfg.staleness.enabled`` and pi_dense at the
    sampler's version in the batch (``dense_sampler_logprobs``): the sparsity/staleness split
    ``staleness_correct(sampler, dense_sampler, old, ...)`` with lag n - v, v =
    ``policy_version``, n = ``scorer_version`` (the version ``old_logprobs`` were scored at;
    ``learner_version`` where a row has none). ``old_logprobs`` (pi_dense^n) stays the PPO anchor.
    Otherwise ``correct(sampler, old)``. ``correction/staleness_split`` says which (1 / 0).
    """
    from correction import correct, dropped_signal, grpo_advantages, staleness_correct

    resp = tensors["response_mask"].bool()
    adv, metrics = grpo_advantages(tensors["rewards"].float(), tensors["group_index"], cfg)
    sampler, old = tensors["sampler_logprobs"].float(), tensors["old_logprobs"].float()
    dense_v = tensors.get("dense_sampler_logprobs")
    if cfg.staleness.enabled and dense_v is not None:
        v = tensors["policy_version"].long()
        n = tensors.get("scorer_version")
        now = torch.full_like(v, int(learner_version))
        n = now if n is None else torch.where(n.long() >= 0, n.long(), now)
        corr = staleness_correct(sampler, dense_v.float(), old, resp, v, n, cfg)
        corr.metrics["correction/staleness_split"] = 1.0
    else:
        corr = correct(sampler, old, resp, cfg)
        corr.metrics["correction/staleness_split"] = 0.0
    metrics.update(corr.metrics)
    metrics.update(dropped_signal(adv, resp, corr.loss_mask > 0))
    out = dict(tensors)
    groups, inv = torch.unique(tensors["group_index"], sorted=True, return_inverse=True)
    if groups.numel() < mini_batches:
        raise ValueError(f"{groups.numel()} groups cannot make {mini_batches} mini-batches: "
                         "learner.mini_batches must be at most run.prompts_per_step")
    mini = torch.cat([torch.full((len(p),), i) for i, p in
                      enumerate(torch.tensor_split(torch.arange(groups.numel()), mini_batches))])
    out.update(advantages=adv, is_weights=corr.weights, loss_mask=corr.loss_mask,
               mini_batch=mini[inv])
    return out, metrics


def shard_batch(tensors: dict, n: int) -> list[dict]:
    """One shard per data-parallel learner: each mini-batch's groups split in ``n`` nearly equal
    runs, rank r taking the r-th run of every mini-batch, rows ordered by mini-batch (every
    [B, ...] tensor is indexed the same way). A mini-batch with fewer groups than learners leaves
    some without rows in it (they run padding micro-batches); a learner with no row at all is an
    error."""
    g, mini = tensors["group_index"], tensors["mini_batch"]
    rows = g.shape[0]
    picks: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for m in torch.unique(mini, sorted=True).tolist():
        groups = torch.unique(g[mini == m], sorted=True)
        for r, part in enumerate(torch.tensor_split(groups, n)):
            picks[r].append(torch.isin(g, part).nonzero().squeeze(1))
    out = []
    for r, idx in enumerate(torch.cat(p) for p in picks):
        if not idx.numel():
            raise ValueError(f"learner {r} of {n} gets no group: run.prompts_per_step must be at "
                             "least learner.num_learners")
        out.append({k: v[idx] if torch.is_tensor(v) and v.dim() and v.shape[0] == rows else v
                    for k, v in tensors.items()})
    return out


def combine_weighted(parts: list[tuple[float, dict]]) -> dict[str, float]:
    """Fold metric dicts, each with a weight (its loss units: kept tokens or sequences): counts
    (``num_``) summed, ``*_max`` maxed, the rest averaged by weight over the dicts holding the key
    (the first one's value where those weigh nothing). Micro-batches into a rank's metrics,
    ranks into a step's."""
    out: dict[str, float] = {}
    for k in dict.fromkeys(k for _, m in parts for k in m):
        have = [(w, float(m[k])) for w, m in parts if k in m]
        vals = [v for _, v in have]
        total = sum(w for w, _ in have)
        if "num_" in k:
            out[k] = sum(vals)
        elif k.endswith("_max"):
            out[k] = max(vals)
        else:
            out[k] = sum(w * v for w, v in have) / total if total > 0 else vals[0]
    return out


def reduce_metrics(per_rank: list[dict]) -> dict[str, float]:
    """One record from every learner rank's ``train_step`` metrics.

    ``loss*`` by ``combine_weighted`` with each rank's loss units (``learner/loss_units``);
    learner counts (``learner/rows``, ``learner/*_tokens``, the units) summed, ``time/*`` maxed
    (the step waits for the slowest rank); the rest (grad norm, lr, version, optimiser steps:
    equal on every rank after DeepSpeed's all-reduce) is rank 0's.
    """
    units = [float(m.get("learner/loss_units", 0.0)) for m in per_rank]
    loss = combine_weighted([(u, {k: v for k, v in m.items() if k.startswith("loss")})
                             for u, m in zip(units, per_rank)])
    out: dict[str, float] = {}
    for k, v in per_rank[0].items():
        vals = [float(m[k]) for m in per_rank if k in m]
        if k.startswith("loss"):
            out[k] = loss[k]
        elif k in ("learner/rows", "learner/loss_units") or \
                (k.startswith("learner/") and k.endswith("_tokens")):
            out[k] = sum(vals)
        elif k.startswith("time/"):
            out[k] = max(vals)
        else:
            out[k] = float(v)
    return out
