"""In-memory bookkeeping of live rows and groups, and row gathering across stored batches."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from buffer.schema import State


@dataclass(slots=True)
class Row:
    sid: str
    seg: int            # key of the data batch (= data segment seq) holding the row
    pos: int            # row number inside that batch
    group: str
    prompt_idx: int
    version: int        # policy version of the sampler
    reward: float
    resp_len: int
    state: State = State.GENERATED
    score: tuple[int, int] | None = None   # (log batch key, row) of its scores


@dataclass
class Group:
    gid: str
    prompt_idx: int
    version: int                              # min policy version of its rows (staleness)
    rows: dict[str, None] = field(default_factory=dict)   # ordered set of sample ids
    n_scored: int = 0
    leased: bool = False

    def ready(self, group_size: int) -> bool:
        n = len(self.rows)
        return (not self.leased and n > 0 and self.n_scored == n
                and (group_size == 0 or n == group_size))


class RecentIds:
    """Bounded memory of ids that reached a terminal state, so a producer's retried append of
    already-consumed rows is recognised as a duplicate (older ids are forgotten)."""

    def __init__(self, limit: int = 200_000):
        self.limit, self._ids = limit, OrderedDict()

    def add(self, sid: str) -> None:
        self._ids[sid] = None
        if len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def __contains__(self, sid: str) -> bool:
        return sid in self._ids


def take_rows(store: dict[int, pa.RecordBatch], refs: list[tuple[int, int]]) -> pa.RecordBatch:
    """Rows `refs` = [(batch key, row)], in that order, as one record batch.

    One `take` per distinct source batch, then one `take` restoring the requested order.
    """
    by_key: dict[int, tuple[list[int], list[int]]] = {}
    for i, (key, pos) in enumerate(refs):
        idx, where = by_key.setdefault(key, ([], []))
        idx.append(pos)
        where.append(i)
    parts, perm = [], []
    for key, (idx, where) in by_key.items():
        parts.append(store[key].take(pa.array(idx, pa.int64())))
        perm.extend(where)
    if not parts:
        raise ValueError("take_rows: no rows requested")
    cat = pa.concat_batches(parts) if len(parts) > 1 else parts[0]
    if perm == sorted(perm):
        return cat
    inv = np.empty(len(perm), dtype=np.int64)
    inv[np.asarray(perm)] = np.arange(len(perm))
    return cat.take(pa.array(inv))
