"""Teacher-forced recomputation of a sparse rollout's log-probs under its recorded kept sets.

``NativeEngine(..., trace=True)`` records, for every compression of a sequence, the position of the
last token processed before it (``after``) and the absolute positions kept per layer and KV head
(``kept [L, Hkv, budget]``). A query at position q then sees key k iff k <= q and, for every
compression with ``after < q``, k was kept or k > after (added later). Running the whole sequence at
once under that per-layer, per-head mask must give the sampler's log-probs: this is what makes them
exactly the sparse policy's (tests/test_kv_reference.py).
"""
from __future__ import annotations

import torch

from actors.native.model import Decoder
from actors.native.sampling import truncate


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


@torch.no_grad()
def recompute_logprobs(model, prompt: list[int], response: list[int], trace,
                       temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                       mode: str = "processed", sparse: bool = True) -> torch.Tensor:
    """Log-probs of ``response`` given ``prompt`` attending only to the kept sets in ``trace``
    (``sparse=False`` ignores the trace: the dense teacher-forced log-probs)."""
    dec = Decoder(model)
    device = next(model.parameters()).device   # the model's device (tests/test_gpu.py: CUDA)
    ids = torch.tensor([prompt + response], device=device)
    total = ids.shape[1]
    masks = [m.to(device) for m in visibility(trace if sparse else [], dec.n_layers, dec.n_kv,
                                              total)]
    positions = torch.arange(total, device=device)[None]
    logits = dec.forward_full(ids, positions, lambda i: masks[i][None, :, None])[0]
    logits = logits[len(prompt) - 1:total - 1]
    if temperature == 0:
        logp = torch.log_softmax(logits, -1)
    elif mode == "processed":
        logp = torch.log_softmax(truncate(logits / temperature, top_k, top_p), -1)
    else:
        logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(-1, torch.tensor(response, device=device)[:, None]).squeeze(-1).cpu()
