"""ReplayBuffer: the durable store between rollout actors, the dense scorer and the learner.

Lifecycle of a sample: generated --set_scores--> scored --sample_batch (lease)--> consumed.
Stale groups (policy_version < learner_version - max_staleness) become dropped, or requeued
(their prompt_idx waits in take_requeued()) by config.

Durability is write-ahead: every mutation is first written as an atomic segment (storage.py),
then applied in memory by the same `_apply_data` / `_apply_log` code that recovery replays,
so a restarted buffer reaches exactly the state of the acknowledged operations. Leases
(rows handed to a scorer or learner and not yet answered) live in memory only: after a crash
those rows are offered again, never lost. Segments whose rows are all terminal are deleted
(data first, then the logs that mention them, so a restart cannot resurrect a consumed row).
"""
from __future__ import annotations

import functools
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from buffer.config import BufferConfig, StalePolicy
from buffer.errors import BufferFull
from buffer.index import Group, RecentIds, Row, take_rows
from buffer.pods import max_variance_subset
from buffer.schema import (LOG_SCHEMA, SCHEMA, STATE_BY_LABEL, State, _lp_array, log_batch,
                           normalize_batch, rows_to_batch, upgrade)
from buffer.storage import SegmentStore

_LIVE = (State.GENERATED, State.SCORED)


def _split_scores(batch: pa.RecordBatch) -> tuple[pa.RecordBatch, pa.RecordBatch | None]:
    """Data rows are stored unscored and `generated`; scores given with them (old_logprobs
    present) are returned separately so they go through the state log like set_scores."""
    n = batch.num_rows
    scored = pc.is_valid(batch.column("old_logprobs"))
    prescored = batch.filter(scored) if pc.any(scored).as_py() else None
    for name, value in (("old_logprobs", pa.nulls(n, SCHEMA.field("old_logprobs").type)),
                        ("ref_logprobs", pa.nulls(n, SCHEMA.field("ref_logprobs").type)),
                        ("scorer_version", pa.array([-1] * n, pa.int64())),
                        ("state", pa.array([State.GENERATED.label] * n, pa.string()))):
        batch = batch.set_column(SCHEMA.get_field_index(name), SCHEMA.field(name), value)
    return batch, prescored


