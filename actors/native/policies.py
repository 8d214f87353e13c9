"""Which KV slots each policy keeps when a row's cache is cut to ``budget`` tokens.

Every policy scores the valid slots of one layer, per KV head, forces some slots to stay and keeps the
``budget`` best (``_keep``); slots stay sorted by absolute position. Granularity: selection is per
layer and per KV head (heads keep different tokens; every head keeps exactly ``budget``). With grouped
query attention the query heads of a group are combined as noted per policy.

- StreamingLLM (Xiao et al., ICLR 2024, "Efficient Streaming Language Models with Attention Sinks"):
  keep the first ``sink_tokens`` tokens of the sequence (attention sinks) and the most recent
  ``budget - sink_tokens``. Same tokens in every head and layer. Positions are not re-numbered (see
  ``model.py``): we keep absolute RoPE positions.
- H2O (Zhang et al., NeurIPS 2023, "Heavy-Hitter Oracle"): every token accumulates the attention it
  receives from all later queries (summed over the query heads of its KV group); keep the most recent
  ``round(budget * recent_ratio)`` tokens plus the heavy hitters with the largest accumulated score.
  The paper evicts one token per step; we evict in bulk every ``compress_every`` steps.
- SnapKV (Li et al., NeurIPS 2024), as its reference code (and R-KV's port of it) computes it: the
  last ``obs_window`` queries (the observation window) score the *prefix* keys (the keys before the
  window): their logits averaged over the query heads of the KV group, a softmax over the prefix
  keys only, the mean over the window's queries, a 1-D average pool of ``pool_kernel`` over the
  prefix scores (zero padding, ``F.avg_pool1d``'s default: window keys never leak into a prefix
  key's score), then the top ``budget - obs_window`` prefix keys are kept with the whole window.
  SnapKV defines prompt compression; we apply the same rule at every decode-time compression.
  (SnapKV's paper uses a 32-token window; ``obs_window`` defaults to R-KV's 8 and is shared.)
- R-KV (Cai et al., 2025, "Redundancy-aware KV Cache Compression for Reasoning Models"), as deployed
  in the Sparse-RL code (its SGLang ``KVCluster(attn_pooling="max", pooling="maxpool",
  mix_alpha=0.1)``): importance = the same window scores with the group's logits max-pooled instead
  of averaged and a 1-D *max* pool; redundancy = per key, the mean over all keys of their cosine
  similarity to it (diagonal zeroed; for every key i its most recent similar key, cos > 0.5, is
  not counted, and a key with no similar key drops its similarity to the first slot instead, as
  the deployed ``cal_similarity`` does), softmax over keys. score = lambda * importance -
  (1 - lambda) * redundancy; keep the top ``budget - obs_window`` prefix keys plus the window.
  (The deployed SGLang path then sums the scores over KV heads and keeps one set per layer; here
  every KV head keeps its own set.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from actors.config import KVConfig, KVPolicy

RKV_SIM_THRESHOLD = 0.5


@dataclass
class LayerView:
    """One layer of the rows being compressed. S slots, of which the first n[r] are valid."""
    keys: torch.Tensor                 # [R,Hkv,S,D] (after RoPE)
    pos: torch.Tensor                  # [R,Hkv,S] absolute positions
    n: torch.Tensor                    # [R]
    acc: torch.Tensor | None = None    # [R,Hkv,S] accumulated attention (H2O)
    win: torch.Tensor | None = None    # [R,Hkv,g,w,S] window logits, -inf where not visible
    protect: torch.Tensor | None = None  # [R] prompt lengths: positions below stay (protect_prompt)


def layer_view(pool, i: int, rows, n: torch.Tensor, seen: torch.Tensor, scaling: float,
               protect: torch.Tensor | None = None) -> LayerView:
    """The view of layer i of a ``KVPool`` for the rows being compressed: ``rows`` are device
    indices into the pool, or an int m for rows [0, m) (read in place: every live row compresses
    at once when the batch started together). n, seen [R] (device): valid slots and tokens
    processed per row; ``protect`` [R]: prompt lengths whose positions must stay
    (``rollout.kv.protect_prompt``)."""
    if isinstance(rows, int):
        pick = lambda t: t[i, :rows]                                  # noqa: E731
    else:
        pick = lambda t: t[i].index_select(0, rows)                   # noqa: E731
    keys, pos = pick(pool.k), pick(pool.pos)
    acc = pick(pool.acc) if pool.acc is not None else None
    win = None
    if pool.qwin is not None:
        win = window_logits(pick(pool.qwin), seen, keys, pos, n, scaling)
    return LayerView(keys, pos, n, acc, win, protect)


def window_logits(q: torch.Tensor, seen: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor,
                  n: torch.Tensor, scaling: float) -> torch.Tensor:
    """Logits of the ring of the last w queries q [R,Hq,w,D] (slot j holds the position p with
    p % w == j) against keys [R,Hkv,S,D]; -inf where the key is invalid or in the query's future."""
    r, hq, w, d = q.shape
    hkv, s = keys.shape[1], keys.shape[2]
    last = seen - 1
    dev = keys.device
    qpos = last[:, None] - ((last[:, None] - torch.arange(w, device=dev)[None]) % w)  # [R,w]
    g = hq // hkv
    # the group's queries share one GEMM against their KV head (no broadcast copy of the keys)
    logits = torch.matmul(q.reshape(r, hkv, g * w, d).float(),
                          keys.transpose(-1, -2).float()).view(r, hkv, g, w, s) * scaling
    valid = torch.arange(s, device=dev)[None] < n[:, None]                         # [R,S]
    vis = (valid[:, None, None, None, :] & (pos[:, :, None, None, :] <= qpos[:, None, None, :, None])
           & (qpos >= 0)[:, None, None, :, None])
    return logits.masked_fill(~vis, float("-inf"))


