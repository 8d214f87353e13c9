"""How one learner rank cuts its shard into mini-batches and micro-batches (pure; no DeepSpeed).

Mini-batches (one optimiser step each) are given per row by the driver (``learner.batch``), the same
however the batch is split over learners; this rank's rows of each are contiguous. Inside one, rows are
packed greedily, in order, into micro-batches of at most ``max_rows`` rows and ``max_tokens`` padded
tokens (rows x the longest row's length; 0: no token bound), so activation memory follows tokens,
not rows. ZeRO-2/3 run collectives in every forward/backward, so every rank must run the same
number of micro-batches per mini-batch: ``plan`` takes the per-mini-batch maximum over ranks (and
the global loss units) from ``reduce`` and pads with zero-weight micro-batches.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# reduce(values [n] float64, op "max" | "sum") -> the same over every data-parallel rank
Reduce = Callable[[torch.Tensor, str], torch.Tensor]


@dataclass
class MiniBatch:
    slices: list[slice]    # row ranges of this rank's shard, one per micro-batch
    units: list[float]     # kept tokens (or sequences) per micro-batch on this rank; 0 = padding
    total: float           # kept units of the mini-batch on every rank together


def micro_slices(lengths: list[int], max_rows: int, max_tokens: int, start: int = 0) -> list[slice]:
    """Greedy in-order packing of rows with ``lengths`` (see module doc); a row longer than
    ``max_tokens`` gets a micro-batch of its own. Slices are offset by ``start``."""
    out, a, longest = [], 0, 0
    for i, n in enumerate(lengths):
        wider = max(longest, n)
        rows = i - a + 1
        if i > a and (rows > max_rows or (max_tokens and rows * wider > max_tokens)):
            out.append(slice(start + a, start + i))
            a, wider = i, n
        longest = wider
    if lengths:
        out.append(slice(start + a, start + len(lengths)))
    return out


def mini_ranges(mini_batch: torch.Tensor, n: int) -> list[tuple[int, int]]:
    """Row range of each of the ``n`` mini-batches, from each row's mini-batch index (rows are
    ordered by it; a range is empty where this rank has no row of that mini-batch)."""
    if mini_batch.numel() and not bool((mini_batch[1:] >= mini_batch[:-1]).all()):
        raise ValueError("rows must be ordered by mini-batch (learner.batch.shard_batch does it)")
    ends = torch.bincount(mini_batch.long(), minlength=n).cumsum(0).tolist()
    if len(ends) > n:
        raise ValueError(f"a row's mini-batch index is >= learner.mini_batches ({n})")
    return list(zip([0] + ends[:-1], ends))


def plan(lengths: torch.Tensor, unit_rows: torch.Tensor, mini_batch: torch.Tensor,
         mini_batches: int, max_rows: int, max_tokens: int,
         reduce: Reduce | None = None) -> list[MiniBatch]:
    """Mini-batches of this rank's rows (``lengths`` [B] tokens per row, ``unit_rows`` [B] loss
    units per row, ``mini_batch`` [B] each row's mini-batch index from
    ``learner.batch.prepare_batch``), micro-batch counts equalised and totals summed over ranks
    by ``reduce``."""
    minis = []
    for a, b in mini_ranges(mini_batch, mini_batches):
        sl = micro_slices(lengths[a:b].tolist(), max_rows, max_tokens, start=a)
        minis.append((sl, [float(unit_rows[s].sum()) for s in sl]))
    counts = torch.tensor([float(len(s)) for s, _ in minis], dtype=torch.float64)
    totals = torch.tensor([sum(u) for _, u in minis], dtype=torch.float64)
    if reduce is not None:
        counts, totals = reduce(counts, "max"), reduce(totals, "sum")
    out = []
    for (sl, units), n, total in zip(minis, counts.tolist(), totals.tolist()):
        pad = int(n) - len(sl)   # padding micro-batches: keep collectives in step, add nothing
        out.append(MiniBatch(sl + [slice(0, 1)] * pad, units + [0.0] * pad, float(total)))
    return out
