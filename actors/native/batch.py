"""Per-sequence bookkeeping of one native ``generate`` call.

Sampled tokens and log-probs are written on the device (``record``; read back once, in
``outputs``). Everything the host decides on (which rows finish, which compress, how many slots a
step reads) follows from counts it mirrors by arithmetic in numpy arrays, so none of it reads the
device; the one exception is the sampled tokens of a step, read when stop tokens or stop strings
are in play. That read is issued without blocking (``issue_read``: a copy into pinned memory on
CUDA) and taken one step later (``resolve``), after the next decode step is already queued, so
the device never idles while the host checks for stops. The price: a row that emitted a stop
token decodes one step too many; its extra token is dropped (count, kept ratio, peak and trace
events are rolled back to the stop), exactly as if it had left at once. Live rows are the pool's
rows [0, live), in the order of ``ids``.
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
        self.kept = np.zeros(b, dtype=np.int64)           # slots after the latest compression
        self.peak_total = 0
        self.attended, self.decode_rows = 0, 0    # KV slots read by decode steps, row-steps
        self.trace = [[] for _ in range(b)] if trace else None
        self.final = np.full(b, -1, dtype=np.int64)      # response length once a row has left
        self.last_ratio = np.zeros(b, dtype=np.float64)  # of the latest step (rolled back on a
        self.peak_before = np.zeros(b, dtype=np.int64)   # stop found one step late)
        self.pending = None                               # the tokens read one step late
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
        self.kept[ids] = n

    def record(self, pool, tok: torch.Tensor, lp: torch.Tensor) -> None:
        """Store one token per live row (device) and make it the rows' next input."""
        live = self.live
        rowid, count = pool.rowid[:live], pool.count[:live]
        self.tokens.index_put_((rowid, count), tok)
        self.logps.index_put_((rowid, count), lp.float())
        count.add_(1)
        pool.tok[:live].copy_(tok)
        self.count[self.ids] += 1

    def by_length(self) -> np.ndarray:
        """Live rows (bool [live]) whose response reached its ``max_new`` (known on the host)."""
        return self.count[self.ids] >= self.max_new[self.ids]

    @property
    def reads_tokens(self) -> bool:
        return self.stops is not None or bool(len(self.stop_ids))

    def issue_read(self, tok: torch.Tensor, leaving: np.ndarray) -> None:
        """Start copying this step's tokens to the host (pinned, non-blocking on CUDA);
        ``leaving`` [live]: rows found stopped a step ago, whose token here is not theirs."""
        if not self.reads_tokens:
            return
        keep = ~leaving
        event = None
        if tok.is_cuda:
            host = torch.empty(tok.shape, dtype=tok.dtype, pin_memory=True)
            host.copy_(tok, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = tok
        self.pending = (self.ids[keep], self.count[self.ids][keep], host, event, keep)

    def resolve(self) -> np.ndarray:
        """Take the tokens read one step ago: mark the rows they stopped; return which live rows
        (bool [live]) must leave now because of it, their extra step rolled back."""
        leave = np.zeros(self.live, dtype=bool)
        if self.pending is None:
            return leave
        ids, counts, host, event, keep = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        tokens = host.numpy()[keep]           # the one device read of a step
        # a token belongs to its response while the row is live, or when the row left by length
        # with exactly this token
        valid = (self.final[ids] < 0) | (counts <= self.final[ids])
        ids, counts, tokens = ids[valid], counts[valid], tokens[valid]
        is_stop = np.isin(tokens, self.stop_ids)
        if self.stops is not None:
            is_stop |= np.array(self.stops.hits(ids.tolist(), tokens.tolist()), dtype=bool)
        hit, c = ids[is_stop], counts[is_stop]
        self.stopped[hit] = True
        late = self.final[hit] < 0            # still live: decoded one step past the stop
        hit, c = hit[late], c[late]
        self.count[hit] = c
        self.kept_sum[hit] -= self.last_ratio[hit]
        self.peak[hit] = self.peak_before[hit]
        leave[np.isin(self.ids, hit)] = True
        return leave

    def retire(self, pool, done: np.ndarray) -> None:
        """Drop the finished rows: survivors past the new end move into the holes (one copy per
        pool tensor), so live rows stay [0, live)."""
        self.final[self.ids[done]] = self.count[self.ids[done]]
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
        ids = self.ids
        self.last_ratio[ids] = self.n / self.seen
        self.kept_sum[ids] += self.last_ratio[ids]
        self.peak_before[ids] = self.peak[ids]
        self.peak[ids] = np.maximum(self.peak[ids], self.n)
        total = int(self.n.sum())
        self.peak_total = max(self.peak_total, total)
        self.attended += total
        self.decode_rows += self.live

    def forced(self, tokens: int, steps: int) -> None:
        """A teacher-forced run (``forced.py``) moved every live row ``tokens`` response tokens on
        through ``steps`` decode steps (a prefill: one token, no step); nothing is recorded."""
        self.count[self.ids] += tokens
        for _ in range(steps):
            self.advance()

    def compressed(self, rows: np.ndarray, kept: np.ndarray, kept_pos: torch.Tensor | None
                   ) -> None:
        """Rows (live indices) were cut to ``kept`` [R] slots each; kept_pos [R,L,Hkv,>= kept]
        (sorted positions, the first kept[j] of row j valid) for traces."""
        self.n[rows] = kept
        self.kept[self.ids[rows]] = kept
        if self.trace is not None:
            kept_pos = kept_pos.cpu()
            for j, r in enumerate(rows.tolist()):
                self.trace[int(self.ids[r])].append((int(self.seen[r]) - 1,
                                                     kept_pos[j][..., :int(kept[j])]))

    def outputs(self, bytes_per_token: int, bins_used=lambda total: []) -> list[GenerationOutput]:
        self.resolve()                        # the last step's tokens, for finish reasons
        tokens, logps = self.tokens.cpu().tolist(), self.logps.cpu().tolist()
        count = self.count.tolist()
        if self.trace is not None:            # a compression after the stop token was sampled,
            for o, events in enumerate(self.trace):    # before it was read: no query of the
                total = len(self.prompts[o]) + count[o]  # response sees it
                events[:] = [e for e in events if e[0] < total - 2]
        return [GenerationOutput(
            prompt_ids=list(self.prompts[o]), response_ids=tokens[o][:count[o]],
            logprobs=logps[o][:count[o]], finish_reason="stop" if self.stopped[o] else "length",
            kept_ratio=float(self.kept_sum[o]) / max(1, count[o]),
            peak_kv_bytes=int(self.peak[o]) * bytes_per_token,
            trace=self.trace[o] if self.trace is not None else [],
            bin_budgets=bins_used(len(self.prompts[o]) + count[o]))
            for o in range(len(self.prompts))]