def select(policy: KVPolicy, kv: KVConfig, budget: int, view: LayerView) -> torch.Tensor:
    """Slots to keep, [R,Hkv,budget], sorted. Requires n[r] >= budget for every row."""
    return _keep(*score(policy, kv, budget, view), view.n, budget)


def score(policy: KVPolicy, kv: KVConfig, budget: int, view: LayerView
          ) -> tuple[torch.Tensor, int, int]:
    """The policy's slot scores [R,Hkv,S] (higher stays; prompt lifted with ``protect``) and how
    many first and last slots it always keeps."""
    policy = KVPolicy(policy)
    if policy == KVPolicy.streaming:
        s = view.keys.shape[2]
        recency = torch.arange(s, dtype=torch.float32, device=view.pos.device)
        scores, first, last = recency.expand(view.pos.shape), kv.sink_tokens, 0
    elif policy == KVPolicy.h2o:
        scores, first, last = view.acc, 0, round(budget * kv.recent_ratio)
    elif policy == KVPolicy.snapkv:
        scores = snapkv_scores(view.win, view.n, kv.obs_window, kv.pool_kernel)
        first, last = 0, kv.obs_window
    elif policy == KVPolicy.rkv:
        scores = rkv_scores(view.win, view.keys, view.n, kv.obs_window, kv.pool_kernel,
                            kv.rkv_lambda)
        first, last = 0, kv.obs_window
    else:
        raise ValueError(f"no selection rule for KV policy {policy!r}")
    if view.protect is not None:
        scores = protect_prompt(scores, view.pos, view.protect)
    return scores, first, last


# Above every policy score (probabilities, accumulated attention, slot indices: all < 1e6), in
# float64 so a protected slot's own score still orders the prompt when it does not fit.
_PROTECT = 1e9


def protect_prompt(scores: torch.Tensor, pos: torch.Tensor, plen: torch.Tensor) -> torch.Tensor:
    """Lift the scores of prompt positions (pos < plen[r]) above any other slot's: compression then
    evicts response tokens only, unless the prompt alone exceeds the budget (then the policy's own
    ranking chooses among the prompt's tokens). The forced window still wins (it is +inf)."""
    in_prompt = pos < plen.to(pos.device)[:, None, None]
    return scores.double() + in_prompt.double() * _PROTECT


def _ranked(scores: torch.Tensor, n: torch.Tensor, first: int, last: int,
            slot: torch.Tensor) -> torch.Tensor:
    """Scores with the forced slots (the first ``first`` and last ``last`` valid ones) at +inf
    and the invalid slots at -inf; ``slot``: ``arange(S)[None, None]``."""
    nn_ = n[:, None, None]
    valid = slot < nn_
    forced = valid & ((slot < first) | (slot >= nn_ - last))
    scores = scores if scores.dtype == torch.float64 else scores.float()  # protect_prompt: f64
    return scores.masked_fill(forced, float("inf")).masked_fill(~valid, float("-inf"))


