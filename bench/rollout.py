"""Rollout engine benchmark: tokens/s and peak KV bytes, dense vs each KV policy, with peers.

    python bench/rollout.py --quick                 # tiny model, 256 and 1024 tokens, 25% budget
    python bench/rollout.py --json runs/bench_rollout.json
    python bench/rollout.py --models tiny,mid --lengths 512,2048,8192 --batch 16 --dtype bfloat16

Rows: the native engine dense and with every policy at budgets {12.5%, 25%, 50%} of the generation
length (``compress_every`` = 128, the paper's N), and the peers in the same run: HF ``generate``
with a static cache (and with its default dynamic cache), and where vLLM is installed vLLM dense
and every policy of ``--policies`` at every budget (``bench/rollout_vllm.py``: 32-token blocks,
``compress_every`` = N, no attention sinks for ``streaming``, which vLLM runs as its sliding
window). A policy the installed vLLM engine refuses (today h2o, snapkv and rkv: ``ConfigError``)
is skipped with a ``# row N skipped`` line. ``--dtype`` (float32 or bfloat16, in every JSON row's
``dtype``) is the dtype every engine runs the model in (native and HF load it so, vLLM gets
``dtype=``).
Every row generates exactly ``gen_len`` tokens per sequence (no stop tokens) from ``batch`` random
prompts of ``prompt_len`` tokens, temperature 1. ``tok_per_s`` = generated tokens / wall time of
the call (prefill included), best of ``--repeat`` round-robin rounds. ``attn_vs_dense``: KV slots
a native decode step reads per row, on average, against dense's (``last_stats["attended_slots"]``);
its inverse is the speed-up sparse would get if attention were all of a decode step.
``peak_kv_bytes``: native = the preallocated K/V tensors of the batch (what is actually held:
``batch * cap * bytes/token`` with cap = budget + N for sparse policies); HF static = its static
cache (``batch * (prompt_len + gen_len)`` tokens); HF dynamic = the final cache size; vLLM = its
measured KV blocks. Ratios ``speed_vs_dense`` and ``kv_vs_dense`` are against dense-native of the
same model and length, in the same run (every row, the equal-pool ones too). At 2048+ tokens the
25%-budget policies are also run with ``compress_every`` = ``--extra-every`` (64) where N = 128
cannot meet the KV bar: the stored tokens are (budget + N) / (prompt + gen_len) = 0.31 of dense at
2048 by construction (0.265 at 8192).

Equal KV memory (``--equal-memory``, on by default; ``--quick`` has no length that qualifies): at
2048+ tokens each sparse policy at the 25% budget (N = ``--every``) is also run at the largest batch
whose preallocated K/V bytes (the engine's own accounting: rows * capacity * bytes/token, capacity =
budget + N) fit in dense-native's at the bench batch B. These rows (``memory_matched: true``, their
own ``batch``) are printed in a separate section, "same KV memory as dense-native at batch B", with
``speed_vs_dense`` / ``kv_vs_dense`` against dense-native at batch B. This is the paper's "memory
wall" comparison: more sequences in the same KV memory. It is reported as INFO, never as the bar.

Equal KV pool for vLLM (``--equal-pool``, on by default, at gen_len >= ``--pool-min-len`` (2048)
where vLLM rows run; ``--quick``: at 256 tokens with a pool of 2 sequences and 8 requests): P =
the KV pool vLLM dense needs for ``--pool-batch`` (default B) sequences at full length,
``B * (prompt_len + gen_len + block)`` tokens rounded up to blocks, times the model's KV bytes per
token (checked against ``VLLMEngine.kv_bytes_per_token``). vLLM dense and each policy at the 25%
budget get ``kv_cache_bytes = P`` and ``--pool-requests`` (default 4 * B) prompts at once
(``max_num_seqs`` = that many); the scheduler decides how many run. These rows (``equal_pool:
true``, ``batch`` = the requests, ``pool_bytes`` = P) are printed in their own section with
``concurrent_requests`` (``VLLMEngine.last_stats``: the mean number of requests running per
scheduling step), ``max_concurrent_requests`` (the most after one step) and ``preemptions``
(requests vLLM froze and recomputed when the pool ran out), and ratios vs vLLM dense at the same
pool. The most after one step is not what the pool holds: vLLM admits every request whose prompt
fits, then preempts as they grow, so dense reaches ``--pool-requests`` too; the bar reads the
mean. Other rows
have ``equal_pool: false`` and null in these columns (native and HF rows always).

After the table, "bars" prints PASS/FAIL for issue 3's targets: at 2048+ tokens and a 25% budget
every sparse policy runs >= 2x dense-native's tokens/s (same batch) with <= 30% of its KV bytes, and
dense-native runs at least as fast as HF ``generate`` with a static cache; then issue 17's, on the
``mid`` model at 2048 tokens and a 25% budget: vLLM snapkv and rkv >= 1.5x vLLM dense's tokens/s
at the same batch, and at equal pool bytes >= 3x its requests running at once (mean) and >= 1.5x
its tokens/s; a row the run lacks prints MISSING (never PASS). Then one INFO line per
equal-memory row ("sparse at equal KV memory: X.XXx dense tokens/s"), which no bar judges.

``--device cuda`` or ``--shape``: the GPU bench instead (``bench/rollout_gpu.py``: the native engine
at the paper's settings on public Qwen2.5 shapes with random weights, HF static in the same run).

Models: ``tiny`` = ``.cache/models/tiny-base`` when present, else a random-weight Qwen2 of the same
size class (hidden 256, 4 layers); ``mid`` = a random-weight model of the tiny model's architecture
with ~75M parameters (hidden 768, 12 layers). Timings on a shared CPU are noisy; compare ratios.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from actors.config import KVConfig  # noqa: E402
from actors.engine import SamplingParams  # noqa: E402
from actors.native import NativeEngine  # noqa: E402
from bench import rollout_vllm as rv  # noqa: E402
from bench.rollout_rows import POLICIES, kv_bytes_per_token, prompts  # noqa: E402,F401
from common.dtypes import Dtype, torch_dtype  # noqa: E402
from common.modeling import load_model  # noqa: E402

FIELDS = ("model", "engine", "policy", "budget_frac", "budget", "compress_every", "gen_len", "batch",
          "tok_per_s", "peak_kv_bytes", "speed_vs_dense", "kv_vs_dense", "attn_slots",
          "attn_vs_dense", "seconds", "params", "memory_matched", "dtype", "equal_pool",
          "concurrent_requests", "max_concurrent_requests", "preemptions", "pool_bytes")
BAR_SPEED, BAR_KV, BAR_MIN_LEN, BAR_FRAC = 2.0, 0.30, 2048, 0.25


def model_dirs(names: list[str], tmp: Path) -> dict[str, Path]:
    """Resolve model names to HF directories (random-weight ones are built in tmp)."""
    from common.testmodels import build_model

    base = ROOT / ".cache/models/tiny-base"
    out = {}
    tiny_cfg = None
    if (base / "config.json").is_file():
        out["tiny"] = base
        from transformers import AutoConfig

        from common.modeling import HF_LOAD

        tiny_cfg = AutoConfig.from_pretrained(str(base), **HF_LOAD)
    else:
        out["tiny"] = build_model(tmp / "tiny", "tiny", hidden_size=256, num_hidden_layers=4,
                                  intermediate_size=512, vocab_size=512)
    if "mid" in names:   # the base model is a Qwen2 of the "tiny" family
        vocab = tiny_cfg.vocab_size if tiny_cfg is not None else 512
        heads, kv = 12, 4
        if tiny_cfg is not None:
            ratio = tiny_cfg.num_attention_heads // tiny_cfg.num_key_value_heads
            kv = max(1, heads // ratio)
        out["mid"] = build_model(tmp / "mid", "tiny", hidden_size=768, num_hidden_layers=12,
                                 num_attention_heads=heads, num_key_value_heads=kv,
                                 vocab_size=vocab, intermediate_size=2048)
    return {n: out[n] for n in names}


def native_engine(model, gen_len: int, policy: str, frac: float | None, every: int,
                  batch: int) -> tuple[NativeEngine, int]:
    """The engine of a native row and its budget (0 for dense)."""
    budget = 0 if policy == "dense" else max(16, int(frac * gen_len))
    kv = KVConfig(policy=policy, budget=max(budget, 16), compress_every=every)
    return NativeEngine(model, kv, batch_size=batch), budget


def native_kv_bytes(model, gen_len: int, prompt_len: int, policy: str, frac: float | None,
                    every: int, batch: int) -> int:
    """K/V bytes the native engine preallocates for ``batch`` prompts of ``prompt_len`` tokens, from
    its own accounting (rows * capacity * bytes per token; what ``allocated_kv_bytes`` reports when
    all rows are admitted at once, i.e. ``batch_size`` = number of prompts)."""
    eng, _ = native_engine(model, gen_len, policy, frac, every, batch)
    return batch * eng._capacity(prompt_len, gen_len) * eng.kv_bytes_per_token()


def memory_matched_batch(model, gen_len: int, prompt_len: int, policy: str, frac: float,
                         every: int, limit_bytes: int) -> int:
    """Largest batch whose native KV bytes for ``policy`` fit in ``limit_bytes`` (0 if none)."""
    per_row = native_kv_bytes(model, gen_len, prompt_len, policy, frac, every, 1)
    b = limit_bytes // per_row
    kv = lambda n: native_kv_bytes(model, gen_len, prompt_len, policy, frac, every, n)  # noqa: E731
    while b > 0 and kv(b) > limit_bytes:
        b -= 1
    while kv(b + 1) <= limit_bytes:
        b += 1
    return b


def run_native(model, ps, gen_len: int, policy: str, frac: float | None, every: int) -> dict:
    eng, budget = native_engine(model, gen_len, policy, frac, every, len(ps))
    t0 = time.perf_counter()
    outs = eng.generate(ps, SamplingParams(max_new_tokens=gen_len, seed=0))
    dt = time.perf_counter() - t0
    toks = sum(len(o.response_ids) for o in outs)
    return {"engine": "native", "policy": policy, "budget_frac": frac or 1.0, "budget": budget,
            "compress_every": every if policy != "dense" else 0,
            "tok_per_s": toks / dt, "peak_kv_bytes": eng.last_stats["allocated_kv_bytes"],
            "attn_slots": eng.last_stats["attended_slots"], "seconds": dt}


def run_hf(model, ps, gen_len: int, cache: str) -> dict:
    ids = torch.tensor(ps)
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len,
                             min_new_tokens=gen_len, do_sample=True, top_k=0, pad_token_id=0, **kw)
    dt = time.perf_counter() - t0
    toks = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    kv = ids.shape[0] * (ids.shape[1] + gen_len) * kv_bytes_per_token(model)
    return {"engine": f"hf-{cache}", "policy": "dense", "budget_frac": 1.0, "budget": 0,
            "compress_every": 0, "tok_per_s": toks / dt, "peak_kv_bytes": kv, "seconds": dt}


def best_of(jobs, repeat: int) -> list[dict | None]:
    """Run the jobs round-robin ``repeat`` times; keep each job's fastest run (the machine is
    shared: bursts of load from other processes hit single runs, not every round)."""
    best: list[dict | None] = [None] * len(jobs)
    for _ in range(max(1, repeat)):
        for j, job in enumerate(jobs):
            try:
                r = job()
            except Exception as e:     # an optional peer (vLLM) that cannot start: skip its row
                if j == 0:
                    raise
                print(f"# row {j} skipped: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
                r = None
            if r is not None and (best[j] is None or r["tok_per_s"] > best[j]["tok_per_s"]):
                best[j] = r
    return best


def native_jobs(args, model, ps, gen_len: int) -> tuple[list, dict[int, int]]:
    """Dense-native first, every policy at every budget, the extra N, the equal-memory rows;
    returns (jobs, {job index: batch} of the equal-memory rows)."""
    vocab = model.config.vocab_size
    jobs = [lambda: run_native(model, ps, gen_len, "dense", None, args.every)]
    for frac in args.budgets:
        for policy in args.policies:
            jobs.append(lambda f=frac, p=policy: run_native(model, ps, gen_len, p, f, args.every))
    # the extra N only where N = --every cannot meet the KV bar by construction
    kv_at_n = (int(BAR_FRAC * gen_len) + args.every) / (args.prompt_len + gen_len)
    if gen_len >= BAR_MIN_LEN and args.extra_every and BAR_FRAC in args.budgets \
            and kv_at_n > BAR_KV:
        for policy in args.policies:
            jobs.append(lambda p=policy: run_native(model, ps, gen_len, p, BAR_FRAC,
                                                    args.extra_every))
    # equal KV memory: each policy at the largest batch that fits in dense's KV bytes
    matched: dict[int, int] = {}
    if args.equal_memory and gen_len >= BAR_MIN_LEN and BAR_FRAC in args.budgets:
        dense_kv = native_kv_bytes(model, gen_len, args.prompt_len, "dense", None, args.every,
                                   len(ps))
        for policy in args.policies:
            mb = memory_matched_batch(model, gen_len, args.prompt_len, policy, BAR_FRAC,
                                      args.every, dense_kv)
            if mb < 1:
                continue
            mps = prompts(mb, args.prompt_len, vocab)
            matched[len(jobs)] = mb
            jobs.append(lambda p=policy, q=mps: run_native(model, q, gen_len, p, BAR_FRAC,
                                                            args.every))
    return jobs, matched


def peer_jobs(args, model, path: Path, ps, gen_len: int, first: int) -> tuple[list, dict]:
    """HF and vLLM rows (vLLM: dense and every policy at every budget, then the equal-pool rows;
    job indices from ``first``); returns (jobs, {job index: requests} of the equal-pool rows)."""
    jobs: list = []
    if gen_len > args.peer_max_len:
        return jobs, {}
    for cache in args.hf:
        jobs.append(lambda c=cache: run_hf(model, ps, gen_len, c))
    if not args.vllm:
        return jobs, {}
    def vllm_job(policy: str, frac: float | None = None):
        return lambda: rv.run_vllm(path, ps, gen_len, policy, frac, args.every, args.dtype)

    jobs.append(vllm_job("dense"))
    jobs += [vllm_job(p, f) for f in args.budgets for p in args.policies]
    pooled: dict[int, int] = {}
    if args.equal_pool and gen_len >= args.pool_min_len and BAR_FRAC in args.budgets:
        b = args.pool_batch or len(ps)
        m = args.pool_requests or 4 * b
        pool = rv.pool_bytes(b, args.prompt_len, gen_len, kv_bytes_per_token(model))
        mps = prompts(m, args.prompt_len, model.config.vocab_size)
        for policy, frac in [("dense", None)] + [(p, BAR_FRAC) for p in args.policies]:
            pooled[first + len(jobs)] = m
            jobs.append(lambda p=policy, f=frac: rv.run_pool(
                path, mps, gen_len, p, f, args.every, args.dtype, pool, kv_bytes_per_token(model)))
    return jobs, pooled


def bench(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in model_dirs(args.models, Path(tmp)).items():
            model = load_model(path, dtype=torch_dtype(args.dtype))
            params = sum(p.numel() for p in model.parameters())
            print(f"# {name}: {model.config.model_type} hidden {model.config.hidden_size} x "
                  f"{model.config.num_hidden_layers} layers, {params / 1e6:.1f}M parameters, "
                  f"{args.dtype}", flush=True)
            run_native(model, prompts(2, 8, model.config.vocab_size), 8, "dense", None, 128)
            for gen_len in args.lengths:
                batch = args.batch if gen_len <= 2048 else (args.long_batch
                                                            or max(1, args.batch // 4))
                ps = prompts(batch, args.prompt_len, model.config.vocab_size)
                jobs, matched = native_jobs(args, model, ps, gen_len)
                peers, pooled = peer_jobs(args, model, path, ps, gen_len, len(jobs))
                found = best_of(jobs + peers, args.repeat)
                base = {"model": name, "gen_len": gen_len, "batch": batch, "params": params,
                        "dtype": args.dtype}
                rows += collect(found, base, matched, pooled)
    return rows


def collect(found: list[dict | None], base: dict, matched: dict[int, int],
            pooled: dict[int, int]) -> list[dict]:
    """Complete one length's rows (ratios vs dense-native, the bench's columns) and print them:
    the main table, then the equal-memory and equal-pool sections."""
    dense, rows = found[0], []
    for j, r in enumerate(found):
        if r is None:
            continue
        r.setdefault("attn_slots", None)
        for key in ("concurrent_requests", "max_concurrent_requests", "preemptions", "pool_bytes"):
            r.setdefault(key, None)
        r.update(base, memory_matched=j in matched, equal_pool=j in pooled,
                 speed_vs_dense=r["tok_per_s"] / dense["tok_per_s"],
                 kv_vs_dense=r["peak_kv_bytes"] / dense["peak_kv_bytes"],
                 attn_vs_dense=None if r["attn_slots"] is None
                 else r["attn_slots"] / dense["attn_slots"])
        r["batch"] = matched.get(j, pooled.get(j, r["batch"]))
        if j in matched and r["peak_kv_bytes"] > dense["peak_kv_bytes"]:   # wrong accounting
            raise RuntimeError(f"equal-memory {r['policy']} at batch {matched[j]}: "
                               f"{r['peak_kv_bytes']} KV bytes > dense's {dense['peak_kv_bytes']}")
        rows.append(r)
        if j not in matched and j not in pooled:
            print(fmt_row(r), flush=True)
    same = [r for r in rows if r["memory_matched"]]
    if same:
        print(f"# same KV memory as dense-native at batch {base['batch']} "
              f"({dense['peak_kv_bytes'] / 2**20:.2f} MiB): each policy at the largest batch that "
              f"fits; ratios vs dense-native at batch {base['batch']}", flush=True)
        for r in same:
            print(fmt_row(r), flush=True)
    lines = rv.pool_lines(rows)
    if lines:
        print(f"# vLLM at equal KV pool bytes (what dense needs for the pool batch at "
              f"{base['gen_len']} tokens): requests submitted at once; running = requests running "
              f"after a scheduling step (mean, max); ratios vs vLLM dense at the same pool",
              flush=True)
        for line in lines:
            print(line, flush=True)
    return rows


COLUMNS = (("model", 5, "{}"), ("engine", 11, "{}"), ("policy", 9, "{}"),
           ("budget_frac", 11, "{:.3f}"), ("budget", 6, "{}"), ("N", 4, "{}"), ("gen_len", 7, "{}"),
           ("batch", 5, "{}"), ("tok_per_s", 9, "{:.0f}"), ("peak_kv_MiB", 11, "{:.2f}"),
           ("speed_vs_dense", 14, "{:.2f}x"), ("kv_vs_dense", 11, "{:.3f}"),
           ("attn_vs_dense", 13, "{:.3f}"), ("seconds", 7, "{:.1f}"))
HEADER = " ".join(f"{name:>{w}}" if i > 2 else f"{name:<{w}}"
                  for i, (name, w, _) in enumerate(COLUMNS))


def fmt_row(r: dict) -> str:
    vals = dict(r, peak_kv_MiB=r["peak_kv_bytes"] / 2**20, N=r["compress_every"] or "-")
    cells = ["-" if vals[name] is None else f.format(vals[name]) for name, _, f in COLUMNS]
    return " ".join(f"{c:>{w}}" if i > 2 else f"{c:<{w}}"
                    for i, (c, (_, w, _)) in enumerate(zip(cells, COLUMNS)))


def bars(rows: list[dict]) -> list[tuple[str, bool | None]]:
    """Issue 3's targets as (line, passed), within one model and length of this run, then issue
    17's vLLM targets (``rollout_vllm.bars``; passed is None where a row is missing)."""
    out: list[tuple[str, bool | None]] = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["gen_len"]), []).append(r)
    for (model, gen_len), rs in groups.items():
        dense = next(r for r in rs if r["engine"] == "native" and r["policy"] == "dense")
        if gen_len >= BAR_MIN_LEN:
            for r in rs:
                if r["engine"] != "native" or r["policy"] == "dense" or r.get("memory_matched") \
                        or abs(r["budget_frac"] - BAR_FRAC) > 1e-9:
                    continue
                tag = f"{model} {gen_len} {r['policy']:<9} N={r['compress_every']:<3}"
                out.append((f"{tag} speed {r['speed_vs_dense']:.2f}x dense-native (>= "
                            f"{BAR_SPEED:.0f}x; attention alone would give "
                            f"{1 / r['attn_vs_dense']:.2f}x)", r["speed_vs_dense"] >= BAR_SPEED))
                out.append((f"{tag} KV {r['kv_vs_dense']:.3f} of dense (<= {BAR_KV:.2f})",
                            r["kv_vs_dense"] <= BAR_KV))
        for r in rs:
            if r["engine"] == "hf-static" and not r.get("memory_matched"):
                out.append((f"{model} {gen_len} dense-native {dense['tok_per_s']:.0f} tok/s >= "
                            f"hf-static {r['tok_per_s']:.0f}", dense["tok_per_s"] >= r["tok_per_s"]))
    return out + rv.bars(rows, BAR_FRAC, BAR_MIN_LEN)


