"""The vLLM rows of ``bench/rollout.py`` (its docstring documents them): same-batch rows for dense
and every policy, the equal-pool rows, and issue 17's bars over them.

A policy the installed engine cannot run raises at construction (``ConfigError`` from
``actors.vllm`` for h2o/snapkv/rkv until score-based eviction lands); ``rollout.best_of`` then
skips the row and prints why, and the bars print ``MISSING`` for it.
"""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

from actors.config import KVConfig
from actors.engine import SamplingParams

BLOCK = 32                 # KV block tokens (vLLM's CPU default is 128: too coarse at these lengths)
BAR_MODEL = "mid"          # issue 17's bars: the matmul-bound model
BAR_SPEED = 1.5            # snapkv / rkv tok/s vs vLLM dense, same batch and at equal pool bytes
BAR_CONCURRENT = 3.0       # requests running at once vs vLLM dense at equal pool bytes
BAR_POLICIES = ("snapkv", "rkv")


def available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def kv_config(policy: str, frac: float | None, gen_len: int, every: int) -> tuple[KVConfig, int]:
    """The row's KV config and budget (0 for dense): ``budget`` tokens = ``frac`` of the generation
    length (at least 16), compressing every ``every`` steps; no attention sinks for ``streaming``
    (vLLM's sliding window has none), the default sinks for the others."""
    budget = 0 if policy == "dense" else max(16, int(frac * gen_len))
    extra = {"sink_tokens": 0} if policy == "streaming" else {}
    return KVConfig(policy=policy, budget=max(budget, 16), compress_every=every, **extra), budget


