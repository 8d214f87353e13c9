"""The kept-set visibility rule of a compressed KV cache, read by the engine that records the kept
sets (``actors.native.reference``, ``actors.sampler_adapter``) and by the learner that trains under
them (``learner.distill``), so it lives below both.

A rollout traced by ``NativeEngine(..., trace=True)`` records, for every compression of a sequence,
the position of the last token processed before it (``after``) and the absolute positions kept per
layer and KV head (``kept [L, Hkv, budget]``). A query at position q then sees key k iff k <= q and,
for every compression with ``after < q``, k was kept or k > after (added later).
"""
from __future__ import annotations

import torch

NEVER = -1   # eviction point of a key that stayed in the cache to the end


def evictions(trace, n_layers: int, n_kv: int, total: int) -> torch.Tensor:
    """The kept sets in compact form: int32 [L, Hkv, total], for every layer, KV head and position
    k the ``after`` of the compression that evicted k (``NEVER`` if none did). An evicted key never
    returns, so this is all a mask needs (``kept_visibility``); it is what a rollout row records
    for the learner (``kv_evictions``), L * Hkv * total integers instead of every kept set."""
    ev = torch.full((n_layers, n_kv, total), NEVER, dtype=torch.int32)
    pos = torch.arange(total)
    for after, kept in trace:
        in_kept = torch.zeros(n_layers, n_kv, total, dtype=torch.bool)
        in_kept.scatter_(2, kept.long().cpu(), True)
        ev[(ev == NEVER) & ~in_kept & (pos <= after)] = int(after)
    return ev


def kept_visibility(ev: torch.Tensor) -> torch.Tensor:
    """bool [..., T, T] from evictions [..., T]: query q attends key k iff k <= q and k was not
    evicted before q (never, or at a compression after which q had not been processed yet)."""
    t = ev.shape[-1]
    ar = torch.arange(t, device=ev.device)
    q, k = ar[:, None], ar[None, :]
    e = ev[..., None, :]
    return (k <= q) & ((e == NEVER) | (q <= e))


def visibility(trace, n_layers: int, n_kv: int, total: int) -> list[torch.Tensor]:
    """Per layer, bool [Hkv, T, T]: may query q attend key k under the recorded evictions."""
    ev = evictions(trace, n_layers, n_kv, total)
    return [kept_visibility(ev[layer]) for layer in range(n_layers)]