def _locked(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return fn(self, *args, **kwargs)
    return wrapper


class ReplayBuffer:
    """Plain class; `ray.remote(ReplayBuffer).remote(cfg, root)` serves it as an actor.

    With a root directory (argument, else `cfg.root`) every operation is persisted and the
    constructor recovers whatever segments the directory already holds.
    """

    def __init__(self, cfg: BufferConfig, root: str | None = None):
        cfg.validate()
        self.cfg = cfg
        self._lock = threading.RLock()
        root = root if root is not None else cfg.root
        self._store = SegmentStore(root, cfg.fsync) if root else None
        self._mem_seq = 0
        self._data: dict[int, pa.RecordBatch] = {}
        self._scores: dict[int, pa.RecordBatch] = {}
        self._rows: dict[str, Row] = {}
        self._groups: dict[str, Group] = {}
        self._seg_live: dict[int, int] = {}
        self._score_live: dict[int, int] = {}
        self._log_refs: dict[int, set[int]] = {}     # log seq -> data segs it mentions
        self._seg_logs: dict[int, set[int]] = {}     # data seg -> logs mentioning it
        self._unscored: dict[str, None] = {}         # generated rows, FIFO
        self._scoring_lease: dict[str, float] = {}
        self._train_lease: dict[str, tuple[set[str], list[str]]] = {}  # gid -> (kept, extra)
        self._requeued: dict[str, tuple[int, list[str]]] = {}         # gid -> (prompt, ids)
        self._recent = RecentIds()
        self._live = 0
        self._learner_version: int | None = None
        self._dead_segs: list[int] = []
        self.metrics: dict[str, float] = dict.fromkeys((
            "appended_rows", "duplicate_rows", "full_rejections", "scored_rows",
            "score_ignored_rows", "consumed_rows", "stale_dropped_groups", "stale_dropped_rows",
            "requeued_groups", "requeued_rows", "pods_dropped_rows", "sampled_groups",
            "sampled_rows", "released_groups", "recovered_rows"), 0)
        self.metrics.update(last_batch_staleness_mean=0.0, last_batch_staleness_max=0.0)
        if self._store is not None:
            self._recover()

    # ---- producers ---------------------------------------------------------------------
    @_locked
    def append(self, rows: Sequence[Mapping] | pa.RecordBatch | pa.Table) -> list[str]:
        """Store rows (whole groups per call); returns their sample ids, in order.

        Rows whose sample_id is already known are ignored (a retried append is idempotent).
        Raises BufferFull, storing nothing, if the new rows would exceed `capacity`.
        """
        batch = normalize_batch(rows) if isinstance(rows, (pa.RecordBatch, pa.Table)) \
            else rows_to_batch(rows)
        batch, prescored = _split_scores(batch)
        ids = batch.column("sample_id").to_pylist()
        if len(set(ids)) != len(ids):
            raise ValueError("append: duplicate sample_id within one call")
        new = [sid not in self._rows and sid not in self._recent for sid in ids]
        n_new = sum(new)
        self.metrics["duplicate_rows"] += len(ids) - n_new
        if n_new == 0:
            return ids
        if n_new < len(ids):
            batch = batch.filter(pa.array(new))
        if n_new > self.cfg.capacity:        # retrying could never succeed: not a "full" answer
            raise ValueError(f"append: {n_new} rows exceed buffer.capacity "
                             f"{self.cfg.capacity}; append fewer rows per call")
        if self._live + n_new > self.cfg.capacity:
            self.metrics["full_rejections"] += 1
            raise BufferFull(self.cfg.capacity, self._live, n_new)
        leased = set(batch.column("group_id").to_pylist()) & set(self._train_lease)
        if leased:
            raise ValueError(f"append: groups {sorted(leased)[:5]} are being trained on; "
                             "append whole groups with fresh group_ids")
        step = self.cfg.segment_rows
        for start in range(0, batch.num_rows, step):
            chunk = batch.slice(start, step)
            self._apply_data(chunk, self._write("data", chunk))
        self.metrics["appended_rows"] += n_new
        if prescored is not None:             # rows that came scored: record it like set_scores
            keep = pc.is_in(prescored.column("sample_id"), batch.column("sample_id"))
            p = prescored.filter(keep)
            for v in set(p.column("scorer_version").to_pylist()):
                q = p.filter(pc.equal(p.column("scorer_version"), v))
                self.set_scores(q.column("sample_id").to_pylist(), q.column("old_logprobs"), v,
                                q.column("ref_logprobs") if q.column("ref_logprobs").null_count
                                < q.num_rows else None)
        return ids

    def try_append(self, rows) -> list[str] | None:
        """append(), but None instead of BufferFull: the producer keeps its rows and retries."""
        try:
            return self.append(rows)
        except BufferFull:
            return None

    # ---- scorer ------------------------------------------------------------------------
    @_locked
    def pending_scoring(self, max_rows: int) -> pa.RecordBatch:
        """Up to max_rows generated rows not handed to a scorer within `scoring_lease_s`."""
        self._evict_stale()
        now, lease_s = time.monotonic(), self.cfg.scoring_lease_s
        pick = []
        for sid in self._unscored:
            if len(pick) >= max_rows:
                break
            t = self._scoring_lease.get(sid)
            if t is None or now - t > lease_s:
                pick.append(sid)
        for sid in pick:
            self._scoring_lease[sid] = now
        if not pick:
            return pa.RecordBatch.from_pylist([], schema=SCHEMA)
        return take_rows(self._data, [(self._rows[s].seg, self._rows[s].pos) for s in pick])

    @_locked
    def set_scores(self, sample_ids: Sequence[str], old_logprobs, scorer_version: int,
                   ref_logprobs=None) -> int:
        """Record dense log-probs (len = response_len each); returns the number of rows scored.

        Ids that are unknown, already scored or no longer live are ignored (counted in
        stats()["score_ignored_rows"]), so a retried or late answer is harmless.
        """
        n = len(sample_ids)
        old = _lp_array(old_logprobs, n)
        ref = _lp_array(ref_logprobs, n) if ref_logprobs is not None else None
        keep = [(r := self._rows.get(s)) is not None and r.state == State.GENERATED
                for s in sample_ids]
        self.metrics["score_ignored_rows"] += n - sum(keep)
        if not any(keep):
            return 0
        mask = pa.array(keep)
        ids = [s for s, k in zip(sample_ids, keep) if k]
        old = old.filter(mask)
        ref = ref.filter(mask) if ref is not None else None
        want = np.array([self._rows[s].resp_len for s in ids])
        for name, arr in (("old_logprobs", old), ("ref_logprobs", ref)):
            if arr is None:
                continue
            got = pc.list_value_length(arr).fill_null(-1).to_numpy(zero_copy_only=False)
            bad = np.nonzero(got != want)[0]
            if bad.size:
                raise ValueError(f"set_scores: {name} length != response_len for sample_ids "
                                 f"{[ids[i] for i in bad[:5]]}")
        batch = log_batch(ids, State.SCORED, old, ref, scorer_version)
        self._apply_log(batch, self._write("log", batch))
        self.metrics["scored_rows"] += len(ids)
        return len(ids)

    # ---- learner -----------------------------------------------------------------------
    @_locked
    def sample_batch(self, num_groups: int, learner_version: int) -> pa.RecordBatch | None:
        """The oldest `num_groups` whole, scored, fresh groups, leased until mark_consumed.

        Returns None (nothing leased) while fewer groups are ready. Stale groups are dropped
        or requeued first. With PODS on, each group of n > m rows is cut to the m rows of
        maximal reward variance; the others are dropped when the group is consumed.
        """
        self._learner_version = int(learner_version)
        self._evict_stale()
        ready = []
        for g in self._groups.values():
            if g.ready(self.cfg.group_size):
                ready.append(g)
                if len(ready) == num_groups:
                    break
        if len(ready) < num_groups or num_groups <= 0:
            return None
        chosen: list[str] = []
        pods = self.cfg.pods
        for g in ready:
            sids = list(g.rows)
            extra: list[str] = []
            if pods.enabled and len(sids) > pods.keep:
                keep = max_variance_subset([self._rows[s].reward for s in sids], pods.keep)
                kept_set = set(keep.tolist())
                extra = [s for i, s in enumerate(sids) if i not in kept_set]
                sids = [sids[i] for i in keep]
            g.leased = True
            self._train_lease[g.gid] = (set(sids), extra)
            chosen.extend(sids)
        batch = self._gather_scored(chosen)
        lag = self._learner_version - np.array([self._rows[s].version for s in chosen])
        self.metrics["sampled_groups"] += len(ready)
        self.metrics["sampled_rows"] += len(chosen)
        self.metrics["last_batch_staleness_mean"] = float(lag.mean())
        self.metrics["last_batch_staleness_max"] = float(lag.max())
        return batch

    @_locked
    def mark_consumed(self, sample_ids: Sequence[str]) -> int:
        """Durably retire trained-on rows; returns how many were live (others are ignored).

        When every kept row of a PODS-cut group is consumed, its discarded rows are dropped
        in the same write.
        """
        ids = list(dict.fromkeys(s for s in sample_ids
                                 if (r := self._rows.get(s)) is not None and r.state in _LIVE))
        if not ids:
            return 0
        states = [State.CONSUMED] * len(ids)
        for gid in dict.fromkeys(self._rows[s].group for s in ids):
            lease = self._train_lease.get(gid)
            if lease is None:
                continue
            lease[0].difference_update(ids)
            if not lease[0]:
                extra = [s for s in lease[1] if s in self._rows]
                ids += extra
                states += [State.DROPPED] * len(extra)
                self.metrics["pods_dropped_rows"] += len(extra)
        batch = log_batch(ids, states)
        self._apply_log(batch, self._write("log", batch))
        self.metrics["consumed_rows"] += states.count(State.CONSUMED)
        return states.count(State.CONSUMED)

    @_locked
    def release(self, sample_ids: Sequence[str]) -> int:
        """Give back leases (a failed train step or scorer): rows are offered again.

        Returns the number of training groups released.
        """
        released = 0
        for s in sample_ids:
            self._scoring_lease.pop(s, None)
            r = self._rows.get(s)
            if r is not None and self._train_lease.pop(r.group, None) is not None:
                self._groups[r.group].leased = False
                released += 1
        self.metrics["released_groups"] += released
        return released

    @_locked
    def take_requeued(self) -> list[int]:
        """prompt_idx of each stale group waiting for regeneration (requeue policy), once."""
        if not self._requeued:
            return []
        prompts = [p for p, _ in self._requeued.values()]
        ids = [s for _, sids in self._requeued.values() for s in sids]
        batch = log_batch(ids, State.DROPPED)
        self._apply_log(batch, self._write("log", batch))
        return prompts

    @_locked
    def stats(self) -> dict:
        """Counters since start (see self.metrics) plus current gauges."""
        states = [r.state for r in self._rows.values()]
        out = dict(self.metrics)
        out.update(
            capacity=self.cfg.capacity, live_rows=self._live,
            fill_fraction=self._live / self.cfg.capacity,
            generated_rows=states.count(State.GENERATED), scored_rows_live=states.count(State.SCORED),
            scoring_leased_rows=len(self._scoring_lease),
            ready_groups=sum(g.ready(self.cfg.group_size) for g in self._groups.values()),
            train_leased_groups=len(self._train_lease),
            requeue_pending_groups=len(self._requeued),
            memory_bytes=sum(b.nbytes for b in self._data.values())
            + sum(b.nbytes for b in self._scores.values()),
            segments_on_disk=len(self._store.files) if self._store else 0,
            disk_bytes=self._store.disk_bytes() if self._store else 0,
            quarantined_segments=len(self._store.quarantined) if self._store else 0,
            root_existed=bool(self._store and self._store.existed),
        )
        return out

    @_locked
    def snapshot(self, dest: str) -> int:
        """Copy the durable state into the empty directory ``dest`` (a run checkpoint); returns
        the number of segment files. Leases are not part of it: restored, those rows are offered
        again, as after a crash."""
        if self._store is None:
            raise ValueError("snapshot needs a durable buffer: set buffer.root")
        return self._store.export(dest)

    @_locked
    def restore(self, src: str) -> int:
        """Load a ``snapshot`` into this empty, durable buffer: the segments are copied into the
        root and replayed by the same recovery code as after a restart. Returns the live rows."""
        if self._store is None:
            raise ValueError("restore needs a durable buffer: set buffer.root")
        if self._rows or self._store.files:
            raise ValueError(f"restore into a buffer that already holds data ({self._store.root}): "
                             "point buffer.root at an empty directory")
        self._store.import_segments(src)
        self._recover()
        return self._live

    def live_sample_ids(self) -> list[str]:
        """Ids of rows not yet consumed or dropped (generated or scored), oldest first."""
        with self._lock:
            return [s for s, r in self._rows.items() if r.state in _LIVE]

    def quarantined(self) -> list[str]:
        """One message per segment moved to quarantine/ during recovery (names the file)."""
        return [str(e) for e in self._store.quarantined] if self._store else []

    # ---- internals ---------------------------------------------------------------------
    def _write(self, kind: str, batch: pa.RecordBatch) -> int:
        if self._store is not None:
            return self._store.write(kind, batch)
        self._mem_seq += 1
        return self._mem_seq

    def _recover(self) -> None:
        expected = {"data": SCHEMA, "log": LOG_SCHEMA}
        for seg, batch in self._store.scan():
            batch = upgrade(batch, expected[seg.kind])   # older segments: added columns as nulls
            if batch is None:
                self._store.files.pop(seg.seq, None)
                self._store.quarantine(seg.path, f"schema differs from buffer.schema ({seg.kind})")
                continue
            if seg.kind == "data":
                self._apply_data(batch, seg.seq)
            else:
                self._apply_log(batch, seg.seq)
        self._mem_seq = self._store.next_seq
        self.metrics["recovered_rows"] = self._live

    def _apply_data(self, batch: pa.RecordBatch, seq: int) -> None:
        cols = [batch.column(c).to_pylist() for c in
                ("sample_id", "group_id", "prompt_idx", "policy_version", "reward", "response_len")]
        added = 0
        for pos, (sid, gid, pidx, ver, rew, rlen) in enumerate(zip(*cols)):
            if sid in self._rows or sid in self._recent:
                continue            # duplicate (recovery after a retried append)
            self._rows[sid] = Row(sid, seq, pos, gid, pidx, ver, rew, rlen)
            g = self._groups.get(gid)
            if g is None:
                g = self._groups[gid] = Group(gid, pidx, ver)
            g.rows[sid] = None
            g.version = min(g.version, ver)
            self._unscored[sid] = None
            added += 1
        self._live += added
        self._seg_live[seq] = added
        self._data[seq] = batch
        if not added:
            self._dead_segs.append(seq)
            self._collect()

    def _apply_log(self, batch: pa.RecordBatch, seq: int) -> None:
        sids = batch.column("sample_id").to_pylist()
        states = [STATE_BY_LABEL[s] for s in batch.column("state").to_pylist()]
        refs: set[int] = set()
        if State.SCORED in states:
            self._scores[seq] = batch
            self._score_live[seq] = 0
        for pos, (sid, new) in enumerate(zip(sids, states)):
            row = self._rows.get(sid)
            if row is None:
                continue            # its data segment is gone (retired or quarantined)
            refs.add(row.seg)
            if new > row.state:
                self._transition(row, new, (seq, pos))
        self._log_refs[seq] = refs
        for s in refs:
            self._seg_logs.setdefault(s, set()).add(seq)
        if seq in self._scores and not self._score_live[seq]:
            del self._scores[seq], self._score_live[seq]
        self._collect(extra_logs=[seq] if not refs else [])

    def _transition(self, row: Row, new: State, score_ref: tuple[int, int]) -> None:
        old, sid = row.state, row.sid
        g = self._groups.get(row.group)
        if old == State.GENERATED:
            self._unscored.pop(sid, None)
            self._scoring_lease.pop(sid, None)
        if old == State.SCORED and g is not None:
            g.n_scored -= 1
        if old in _LIVE and new not in _LIVE:
            self._live -= 1
        row.state = new
        if new == State.SCORED:
            row.score = score_ref
            self._score_live[score_ref[0]] += 1
            if g is not None:
                g.n_scored += 1
        elif new == State.REQUEUED:
            if g is not None:       # the whole group leaves together; its rows pin the segment
                self._groups.pop(row.group)
                self._train_lease.pop(row.group, None)
            self._requeued.setdefault(row.group, (row.prompt_idx, []))[1].append(sid)
        else:                       # consumed / dropped: terminal
            self._retire(row, g)

    def _retire(self, row: Row, g: Group | None) -> None:
        del self._rows[row.sid]
        self._recent.add(row.sid)
        if g is not None:
            del g.rows[row.sid]
            if not g.rows:
                del self._groups[row.group]
                self._train_lease.pop(row.group, None)
        req = self._requeued.get(row.group)
        if req is not None and row.sid in req[1]:
            req[1].remove(row.sid)
            if not req[1]:
                del self._requeued[row.group]
        if row.score is not None:
            key = row.score[0]
            self._score_live[key] -= 1
            if not self._score_live[key]:
                del self._scores[key], self._score_live[key]
        self._seg_live[row.seg] -= 1
        if not self._seg_live[row.seg]:
            self._dead_segs.append(row.seg)

    def _collect(self, extra_logs: Sequence[int] = ()) -> None:
        """Delete fully retired data segments, then logs that only mention deleted ones."""
        dead, self._dead_segs = self._dead_segs, []
        for seq in dead:
            del self._data[seq], self._seg_live[seq]
        dead_logs = list(extra_logs)
        for seq in dead:
            for lg in self._seg_logs.pop(seq, ()):
                refs = self._log_refs[lg]
                refs.discard(seq)
                if not refs:
                    dead_logs.append(lg)
        for lg in dead_logs:
            self._log_refs.pop(lg, None)
        if self._store is not None:
            self._store.delete(dead)           # data first: a log must never outlive its rows
            self._store.delete(dead_logs)

    def _evict_stale(self) -> None:
        if self._learner_version is None:
            return
        floor = self._learner_version - self.cfg.max_staleness
        stale = [g for g in self._groups.values() if g.version < floor and not g.leased]
        if not stale:
            return
        requeue = self.cfg.stale_policy == StalePolicy.REQUEUE
        ids = [s for g in stale for s in g.rows]
        batch = log_batch(ids, State.REQUEUED if requeue else State.DROPPED)
        self._apply_log(batch, self._write("log", batch))
        kind = "requeued" if requeue else "stale_dropped"
        self.metrics[f"{kind}_groups"] += len(stale)
        self.metrics[f"{kind}_rows"] += len(ids)

    def _gather_scored(self, sids: list[str]) -> pa.RecordBatch:
        """Data rows with the scoring columns filled from their score logs."""
        rows = [self._rows[s] for s in sids]
        data = take_rows(self._data, [(r.seg, r.pos) for r in rows])
        sc = take_rows(self._scores, [r.score for r in rows])
        for name in ("old_logprobs", "ref_logprobs", "scorer_version"):
            data = data.set_column(SCHEMA.get_field_index(name), SCHEMA.field(name),
                                   sc.column(name))
        state = pa.array([State.SCORED.label] * len(rows), pa.string())
        return data.set_column(SCHEMA.get_field_index("state"), SCHEMA.field("state"), state)
