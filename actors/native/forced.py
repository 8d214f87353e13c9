"""Teacher-forced runs of the native engine in chunks between compressions.

``NativeEngine.replay`` and ``replay_kept_sets`` read given responses through the engine's own
sparse path: the same prefill, KV policy, schedule and compressions as sampling. Sampling must
decode one token at a time, because each token depends on the last; a forced run knows its tokens,
so the decode steps between two compressions can run as one forward over the chunk against the
cache: chunk token t attends the row's kept slots and chunk tokens 0..t, exactly what its decode
step would see. A row compresses when its cache reaches ``budget + compress_every`` slots, so a
chunk is at most ``compress_every`` tokens (``CHUNK_TOKENS`` with a dense cache). The
chunk stops where any live row compresses, ends its response, or (with a per-bin schedule)
enters a new bin, and there the run compresses and retires rows as the decode loop would, so
compressions happen at the same positions on the same cache contents; only float rounding
differs (one batched matmul instead of several). ``stepwise`` is the reference: the sampler's
own decode loop forced token by token (``tests/test_engine_forced.py`` checks the two agree,
``bench/replay.py`` times them side by side).

Rows run in batches of the engine's ``batch_size`` (no continuous batching: a row's result does
not depend on which rows share its batch). Chunks are as long as the rows' compression phases
allow: with prompts of one length (the reasoning task's) every row compresses at the same steps.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from actors.config import KVPolicy
from actors.engine import SamplingParams
from actors.native.batch import BatchState
from actors.native.model import attend
from actors.native.sampling import processed_logprobs

# on_chunk(ids [R] prompt indices, first [R] response step of the chunk, logits [R,k,V] or None)
OnChunk = Callable[[np.ndarray, np.ndarray, "torch.Tensor | None"], None]
# The longest chunk: a chunk holds attention scores [R,Hq,k,slots] and, for ``replay``, logits
# [R,k,V]; without a cap a cache that never compresses (dense, or a budget above the sequence)
# would read a whole 4k-token response at once (tens of GB of logits at a 150k vocabulary).
CHUNK_TOKENS = 256


def chunk_step(dec, pool, tokens: torch.Tensor, s: int, h2o: bool) -> torch.Tensor:
    """Append ``tokens`` [R,k] to rows [0, R) of ``pool`` (slots n..n+k-1, positions
    seen..seen+k-1) through every layer; returns the last layer's hidden states [R,k,H]. Token t
    of row r attends slots [0, n[r] + t]; keys, values, positions (and the H2O totals, the window
    of the last queries) are written as k decode steps would write them."""
    rows, k = tokens.shape
    dev = tokens.device
    n, seen = pool.n[:rows], pool.seen[:rows]
    t = torch.arange(k, device=dev)
    positions = seen[:, None] + t                                               # [R,k]
    visible = torch.arange(s, device=dev)[None, None] <= (n[:, None] + t)[:, :, None]
    mask = visible[:, None, None]                                               # [R,1,1,k,s]
    index = pool.chunk_index(rows, n, seen, k)
    x = dec.embed(tokens)
    cos, sin = dec.rope(x, positions)
    for i in range(dec.n_layers):
        q, key, v = dec.qkv(i, x, cos, sin)
        pool.append_step(i, rows, key, v, q[:, :, k - min(k, pool.obs_window):], index)
        out, probs = attend(q, pool.k[i, :rows, :, :s], pool.v[i, :rows, :, :s], mask,
                            dec.scaling, want_probs=h2o)
        if h2o:
            pool.acc[i, :rows, :, :s] += probs.sum(dim=(2, 3))
        x = dec.finish(i, x, out)
    n.add_(k)
    seen.add_(k)
    return x


def chunk_length(engine, st: BatchState) -> int:
    """Decode steps every live row can take before one of them must compress, has read its whole
    response, or (per-bin schedule) writes into a new bin whose budget may cut it; at most
    ``CHUNK_TOKENS``."""
    room = engine._limit(st) - st.n
    left = st.max_new[st.ids] - st.count[st.ids]
    k = min(int(room.min()), int(left.min()), CHUNK_TOKENS)
    if len(engine.budgets) > 1:
        bt = engine.kv.bin_tokens
        k = min(k, int((bt - st.seen % bt).min()))
    if k < 1:    # a compressed row holds its budget, under its limit: a bug if ever reached
        raise RuntimeError(f"native engine: forced run found no room to step (chunk of {k})")
    return k


@torch.no_grad()
def run_forced(engine, prompts: list[list[int]], responses: list[list[int]], on_chunk: OnChunk,
               logits: bool) -> BatchState:
    """Read ``responses`` after ``prompts`` teacher-forced through ``engine``'s sparse path;
    ``on_chunk`` gets every chunk's next-token logits (the prefill's as a chunk of one) when
    ``logits``, else None. Returns the run's state (its ``trace``: compression events)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("native engine: empty prompt (every prompt needs at least one token)")
    if any(len(r) == 0 for r in responses):
        raise ValueError("native engine: a forced run needs a non-empty response per row")
    engine.dec.refresh()
    dev = engine.device = next(engine.model.parameters()).device
    dec, h2o = engine.dec, engine.policy == KVPolicy.h2o
    st = BatchState(prompts, [len(r) for r in responses], dev, engine.trace)
    if not prompts:
        return st
    lmax, longest = max(len(p) for p in prompts), max(len(r) for r in responses)
    pool = engine._pool(min(engine.batch_size, len(prompts)), engine._capacity(lmax, longest))
    queue = list(range(len(prompts)))
    while queue or st.live:
        if st.live == 0:
            take, queue = queue[:engine.batch_size], queue[engine.batch_size:]
            first = engine._admit(prompts, take, pool, st)
            on_chunk(st.ids, np.zeros(len(take), dtype=np.int64),
                     first[:, None] if logits else None)
            st.forced(1, steps=0)
        done = st.by_length()
        if done.any():
            st.retire(pool, done)
            continue
        full = np.flatnonzero(st.n >= engine._limit(st))
        if len(full):
            engine._compress(pool, full, st)
        k = chunk_length(engine, st)
        ids, count = st.ids, st.count[st.ids]
        tokens = torch.tensor([responses[o][c - 1: c - 1 + k] for o, c in zip(ids.tolist(),
                                                                             count.tolist())],
                              dtype=torch.long, device=dev)
        hidden = chunk_step(dec, pool, tokens, min(int(st.n.max()) + k, pool.cap), h2o)
        on_chunk(ids, count, dec.logits(hidden) if logits else None)
        st.forced(k, steps=k)
    return st


@torch.no_grad()
def stepwise(engine, prompts: list[list[int]], responses: list[list[int]],
             params: SamplingParams | None = None) -> tuple[list, list]:
    """The reference a chunked run is checked and timed against: the sampler's decode loop
    (``NativeEngine._run``: one decode step a token, continuous batching) with each step's token
    forced to the given response. Returns, per row, the next-token log-probs [len(response), V]
    of ``params``'s distribution (default: greedy's) and the compression events (the engine
    needs ``trace=True`` for them)."""
    params = params or SamplingParams(temperature=0.0)
    logps: list[list[torch.Tensor]] = [[] for _ in prompts]

    def pick(logits, st):
        logp = processed_logprobs(logits.float(), params.temperature, params.top_k, params.top_p)
        ids, steps = st.ids.tolist(), st.count[st.ids].tolist()
        tok = torch.tensor([responses[o][c] for o, c in zip(ids, steps)], device=logits.device)
        for j, o in enumerate(ids):
            logps[o].append(logp[j].cpu())
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)

    outs = engine._run(prompts, [len(r) for r in responses], params, pick)
    return [torch.stack(d) for d in logps], [o.trace for o in outs]
