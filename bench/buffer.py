"""Replay-buffer benchmark: insert / score / batch-sample throughput and bytes per sample.

Rows are realistic rollouts (prompt 128-512 tokens, total 1-4k tokens, groups of 8) given as
python lists, exactly as RolloutActor.rollout returns them. Variants, all in the same run:
  list_of_dicts     baseline: a python list of the row dicts; sampling pads with a row loop
  arrow_memory      ReplayBuffer without a root (no persistence)
  arrow_disk        ReplayBuffer persisted, fsync=False (atomic against process crashes)
  arrow_disk_fsync  ReplayBuffer persisted, fsync=True (durable against power loss)
  arrow_memory_np   as arrow_memory, but the rows carry int32/float32 numpy arrays, not lists
                    (what a rollout actor could send: Arrow converts them without a per-token loop)
Phases: insert = append (16 rows per call); score = pending_scoring + set_scores;
sample = sample_batch(4 groups) + to_tensors + mark_consumed until empty.

    python bench/buffer.py [--quick] [--json PATH] [--dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

# Run as a script, this file's folder leads sys.path and `import buffer` would find this very
# module (bench/buffer.py) instead of the buffer package: drop that entry first.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.modules.pop("buffer", None) if __name__ == "__main__" else None

from buffer import BufferConfig, ReplayBuffer
from buffer.synth import synthetic_rows
from buffer.tensors import to_tensors

COLUMNS = ("variant", "rows", "tokens_per_sample", "insert_samples_per_s", "score_samples_per_s",
           "sample_samples_per_s", "mem_bytes_per_sample", "disk_bytes_per_sample", "recover_s")
GROUP, GROUPS_PER_SAMPLE, ROWS_PER_APPEND = 8, 4, 16


def make_rows(n_groups: int, seed: int = 0) -> tuple[list[dict], dict[str, list[float]]]:
    rows = synthetic_rows(n_groups, GROUP, prompt_len=(128, 512), response_len=(768, 3584),
                          seed=seed)
    rng = np.random.default_rng(seed + 1)
    scores = {r["sample_id"]: (-rng.random(len(r["response_ids"]), dtype=np.float32)).tolist()
              for r in rows}
    return rows, scores


def py_size(obj) -> int:
    """Deep size of dicts/lists of python scalars (what a list-of-dicts buffer holds)."""
    if isinstance(obj, dict):
        return sys.getsizeof(obj) + sum(py_size(k) + py_size(v) for k, v in obj.items())
    if isinstance(obj, list):
        return sys.getsizeof(obj) + sum(sys.getsizeof(x) for x in obj)
    return sys.getsizeof(obj)


def run_baseline(rows, scores) -> dict:
    t0 = time.perf_counter()
    store: list[dict] = []
    for i in range(0, len(rows), ROWS_PER_APPEND):
        store.extend(dict(r) for r in rows[i:i + ROWS_PER_APPEND])
    t1 = time.perf_counter()
    by_id = {r["sample_id"]: r for r in store}
    for sid, lp in scores.items():
        by_id[sid]["old_logprobs"] = lp
    t2 = time.perf_counter()
    mem = sum(py_size(r) for r in store) / len(store)
    groups: dict[str, list[dict]] = {}
    for r in store:
        groups.setdefault(r["group_id"], []).append(r)
    order = list(groups)
    while order:
        batch = [r for g in order[:GROUPS_PER_SAMPLE] for r in groups.pop(g)]
        del order[:GROUPS_PER_SAMPLE]
        pad_rows_loop(batch)
    t3 = time.perf_counter()
    n = len(rows)
    return dict(insert_samples_per_s=n / (t1 - t0), score_samples_per_s=n / (t2 - t1),
                sample_samples_per_s=n / (t3 - t2), mem_bytes_per_sample=mem,
                disk_bytes_per_sample=0.0, recover_s=0.0)


def pad_rows_loop(batch: list[dict]) -> dict:
    """The straightforward per-row padding a list-of-dicts buffer would do."""
    t = max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in batch)
    ids = torch.zeros(len(batch), t, dtype=torch.int64)
    slp, olp = torch.zeros(len(batch), t), torch.zeros(len(batch), t)
    mask = torch.zeros(len(batch), t, dtype=torch.int64)
    for i, r in enumerate(batch):
        p, n = len(r["prompt_ids"]), len(r["prompt_ids"]) + len(r["response_ids"])
        ids[i, :n] = torch.tensor(r["prompt_ids"] + r["response_ids"])
        slp[i, p:n] = torch.tensor(r["sampler_logprobs"])
        olp[i, p:n] = torch.tensor(r["old_logprobs"])
        mask[i, :n] = 1
    return dict(input_ids=ids, sampler_logprobs=slp, old_logprobs=olp, attention_mask=mask)


def run_buffer(rows, scores, root: str | None, fsync: bool) -> dict:
    cfg = BufferConfig(capacity=len(rows), fsync=fsync, max_staleness=10)
    buf = ReplayBuffer(cfg, root)
    t0 = time.perf_counter()
    for i in range(0, len(rows), ROWS_PER_APPEND):
        buf.append(rows[i:i + ROWS_PER_APPEND])
    t1 = time.perf_counter()
    while True:
        p = buf.pending_scoring(64)
        if not p.num_rows:
            break
        ids = p.column("sample_id").to_pylist()
        buf.set_scores(ids, [scores[s] for s in ids], 1)
    t2 = time.perf_counter()
    st = buf.stats()
    mem, disk = st["memory_bytes"] / len(rows), st["disk_bytes"] / len(rows)
    recover = 0.0
    if root is not None:
        r0 = time.perf_counter()
        buf = ReplayBuffer(cfg, root)          # a restart: replay every segment
        recover = time.perf_counter() - r0
        assert buf.stats()["live_rows"] == len(rows)
    t3 = time.perf_counter()
    while (b := buf.sample_batch(GROUPS_PER_SAMPLE, 0)) is not None:
        to_tensors(b, pad_id=0)
        buf.mark_consumed(b.column("sample_id").to_pylist())
    t4 = time.perf_counter()
    assert buf.stats()["live_rows"] == 0
    n = len(rows)
    return dict(insert_samples_per_s=n / (t1 - t0), score_samples_per_s=n / (t2 - t1),
                sample_samples_per_s=n / (t4 - t3), mem_bytes_per_sample=mem,
                disk_bytes_per_sample=disk, recover_s=recover)


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3f}"
    return str(v)


def run_variant(name: str, rows, np_rows, scores, bench_dir: str | None) -> dict:
    if name == "list_of_dicts":
        return run_baseline(rows, scores)
    if name == "arrow_memory_np":
        return run_buffer(np_rows, scores, None, False)
    if name == "arrow_memory":
        return run_buffer(rows, scores, None, False)
    root = tempfile.mkdtemp(prefix="bench-buffer-", dir=bench_dir)
    try:
        return run_buffer(rows, scores, root, fsync=name == "arrow_disk_fsync")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def print_table(results: list[dict]) -> None:
    widths = [max(len(c), 12) for c in COLUMNS]
    widths[0] = max(len(r["variant"]) for r in results)

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    print(line(COLUMNS))
    for r in results:
        print(line([fmt(r[c]) for c in COLUMNS]))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 groups of 8 (128 rows), ~20 s")
    ap.add_argument("--groups", type=int, default=None, help="groups of 8 rows (default 64)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs per variant; each figure is its best run (the box is shared)")
    ap.add_argument("--json", default=None, help="write one JSON object per table row here")
    ap.add_argument("--dir", default=None, help="where the persisted variants write segments")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    n_groups = args.groups or (16 if args.quick else 64)
    rows, scores = make_rows(n_groups)
    tokens = float(np.mean([len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]))
    np_rows = [dict(r, prompt_ids=np.asarray(r["prompt_ids"], np.int32),
                    response_ids=np.asarray(r["response_ids"], np.int32),
                    sampler_logprobs=np.asarray(r["sampler_logprobs"], np.float32)) for r in rows]
    # First-call costs (torch kernels, allocator) stay out of the timings.
    warm = rows[:GROUP * GROUPS_PER_SAMPLE]
    pad_rows_loop([dict(r, old_logprobs=scores[r["sample_id"]]) for r in warm])
    run_buffer(warm, scores, None, False)
    results = []
    for name in ("list_of_dicts", "arrow_memory", "arrow_disk", "arrow_disk_fsync",
                 "arrow_memory_np"):
        runs = [run_variant(name, rows, np_rows, scores, args.dir) for _ in range(args.repeats)]
        best = {k: (min if k == "recover_s" else max)(r[k] for r in runs) for k in runs[0]}
        for k in ("mem_bytes_per_sample", "disk_bytes_per_sample"):
            best[k] = runs[0][k]                       # sizes do not vary between runs
        results.append(dict(variant=name, rows=len(rows), tokens_per_sample=tokens, **best))
    print_table(results)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    return results


if __name__ == "__main__":
    main()
