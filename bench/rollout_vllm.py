"""Rollout throughput and KV memory: vLLM dense and sliding-window vs native dense and streaming.

    python bench/rollout_vllm.py [--quick] [--model DIR] [--batch 32] [--gen-len 256]
                                 [--prompt-len 32] [--budget-frac 0.25 0.5] [--out rows.jsonl]

One JSON row per (engine, policy, budget_frac) on stdout (and appended to --out):
``model, engine, policy, budget_frac, budget, gen_len, prompt_len, batch, tok_per_s, peak_kv_bytes,
kept_ratio, time_s``. ``budget`` = budget_frac * (prompt_len + gen_len) tokens per sequence; vLLM's
``streaming`` is a sliding window of ``budget`` tokens (no sinks), native ``streaming`` keeps 4 sinks
+ recent tokens, compressing every ``budget // 4`` steps. ``peak_kv_bytes`` is the engine's
``last_stats["peak_kv_bytes"]``: native = sum over sequences of each one's peak; vLLM = most KV bytes
held by all running sequences at once, measured from vLLM's KV blocks (block-granular). Native rows
run first, then vLLM in the same process (vLLM then owns the thread settings). Greedy decoding with
``ignore_eos`` semantics (no stop tokens), so every sequence generates ``gen_len`` tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

import torch  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / ".cache" / "models" / "tiny-base"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF model dir (default: tiny-base, else random)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--budget-frac", type=float, nargs="+", default=[0.25])
    p.add_argument("--block-size", type=int, default=32, help="vLLM KV block size (tokens)")
    p.add_argument("--kv-cache-mib", type=int, default=64)
    p.add_argument("--engines", nargs="+", default=["native", "vllm"])
    p.add_argument("--quick", action="store_true", help="batch 8, gen-len 128")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.batch, a.gen_len = 8, 128
    return a


def model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    if (DEFAULT_MODEL / "config.json").is_file():
        return DEFAULT_MODEL
    from actors.vllm.testing import build_model

    out = Path(tempfile.mkdtemp(prefix="bench_vllm_")) / "random-qwen2"
    return build_model(out, hidden=128, layers=4, heads=4, kv_heads=2, init_std=0.05)


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(4, vocab, (length - 1,), generator=g).tolist() for _ in range(n)]


def run(engine, ps, gen_len: int) -> dict:
    from actors.engine import SamplingParams

    engine.generate(ps[:2], SamplingParams(max_new_tokens=8, temperature=0.0))   # warm-up
    params = SamplingParams(max_new_tokens=gen_len, temperature=0.0)
    t0 = time.perf_counter()
    outs = engine.generate(ps, params)
    dt = time.perf_counter() - t0
    toks = sum(len(o.response_ids) for o in outs)
    return {"tok_per_s": round(toks / dt, 1), "time_s": round(dt, 3),
            "peak_kv_bytes": int(engine.last_stats["peak_kv_bytes"]),
            "kept_ratio": round(sum(o.kept_ratio for o in outs) / len(outs), 4)}


def configs(a):
    from actors.config import KVConfig

    total = a.prompt_len + a.gen_len
    yield "dense", None, KVConfig(policy="dense")
    for frac in a.budget_frac:
        budget = max(8, int(frac * total))
        yield "streaming", frac, KVConfig(policy="streaming", budget=budget,
                                          compress_every=max(1, budget // 4))


def make(kind: str, path: Path, kv, a):
    if kind == "native":
        from actors.native import NativeEngine
        from common.modeling import load_model

        return NativeEngine(load_model(path), kv, batch_size=a.batch)
    from actors.vllm import VLLMEngine

    return VLLMEngine(path, kv, batch_size=a.batch, kv_cache_bytes=a.kv_cache_mib << 20,
                      block_size=a.block_size, max_model_len=a.prompt_len + a.gen_len + 8)


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    torch.set_num_threads(1)
    path = model_dir(a.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(path)).vocab_size
    ps = prompts(a.batch, a.prompt_len, vocab)
    rows = []
    for kind in a.engines:          # vLLM last: it takes over the process's thread settings
        for policy, frac, kv in configs(a):
            engine = make(kind, path, kv, a)
            row = {"model": path.name, "engine": kind, "policy": policy, "budget_frac": frac,
                   "budget": None if frac is None else kv.budget, "gen_len": a.gen_len,
                   "prompt_len": a.prompt_len, "batch": a.batch, **run(engine, ps, a.gen_len)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            del engine
    return rows


if __name__ == "__main__":
    main()