def _keep(scores: torch.Tensor, first: int, last: int, n: torch.Tensor, budget: int
          ) -> torch.Tensor:
    """Top-``budget`` valid slots by score, always keeping the first ``first`` and last ``last``."""
    s = scores.shape[-1]
    slot = torch.arange(s, device=scores.device)[None, None]
    scores = _ranked(scores, n, first, last, slot)
    if 2 * budget <= s:
        return scores.topk(budget, dim=-1).indices.sort(dim=-1).values
    # Decode-time compression keeps most slots (budget of budget + N): find the s - budget to
    # evict and list the rest in slot order (6x faster than a top-budget + sort at 2k slots).
    evict = scores.topk(s - budget, dim=-1, largest=False).indices
    keep = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
    keep.scatter_(-1, evict, False)
    return _compact(keep, budget, slot)


def _compact(keep: torch.Tensor, width: int, slot: torch.Tensor) -> torch.Tensor:
    """The slots where ``keep`` [R,Hkv,S] holds, in slot order, [R,Hkv,width] (a row keeping
    fewer than ``width`` is padded with slot 0; ``slot``: ``arange(S)[None, None]``). Compacted
    by a cumsum (rank among the kept) and one scatter, not by ``nonzero``, which would wait for
    the device to learn its output size."""
    rank = torch.where(keep, keep.cumsum(dim=-1) - 1, width)   # evicted -> a spare column
    out = torch.zeros(*keep.shape[:-1], width + 1, dtype=torch.long, device=keep.device)
    out.scatter_(-1, rank, slot.expand(keep.shape))
    return out[..., :width]


# ---- the per-row adaptive budget (rollout.kv.keep_mass) ------------------------------------------

def window_mass(win: torch.Tensor) -> torch.Tensor:
    """[R,Hkv,g,w,S] window logits -> [R,Hkv,S]: each slot's share of the attention of the
    observation window's queries (softmax over every slot a query sees), averaged over the group's
    query heads and the window's queries; a query that sees nothing adds 0."""
    return torch.softmax(win, dim=-1).nan_to_num(0.0).mean(dim=(2, 3))


def ranking(scores: torch.Tensor, first: int, last: int, n: torch.Tensor) -> torch.Tensor:
    """[R,Hkv,S] slot indices, best first by ``score``'s output (forced slots first, invalid
    slots last): the order ``coverage`` and ``keep_rows`` both read."""
    slot = torch.arange(scores.shape[-1], device=scores.device)[None, None]
    return _ranked(scores, n, first, last, slot).argsort(dim=-1, descending=True, stable=True)


