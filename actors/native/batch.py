"""Per-sequence bookkeeping of one native ``generate`` call.

Sampled tokens and log-probs are written on the device (``record``; read back once, in
``outputs``). Everything the host decides on (which rows finish, which compress, how many slots a
step reads) follows from counts it mirrors by arithmetic in numpy arrays, so none of it reads the
device; the one exception is the sampled tokens of a step, read when stop tokens or stop strings
are in play (``finished``). Live rows are the pool's rows [0, live), in the order of ``ids``.
"""
from __future__ import annotations

import numpy as np
import torch

from actors.engine import GenerationOutput
from actors.native.stops import StopMatcher


class BatchState:
    def __init__(self, prompts, max_new: list[int], device, trace: bool,
                 stops: StopMatcher | None = None, stop_ids=()):
        self.prompts, self.device, self.stops = prompts, device, stops
        self.stop_ids = np.array(sorted(set(int(t) for t in stop_ids)), dtype=np.int64)
        self.max_new = np.array(max_new, dtype=np.int64).reshape(-1)
        self.plen = np.array([len(p) for p in prompts], dtype=np.int64)
        b, width = len(prompts), max(1, max(max_new, default=1))
        # one spare row: where padding rows of a captured step would record (never read)
        self.tokens = torch.zeros(b + 1, width, dtype=torch.long, device=device)
        self.logps = torch.zeros(b + 1, width, dtype=torch.float32, device=device)
        self.plen_d = torch.tensor(np.append(self.plen, 0), device=device)
        self.count = np.zeros(b, dtype=np.int64)
        self.stopped = np.zeros(b, dtype=bool)
        self.kept_sum = np.zeros(b, dtype=np.float64)
        self.peak = np.zeros(b, dtype=np.int64)
        self.peak_total = 0
        self.attended, self.decode_rows = 0, 0    # KV slots read by decode steps, row-steps
        self.trace = [[] for _ in range(b)] if trace else None
        # live rows (pool order): prompt index, valid slots, tokens processed
        self.ids = np.zeros(0, dtype=np.int64)
        self.n = np.zeros(0, dtype=np.int64)
        self.seen = np.zeros(0, dtype=np.int64)

    @property
    def live(self) -> int:
        return len(self.ids)

    def admit(self, ids: np.ndarray, n: np.ndarray, lens: np.ndarray) -> None:
        """Prompts ``ids`` join as the last rows, holding n slots after a prefill of lens."""
        self.ids = np.concatenate([self.ids, ids])
        self.n = np.concatenate([self.n, n])
        self.seen = np.concatenate([self.seen, lens])
        self.kept_sum[ids] += 1.0             # the prefill attends the whole prompt
        self.peak[ids] = np.maximum(self.peak[ids], n)

    def record(self, pool, tok: torch.Tensor, lp: torch.Tensor) -> None:
        """Store one token per live row (device) and make it the rows' next input."""
        live = self.live
        rowid, count = pool.rowid[:live], pool.count[:live]
        self.tokens.index_put_((rowid, count), tok)
        self.logps.index_put_((rowid, count), lp.float())
        count.add_(1)
        pool.tok[:live].copy_(tok)
        self.count[self.ids] += 1

    def finished(self, tok: torch.Tensor) -> np.ndarray:
        """Which live rows end with this step's token (bool [live]): by length on the host; by a
        stop token or stop string from the tokens read back (the step's one device read)."""
        done = self.count[self.ids] >= self.max_new[self.ids]
        if self.stops is None and not len(self.stop_ids):
            return done
        host = tok.numpy(force=True)          # the one device read of a step
        is_stop = np.isin(host, self.stop_ids)
        if self.stops is not None:
            is_stop |= np.array(self.stops.hits(self.ids.tolist(), host.tolist()), dtype=bool)
        self.stopped[self.ids] = is_stop
        return done | is_stop

    def retire(self, pool, done: np.ndarray) -> None:
        """Drop the finished rows: survivors past the new end move into the holes (one copy per
        pool tensor), so live rows stay [0, live)."""
        keep = np.flatnonzero(~done)
        new_live = len(keep)
        holes = np.flatnonzero(done[:new_live])
        movers = keep[keep >= new_live]
        order = np.arange(len(done))
        order[holes] = movers
        order = order[:new_live]
        if len(holes):
            idx = torch.tensor(np.stack([holes, movers]), device=pool.device)
            pool.move_rows(idx[0], idx[1])
        self.ids, self.n, self.seen = self.ids[order], self.n[order], self.seen[order]

    def advance(self) -> None:
        """After a decode step: every live row holds one slot more; the step read n slots of
        row r where dense would read seen + 1."""
        self.n += 1
        self.seen += 1
        self.kept_sum[self.ids] += self.n / self.seen
        self.peak[self.ids] = np.maximum(self.peak[self.ids], self.n)
        total = int(self.n.sum())
        self.peak_total = max(self.peak_total, total)
        self.attended += total
        self.decode_rows += self.live

    def compressed(self, rows: np.ndarray, kept_pos: torch.Tensor | None) -> None:
        """Rows (live indices) were cut to their budget; kept_pos [R,L,Hkv,budget] for traces."""
        if self.trace is not None:
            kept_pos = kept_pos.cpu()
            for j, r in enumerate(rows.tolist()):
                self.trace[int(self.ids[r])].append((int(self.seen[r]) - 1, kept_pos[j]))

    def outputs(self, bytes_per_token: int, bins_used=lambda total: []) -> list[GenerationOutput]:
        tokens, logps = self.tokens.cpu().tolist(), self.logps.cpu().tolist()
        count = self.count.tolist()
        return [GenerationOutput(
            prompt_ids=list(self.prompts[o]), response_ids=tokens[o][:count[o]],
            logprobs=logps[o][:count[o]], finish_reason="stop" if self.stopped[o] else "length",
            kept_ratio=float(self.kept_sum[o]) / max(1, count[o]),
            peak_kv_bytes=int(self.peak[o]) * bytes_per_token,
            trace=self.trace[o] if self.trace is not None else [],
            bin_budgets=bins_used(len(self.prompts[o]) + count[o]))
            for o in range(len(self.prompts))]
