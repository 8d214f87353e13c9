"""Arrow batch -> right-padded torch tensors, vectorised over pyarrow list offsets.

For row b with prompt length P_b and response length R_b, T = max_b(P_b + R_b):
    input_ids[b, :P_b+R_b] = prompt_ids[b] ++ response_ids[b], pad_id after
    attention_mask[b, t]   = 1 for t < P_b + R_b
    response_mask[b, t]    = 1 for P_b <= t < P_b + R_b
    *_logprobs[b, P_b + j] = log-prob of response token j (so the log-prob of token t sits at
                             t, matching common.modeling.token_logprobs), 0 elsewhere.
Every list column is flattened once; each flat element's (row, column) is computed from
repeat_interleave over lengths and a single index_put scatters it. No per-row Python loop.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch


# Columns a producer may fill for some rows only (e.g. rows from before rollout.dense_logprobs
# was turned on): the key is given only when every row has them, never an error.
_OPTIONAL = ("dense_sampler_logprobs", "kv_evictions")


def _as_batch(batch: pa.RecordBatch | pa.Table) -> pa.RecordBatch:
    if isinstance(batch, pa.Table):
        t = batch.combine_chunks()
        return t.to_batches()[0] if t.num_rows else pa.RecordBatch.from_pylist([], schema=t.schema)
    return batch


def _lengths(arr: pa.Array) -> torch.Tensor:
    return torch.from_numpy(pc.list_value_length(arr).fill_null(0)
                            .to_numpy(zero_copy_only=False).astype(np.int64))


def _flat(arr: pa.Array, dtype) -> torch.Tensor:
    x = np.ascontiguousarray(arr.flatten().to_numpy(zero_copy_only=False), dtype=dtype)
    # Arrow memory is read-only; torch warns on wrapping it, so copy only in that case.
    return torch.from_numpy(x if x.flags.writeable else x.copy())


def _positions(lengths: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each flattened element of lists with `lengths`, shifted by `offset`."""
    b = lengths.numel()
    rows = torch.repeat_interleave(torch.arange(b), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)
    return rows, within + offset[rows]


def to_tensors(batch: pa.RecordBatch | pa.Table, pad_id: int) -> dict[str, torch.Tensor]:
    """Padded tensors for the learner (see module docstring).

    Keys: input_ids [B,T] int64; attention_mask, response_mask [B,T] int64 0/1 (HF style);
    sampler_logprobs [B,T] float32,
    old_logprobs [B,T] float32 (only if every row is scored), ref_logprobs [B,T] float32
    (only if every row has them), dense_sampler_logprobs [B,T] float32 (pi_dense at the
    sampler's version; only if every row has them, left out otherwise), rewards [B] float32,
    group_index [B] int64 (0..n_groups-1 in order of first appearance), policy_version [B]
    int64, scorer_version [B] int64 (-1 where unscored; when the batch has the column),
    prompt_lens/response_lens [B], kv_evictions [B, L*Hkv, T] int32 (the sparse sampler's kept
    sets, ``common.kept.evictions``, -1 = never evicted, also on padding; only if
    every row has them).
    """
    b = _as_batch(batch)
    n = b.num_rows
    plen, rlen = _lengths(b.column("prompt_ids")), _lengths(b.column("response_ids"))
    total = plen + rlen
    t = int(total.max()) if n else 0
    input_ids = torch.full((n, t), int(pad_id), dtype=torch.int64)
    pr, pc_ = _positions(plen, torch.zeros(n, dtype=torch.int64))
    input_ids[pr, pc_] = _flat(b.column("prompt_ids"), np.int64)
    rr, rc = _positions(rlen, plen)
    input_ids[rr, rc] = _flat(b.column("response_ids"), np.int64)
    cols = torch.arange(t).unsqueeze(0)
    out = {
        "input_ids": input_ids,
        "attention_mask": (cols < total.unsqueeze(1)).long(),
        "response_mask": ((cols >= plen.unsqueeze(1)) & (cols < total.unsqueeze(1))).long(),
        "rewards": torch.from_numpy(b.column("reward").to_numpy(zero_copy_only=False)
                                    .astype(np.float32)),
        "group_index": torch.from_numpy(pc.dictionary_encode(b.column("group_id")).indices
                                        .to_numpy(zero_copy_only=False).astype(np.int64)),
        "policy_version": torch.from_numpy(b.column("policy_version")
                                           .to_numpy(zero_copy_only=False).astype(np.int64)),
        "prompt_lens": plen,
        "response_lens": rlen,
    }
    if "scorer_version" in b.schema.names:
        out["scorer_version"] = torch.from_numpy(pc.fill_null(b.column("scorer_version"), -1)
                                                 .to_numpy(zero_copy_only=False).astype(np.int64))
    for name in ("sampler_logprobs", "old_logprobs", "ref_logprobs", "dense_sampler_logprobs"):
        if name not in b.schema.names:
            continue
        col = b.column(name)
        if (col.null_count == n and n) or (col.null_count and name in _OPTIONAL):
            continue                      # never scored / no reference model: key left out
        if col.null_count:
            raise ValueError(f"to_tensors: column '{name}' is null for {col.null_count} of {n} "
                             "rows; sample only scored rows")
        if not torch.equal(_lengths(col), rlen):
            raise ValueError(f"to_tensors: '{name}' lengths differ from response lengths")
        dense = torch.zeros((n, t), dtype=torch.float32)
        dense[rr, rc] = _flat(col, np.float32)
        out[name] = dense
    ev = _evictions(b, total, t)
    if ev is not None:
        out["kv_evictions"] = ev
    return out


def _evictions(b: pa.RecordBatch, total: torch.Tensor, t: int) -> torch.Tensor | None:
    """The rows' flat ``kv_evictions`` lists as [B, L*Hkv, T] (every row the same L*Hkv)."""
    if "kv_evictions" not in b.schema.names or b.num_rows == 0:
        return None
    col = b.column("kv_evictions")
    if col.null_count:
        return None
    lens = _lengths(col)
    lh = lens // total.clamp(min=1)
    if not torch.equal(lh * total, lens) or not bool((lh == lh[0]).all()):
        raise ValueError("to_tensors: 'kv_evictions' lengths are not one (layer, head) count "
                         "times each row's prompt + response length")
    out = torch.full((b.num_rows, int(lh[0]), t), -1, dtype=torch.int32)
    rows = torch.repeat_interleave(torch.arange(b.num_rows), lens)
    within = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens,
                                                                      lens)
    seq = total[rows]
    out[rows, within // seq, within % seq] = _flat(col, np.int32)
    return out