def coverage(order: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """[R,Hkv,S]: entry k-1 is the share of ``mass`` held by the first k slots of ``order``
    (``ranking``): what keeping k slots keeps of the window's attention."""
    return mass.gather(-1, order).cumsum(dim=-1)


def mass_budgets(curves: list[torch.Tensor], n: torch.Tensor, lo: int | torch.Tensor, hi: int,
                 share: float) -> torch.Tensor:
    """Per row [R] the fewest slots k, lo <= k <= min(hi, n), whose kept sets hold at least
    ``share`` of the window's attention averaged over layers and KV heads (``curves``: one
    ``coverage`` per layer; ``lo`` an int or per row). Rows whose attention is concentrated keep
    fewer slots than the bin's budget ``hi``; rows whose attention spreads keep up to it (budgets
    that follow the attention mass, as Ada-KV's (Feng et al., 2024) do across heads)."""
    mean = torch.stack(curves).float().mean(dim=(0, 2))                          # [R,S]
    need = (mean < share).sum(dim=-1) + 1
    lo = torch.as_tensor(lo, device=need.device)
    return torch.minimum(torch.maximum(need, lo).clamp(max=hi), n)


def keep_rows(order: torch.Tensor, k: torch.Tensor, width: int) -> torch.Tensor:
    """Per row r the first ``k[r]`` slots of ``order`` (``ranking``), in slot order,
    [R,Hkv,width] with width >= max k (the rest padded with slot 0: beyond the row's new n)."""
    slot = torch.arange(order.shape[-1], device=order.device)[None, None]
    rank = torch.empty_like(order).scatter_(-1, order, slot.expand(order.shape))
    return _compact(rank < k[:, None, None], width, slot)


def window_scores(win: torch.Tensor, n: torch.Tensor, w: int, group: str) -> torch.Tensor:
    """[R,Hkv,g,w,S] window logits -> [R,Hkv,S]: the group's logits averaged (``group="mean"``) or
    max-pooled (``"max"``), softmax over the prefix keys (slots before the last ``w``), mean over
    the window's queries; 0 on the window and invalid slots (queries that see nothing give 0)."""
    s = win.shape[-1]
    slot = torch.arange(s, device=win.device)[None, None, None, None]
    in_window = slot >= (n[:, None, None, None, None] - w)
    pooled = win.mean(dim=2, keepdim=True) if group == "mean" else win.amax(dim=2, keepdim=True)
    probs = torch.softmax(pooled.masked_fill(in_window, float("-inf")), dim=-1).nan_to_num(0.0)
    return probs.mean(dim=3).squeeze(2)


def snapkv_scores(win: torch.Tensor, n: torch.Tensor, w: int, kernel: int) -> torch.Tensor:
    """SnapKV prefix scores [R,Hkv,S] (module doc): group-mean logits, average-pooled."""
    return _pool1d(window_scores(win, n, w, "mean"), kernel, "avg")


def rkv_scores(win: torch.Tensor, keys: torch.Tensor, n: torch.Tensor, w: int, kernel: int,
               lam: float) -> torch.Tensor:
    """R-KV final score [R,Hkv,S] = lam * importance - (1 - lam) * redundancy."""
    importance = _pool1d(window_scores(win, n, w, "max"), kernel, "max")
    return lam * importance - (1.0 - lam) * redundancy(keys, n)


def redundancy(keys: torch.Tensor, n: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """R-KV redundancy [R,Hkv,S] from key cosine similarity (invalid slots excluded).

    Every (row, head) pair at once: the [S,S] similarity is one batched matmul over all pairs, in
    blocks of ``block`` of its rows (the keys i). On CUDA one block (the whole matrix); on the CPU
    64 rows, so the passes over it (threshold, latest match) stream a few MB instead of tens per
    layer. The block depends on S only, never on the batch: a compression issues the same number
    of ops at batch 16 and 64."""
    r, h, s, d = keys.shape
    if block is None:
        block = s if keys.device.type == "cuda" else 64
    ar = torch.arange(s, device=keys.device)
    valid = ar[None] < n[:, None]                                            # [R,S]
    k = F.normalize(keys.float(), dim=-1, eps=1e-8) * valid[:, None, :, None]
    kt = k.transpose(-1, -2)
    # column sums of the similarity without its diagonal, sum_i k_i.k_j - k_j.k_j: one
    # matrix-vector product instead of a pass over every block
    col = (k @ k.sum(dim=2)[..., None]).squeeze(-1) - k.square().sum(dim=-1)
    for i0 in range(0, s, block):
        sim = torch.matmul(k[:, :, i0:i0 + block], kt)                      # [R,Hkv,b(i),S(j)]
        sim.diagonal(offset=i0, dim1=-2, dim2=-1).zero_()
        # for every key i, its most recent similar key j is not counted as redundant because of i
        # (no similar key: j = slot 0, as the deployed cal_similarity's argmax over zeros gives).
        # j + 1 where sim[i, j] > threshold, else 0: relu(sim - t) > 0 exactly when sim > t (the
        # subtraction never flips a sign), and on CPU these float passes run ~2x faster than a
        # bool and an int16 tensor built with torch.where
        hit = (sim - RKV_SIM_THRESHOLD).relu_().sign_().mul_(ar.to(sim.dtype) + 1)
        latest = (hit.amax(dim=-1).long() - 1).clamp_(min=0)                  # [R,Hkv,b]
        dropped = sim.gather(-1, latest[..., None])[..., 0]
        col.scatter_add_(-1, latest, -dropped)
    mean_sim = col / n[:, None, None].float()
    return torch.softmax(mean_sim.masked_fill(~valid[:, None], float("-inf")), dim=-1)


def _pool1d(x: torch.Tensor, kernel: int, how: str) -> torch.Tensor:
    if kernel <= 1:
        return x
    r, h, s = x.shape
    flat = x.reshape(r * h, 1, s)
    if how == "max":
        out = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        out = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)   # zero padding counts
    return out.reshape(r, h, s)