def equal_memory_info(rows: list[dict]) -> list[str]:
    """INFO lines for the equal-KV-memory rows (not a bar: the issue's bar is at the same batch)."""
    out = []
    for r in rows:
        if not r.get("memory_matched"):
            continue
        dense = next(d for d in rows if d["model"] == r["model"] and d["gen_len"] == r["gen_len"]
                     and d["engine"] == "native" and d["policy"] == "dense")
        out.append(f"{r['model']} {r['gen_len']} {r['policy']:<9} N={r['compress_every']:<3} sparse "
                   f"at equal KV memory: {r['speed_vs_dense']:.2f}x dense tokens/s (batch "
                   f"{r['batch']} vs {dense['batch']}, KV {r['kv_vs_dense']:.3f} of dense)")
    return out


def print_bars(rows: list[dict]) -> None:
    found = bars(rows)
    print(f"\nbars ({sum(ok is True for _, ok in found)}/{len(found)} pass)")
    if not any(r["gen_len"] >= BAR_MIN_LEN for r in rows):
        print(f"  (speed and KV bars need gen_len >= {BAR_MIN_LEN} with budget {BAR_FRAC})")
    if not any(r["model"] == rv.BAR_MODEL and r["gen_len"] == BAR_MIN_LEN for r in rows):
        print(f"  (issue 17's vLLM bars need the {rv.BAR_MODEL} model at gen_len {BAR_MIN_LEN} "
              f"with budget {BAR_FRAC})")
    for line, ok in found:
        print(f"  {'MISSING' if ok is None else 'PASS' if ok else 'FAIL'}  {line}")
    for line in equal_memory_info(rows):
        print(f"  INFO  {line}")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="reduced set (~2 min)")
    ap.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    ap.add_argument("--models", default="tiny,mid")
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--budgets", default="0.125,0.25,0.5", help="fractions of gen_len")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--batch", type=int, default=16, help="batch (a quarter of it above 2048)")
    ap.add_argument("--long-batch", type=int, default=0,
                    help="batch above 2048 tokens (default: a quarter of --batch)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--every", type=int, default=128, help="compress_every (N)")
    ap.add_argument("--extra-every", type=int, default=64,
                    help="also run the 25%%-budget policies with this N at 2048+ tokens (0: off)")
    ap.add_argument("--hf", default="static,dynamic", help="HF generate peers ('' for none)")
    ap.add_argument("--peer-max-len", type=int, default=2048, help="longest gen_len for peers")
    ap.add_argument("--no-vllm", dest="vllm", action="store_false")
    ap.add_argument("--equal-memory", action=argparse.BooleanOptionalAction, default=True,
                    help="at 2048+ tokens also run each 25%%-budget policy at the largest batch that "
                         "fits in dense's KV bytes (INFO rows, not a bar)")
    ap.add_argument("--dtype", choices=[d.value for d in Dtype], default="float32",
                    help="the models' dtype for every engine (native, HF, vLLM)")
    ap.add_argument("--equal-pool", action=argparse.BooleanOptionalAction, default=True,
                    help="vLLM at equal KV pool bytes: dense and each 25%%-budget policy given "
                         "--pool-requests prompts at once in the pool dense needs for --pool-batch "
                         "sequences (at --pool-min-len+ tokens)")
    ap.add_argument("--pool-batch", type=int, default=0,
                    help="sequences the pool holds at full length, dense (default: the batch)")
    ap.add_argument("--pool-requests", type=int, default=0,
                    help="prompts submitted at once to the pool (default: 4 x --pool-batch)")
    ap.add_argument("--pool-min-len", type=int, default=BAR_MIN_LEN,
                    help="shortest gen_len with equal-pool rows")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2, help="rounds; each row keeps its best")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the GPU bench at the paper's settings (bench/rollout_gpu.py; its "
                         "options: --device cuda --help)")
    ap.add_argument("--shape", help="public Qwen2.5 shapes, random weights (bench/rollout_gpu.py); "
                                    "with --device cpu runs its rows on the CPU")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.lengths, args.budgets = "tiny", "256,1024", "0.25"
        args.batch, args.peer_max_len, args.repeat = 8, 256, 2
        args.pool_min_len, args.pool_batch, args.pool_requests = 256, 2, 8
    args.models = [m for m in args.models.split(",") if m]
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    args.budgets = [float(x) for x in args.budgets.split(",") if x]
    args.policies = [p for p in args.policies.split(",") if p]
    args.hf = [h for h in args.hf.split(",") if h]
    return args


def main(argv=None) -> list[dict]:
    pre = argparse.ArgumentParser(add_help=False)   # which bench: --help then lists its options
    pre.add_argument("--device", default="cpu")
    pre.add_argument("--shape")
    known, _ = pre.parse_known_args(argv)
    if known.device != "cpu" or known.shape:
        from bench import rollout_gpu

        return rollout_gpu.main(argv)
    args = parse(argv)
    print(HEADER, flush=True)
    rows = bench(args)
    print_bars(rows)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([{k: r[k] for k in FIELDS} for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()