def pool_bytes(batch: int, prompt_len: int, gen_len: int, bytes_per_token: int) -> int:
    """KV pool P that vLLM dense needs for ``batch`` sequences at full length: prompt + generation
    + one block per sequence, rounded up to whole blocks."""
    blocks = -(-(prompt_len + gen_len + BLOCK) // BLOCK)
    return batch * blocks * BLOCK * bytes_per_token


def _engine(path: Path, policy: str, frac: float | None, gen_len: int, every: int, batch: int,
            max_model_len: int, dtype: str, kv_cache_bytes: int | None = None):
    # tiny-base declares 1024 positions; like the native engine and HF, let vLLM extrapolate RoPE
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    from actors.vllm import VLLMEngine

    kv, budget = kv_config(policy, frac, gen_len, every)
    eng = VLLMEngine(path, kv, batch_size=batch, max_model_len=max_model_len, block_size=BLOCK,
                     dtype=dtype, kv_cache_bytes=kv_cache_bytes)
    return eng, budget


def _timed(eng, ps, gen_len: int, policy: str, frac: float | None, budget: int,
           every: int) -> dict:
    eng.generate(ps[:2], SamplingParams(max_new_tokens=4, seed=0))   # warm-up (kernel compile)
    t0 = time.perf_counter()
    outs = eng.generate(ps, SamplingParams(max_new_tokens=gen_len, seed=0))
    dt = time.perf_counter() - t0
    return {"engine": "vllm", "policy": policy, "budget_frac": frac or 1.0, "budget": budget,
            "compress_every": every if policy not in ("dense", "streaming") else 0,
            "tok_per_s": sum(len(o.response_ids) for o in outs) / dt,
            "peak_kv_bytes": eng.last_stats.get("peak_kv_bytes", 0),
            # the engine's KV meter: mean requests running per scheduling step (what the pool
            # sustains: vLLM admits every request whose prompt fits, then preempts), the most
            # after one step, and how many preemptions (freed to recompute later)
            "concurrent_requests": eng.last_stats["concurrent_requests"],
            "max_concurrent_requests": eng.last_stats["max_concurrent_requests"],
            "preemptions": eng.last_stats["preemptions"], "seconds": dt}


def run_vllm(path: Path, ps, gen_len: int, policy: str = "dense", frac: float | None = None,
             every: int = 128, dtype: str = "float32") -> dict | None:
    """A same-batch vLLM row: ``len(ps)`` requests, ``max_num_seqs`` = that batch, the engine's
    default KV pool (room for every sequence at full length). None without vLLM."""
    if not available():
        return None
    eng, budget = _engine(path, policy, frac, gen_len, every, len(ps),
                          len(ps[0]) + gen_len + 16, dtype)
    return _timed(eng, ps, gen_len, policy, frac, budget, every)


def run_pool(path: Path, ps, gen_len: int, policy: str, frac: float | None, every: int,
             dtype: str, pool: int, bytes_per_token: int) -> dict | None:
    """An equal-pool row: all ``len(ps)`` requests submitted at once (``max_num_seqs`` = that many)
    to an engine whose KV pool is ``pool`` bytes; vLLM's scheduler decides how many run at once."""
    if not available():
        return None
    eng, budget = _engine(path, policy, frac, gen_len, every, len(ps),
                          len(ps[0]) + gen_len + 16, dtype, kv_cache_bytes=pool)
    if eng.kv_bytes_per_token() != bytes_per_token:    # P was sized with the bench's own count
        raise RuntimeError(f"vLLM stores {eng.kv_bytes_per_token()} KV bytes per token, the "
                           f"bench sized the pool for {bytes_per_token}")
    return dict(_timed(eng, ps, gen_len, policy, frac, budget, every), pool_bytes=pool)


def _dense_of(rows: list[dict], r: dict, pool: bool) -> dict | None:
    """vLLM dense of r's model and length (at the same pool for ``pool`` rows)."""
    return next((d for d in rows if d["model"] == r["model"] and d["gen_len"] == r["gen_len"]
                 and d["engine"] == "vllm" and d["policy"] == "dense"
                 and bool(d.get("equal_pool")) == pool), None)


def pool_lines(rows: list[dict]) -> list[str]:
    """The equal-pool section: per row, requests running at once (mean over scheduling steps; the
    most after one step; preemptions) and tok/s, with ratios vs vLLM dense at the same pool."""
    out = []
    for r in rows:
        if not r.get("equal_pool"):
            continue
        d = _dense_of(rows, r, pool=True)
        ratio = "" if d is None else (
            f"  {r['concurrent_requests'] / d['concurrent_requests']:.2f}x dense's running, "
            f"{r['tok_per_s'] / d['tok_per_s']:.2f}x its tok/s")
        out.append(f"{r['model']:<5} {r['gen_len']:>6} {r['policy']:<9} {r['budget_frac']:.3f} "
                   f"pool {r['pool_bytes'] / 2**20:7.2f} MiB requests {r['batch']:>4} running "
                   f"mean {r['concurrent_requests']:6.1f} max {r['max_concurrent_requests']:>4} preempted "
                   f"{r['preemptions']:>4} {r['tok_per_s']:7.0f} tok/s{ratio}")
    return out


def bars(rows: list[dict], frac: float, length: int) -> list[tuple[str, bool | None]]:
    """Issue 17's targets as (line, passed), None where a row is missing: when this run has
    ``BAR_MODEL`` at ``length`` tokens, vLLM snapkv and rkv at budget ``frac`` >= ``BAR_SPEED`` x
    vLLM dense's tok/s at the same batch; at equal pool bytes >= ``BAR_CONCURRENT`` x its requests
    running at once (``concurrent_requests``: the mean per scheduling step) and >= ``BAR_SPEED`` x its tok/s."""
    out: list[tuple[str, bool | None]] = []
    lengths = sorted({r["gen_len"] for r in rows if r["model"] == BAR_MODEL
                      and r["gen_len"] == length})
    for gen_len in lengths:
        def find(policy, pool):
            return next((r for r in rows if r["model"] == BAR_MODEL and r["gen_len"] == gen_len
                         and r["engine"] == "vllm" and r["policy"] == policy
                         and bool(r.get("equal_pool")) == pool
                         and (policy == "dense" or abs(r["budget_frac"] - frac) < 1e-9)), None)
        tag = f"{BAR_MODEL} {gen_len} vllm"
        for pool in (False, True):
            dense = find("dense", pool)
            where = "at equal pool bytes" if pool else "same batch"
            for policy in BAR_POLICIES:
                r = find(policy, pool)
                if r is None or dense is None:
                    which = "vllm " + (policy if r is None else "dense")
                    out.append((f"{tag} {policy:<6} {where}: {which} row MISSING", None))
                    continue
                speed = r["tok_per_s"] / dense["tok_per_s"]
                out.append((f"{tag} {policy:<6} {where}: {speed:.2f}x vLLM dense tok/s "
                            f"(>= {BAR_SPEED:.1f}x)", speed >= BAR_SPEED))
                if pool:
                    conc = r["concurrent_requests"] / dense["concurrent_requests"]
                    out.append((f"{tag} {policy:<6} {where}: {conc:.2f}x vLLM dense's requests "
                                f"running at once (mean {r['concurrent_requests']:.1f} vs "
                                f"{dense['concurrent_requests']:.1f}; >= {BAR_CONCURRENT:.0f}x)",
                                conc >= BAR_CONCURRENT))
    return out
