"""Where a CUDA decode step's time goes: wall per step vs GPU busy time, and the top kernels.

    python bench/decode_cuda.py                               # Qwen2.5-1.5B shape, batch 64
    python bench/decode_cuda.py --policies dense,rkv --modes graphs,eager --json out.json

``bench/decode_profile.py`` counts syncs and ops on the CPU (the proxy); this measures the real
thing on a GPU. Per (policy, step mode): a warm-up call of the same shape (the CUDA graphs are
captured and the slot pool kept, as in a training run's later steps), a timed call
(``ms_per_step`` = wall / decode steps, CUDA synced), then a ``torch.profiler`` call over
``--trace-len`` tokens: ``gpu_ms_per_step`` (summed kernel time / steps) and ``busy`` (GPU time /
wall of the profiled call: ~1 means the GPU is the bound, well below 1 means the host is), and the
``--top`` kernels by total GPU time. Random-weight model (``common.testmodels.random_model``),
random prompts, no stop tokens, so every row decodes ``--gen-len`` tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from actors.engine import SamplingParams  # noqa: E402
from actors.native import NativeEngine  # noqa: E402
from bench.rollout_gpu import SHAPES, bench_kv  # noqa: E402
from bench.rollout_rows import prompts  # noqa: E402


def _sync() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def _engine(model, policy: str, mode: str, args) -> NativeEngine:
    return NativeEngine(model, bench_kv(policy, args), batch_size=args.batch, step=mode)


def measure(model, policy: str, mode: str, args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    eng = _engine(model, policy, mode, args)
    ps = prompts(args.batch, args.prompt_len, model.config.vocab_size)
    params = SamplingParams(max_new_tokens=args.gen_len, seed=0)
    eng.generate(ps, params)                                   # capture, keep the pool
    t0 = _sync()
    eng.generate(ps, params)
    wall = _sync() - t0
    short = SamplingParams(max_new_tokens=args.trace_len, seed=0)
    eng.generate(ps, short)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = _sync()
        eng.generate(ps, short)
        traced = _sync() - t0
    averages = prof.key_averages()          # one aggregation of the trace, read twice below
    kernels = sorted((e for e in averages if e.device_time_total > 0
                      and e.device_type.name != "CPU"), key=lambda e: -e.device_time_total)
    gpu_us = sum(e.device_time_total for e in kernels)
    cpu_ops = sorted((e for e in averages if e.key.startswith("aten::")),
                     key=lambda e: -e.self_cpu_time_total)
    return {"policy": policy, "mode": eng.stepper.resolve(eng.device), "batch": args.batch,
            "gen_len": args.gen_len, "ms_per_step": 1e3 * wall / args.gen_len,
            "tok_per_s": args.batch * args.gen_len / wall,
            "traced_ms_per_step": 1e3 * traced / args.trace_len,
            "gpu_ms_per_step": gpu_us / 1e3 / args.trace_len, "busy": gpu_us / 1e6 / traced,
            "top_kernels": [{"name": e.key[:90], "calls": e.count,
                             "ms_per_step": e.device_time_total / 1e3 / args.trace_len}
                            for e in kernels[:args.top]],
            "top_host_ops": [{"name": e.key, "calls": e.count,
                              "ms_per_step": e.self_cpu_time_total / 1e3 / args.trace_len}
                             for e in cpu_ops[:args.top]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/decode_cuda.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--policies", default="dense,rkv")
    ap.add_argument("--modes", default="graphs,eager")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=1024)
    ap.add_argument("--trace-len", type=int, default=64)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--every", type=int, default=128)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a smoke run on the tiny model (no kernels; the CPU proxy is "
                         "bench/decode_profile.py)")
    args = ap.parse_args(argv)
    from common.testmodels import random_model

    if args.device == "cpu":
        model = random_model("tiny")
    elif not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    else:
        model = random_model("qwen2.5", "cuda", torch.bfloat16, **SHAPES[args.shape])
    rows = []
    for policy in args.policies.split(","):
        for mode in args.modes.split(","):
            r = measure(model, policy, mode, args)
            rows.append(r)
            print(f"\n## {policy} {r['mode']}: {r['ms_per_step']:.2f} ms/step "
                  f"({r['tok_per_s']:.0f} tok/s); traced {r['traced_ms_per_step']:.2f} ms/step, "
                  f"GPU {r['gpu_ms_per_step']:.2f} ms/step, busy {r['busy']:.2f}", flush=True)
            for k in r["top_kernels"]:
                print(f"  gpu  {k['ms_per_step']:7.3f} ms/step {k['calls']:6d}x  {k['name']}")
            for k in r["top_host_ops"][:8]:
                print(f"  host {k['ms_per_step']:7.3f} ms/step {k['calls']:6d}x  {k['name']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
