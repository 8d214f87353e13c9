"""GPU rollout benchmark: the native engine at the paper's settings on random-weight public shapes.

    python bench/rollout.py --device cuda --json runs/rollout_gpu.json      # the defaults below
    python bench/rollout.py --device cuda --rows same --policies snapkv,rkv --gen-len 2048
    python bench/rollout.py --device cuda --shape qwen2.5-0.5b,qwen2.5-7b --time-budget 0

``bench/rollout.py`` hands its arguments here when given ``--device cuda`` or ``--shape`` (with
``--device cpu``: the same rows on the CPU, as the test runs them on a shape shrunk by
``--override``); ``--device cuda --help`` lists the options; check.sh appends ``$GPU_BENCH_ARGS``.
Models (``--shape``): the public Qwen2.5 configs in ``SHAPES`` (0.5B, 1.5B, 7B: 494M, 1544M, 7616M
parameters, as published) with random weights (std 0.02) built on the device in ``--dtype``
(``common/testmodels.random_model``: nothing downloaded or written). No stop tokens: every row
generates exactly its gen_len tokens per sequence from random prompts, temperature 1.

Rows per shape (``--rows``; defaults = the paper's settings: Qwen2.5-1.5B, bfloat16, 128-token
prompts, 4096 new tokens, batch 64, budget 512, compress every N = 128):
  same   native dense (always run: every bar's reference), then each of ``--policies``, at
         ``--batch`` and ``--gen-len``;
  equal  each policy at the largest batch whose preallocated KV fits in dense's at ``--batch`` (the
         engine's documented accounting, rows * capacity * bytes/token, capacity prompt + gen_len
         dense, budget + N sparse: 422 rows at the defaults), for ``--equal-gen-len`` tokens;
  hf     HF ``generate``, static cache, eager (torch.compile's compile time would dominate a short
         run), and native dense as its reference, both at ``--batch`` and ``--hf-gen-len``.
Why equal and hf rows are shorter (1024, 512 tokens): check.sh gives the run 300 s; at today's
~3,900 tok/s a 4096-token dense row at batch 64 takes ~67 s and an equal row holds 422 x 4096. From
its 512th token on a sparse row stores budget + N slots whatever its length, so a 1024-token equal
row holds the KV and batch of a 4096-token one; its tok/s is a little favourable (its first 512
tokens attend fewer slots: ``attn_vs_dense``; 2048 halves that share). HF's eager step is slow.

Time: rows run in priority order (dense; snapkv, rkv; their equal rows; the hf pair; the other
policies; theirs). ``--time-budget`` (240 s from the start, builds included; 0: none) stops starting
rows once spent and caps each at the time left (``--row-cap``: per row). A capped row is stopped
(SIGALRM): status "timeout", with an upper bound on its tok/s; unstarted: "skipped"; failed (OOM):
"error: ...". The JSON is rewritten after every row. At the bars' speeds, ~3 min on an H100 (est.).

Fields: ``tok_per_s`` = generated tokens / wall time of the call (prefill included, CUDA synced),
one run per row after a warm-up; ``*_vs_dense`` vs native dense of the same shape and run at
``dense_batch`` x ``dense_gen_len`` (equal rows: the main dense row, the paper's comparison);
``allocated_kv_bytes``: the engine's ``last_stats`` (HF: its static cache); ``peak_cuda_bytes``:
``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats`` (weights included),
``peak_cuda_extra_bytes`` the part above what the row started with; null on the CPU.
Bars (issue 27), per shape, at ``--batch`` and ``--gen-len``: native dense >= 12,000 tok/s; snapkv
and rkv >= 1.3x native dense at the same batch, and >= 3x at equal KV memory. A row missing or
unfinished prints MISSING, never PASS; the heading names settings off the paper's. Others: INFO.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import signal
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from actors.config import KVConfig  # noqa: E402
from actors.engine import SamplingParams  # noqa: E402
from actors.native import NativeEngine  # noqa: E402
from bench.rollout_rows import POLICIES, kv_bytes_per_token, prompts  # noqa: E402
from common.dtypes import Dtype, torch_dtype  # noqa: E402

# Public Qwen2.5 configs (config.json of Qwen/Qwen2.5-*); the "qwen2.5" test family adds q/k/v
# biases and rms_norm_eps 1e-6. max_position_embeddings only bounds positions (no RoPE scaling).
_QWEN25 = dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
               max_position_embeddings=32768, initializer_range=0.02, use_sliding_window=False)
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(_QWEN25, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                         tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN25, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                         tie_word_embeddings=True),
    "qwen2.5-7b": dict(_QWEN25, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                       tie_word_embeddings=False),
}
PAPER = dict(shape="qwen2.5-1.5b", device="cuda", dtype="bfloat16", prompt_len=128, gen_len=4096,
             batch=64, budget=512, every=128)
BAR_DENSE_TOK_S, BAR_SAME, BAR_EQUAL, BAR_POLICIES = 12000.0, 1.3, 3.0, ("snapkv", "rkv")
ROW_KINDS = ("same", "equal", "hf")
MIN_ROW_S = 2.0    # a row started with less time left than this could not finish a prefill
FIELDS = ("model", "device", "dtype", "engine", "policy", "budget", "compress_every", "prompt_len",
          "gen_len", "batch", "memory_matched", "status", "tok_per_s", "seconds", "speed_vs_dense",
          "dense_batch", "dense_gen_len", "allocated_kv_bytes", "kv_vs_dense", "stored_kv_bytes",
          "attn_slots", "attn_vs_dense", "peak_cuda_bytes", "peak_cuda_extra_bytes", "params",
          "overrides", "note")


def _csv(value: str, known, flag: str) -> list[str]:
    items = [x for x in value.split(",") if x]
    bad = [x for x in items if x not in known]
    if bad or not items:
        raise SystemExit(f"{flag} {value!r}: unknown {bad or 'empty list'}; "
                         f"known: {', '.join(known)}")
    return items


def _overrides(value: str) -> dict:
    """``key=value,...`` over the shape dicts' own keys (HF config names), ints where they parse."""
    out = {}
    for item in [x for x in value.split(",") if x]:
        key, sep, raw = item.partition("=")
        if not sep or key not in SHAPES[PAPER["shape"]]:
            raise SystemExit(f"--override {item!r}: expected key=value with a key among "
                             f"{', '.join(sorted(SHAPES[PAPER['shape']]))}")
        out[key] = {"true": True, "false": False}.get(raw.lower(), raw)
        with contextlib.suppress(ValueError):
            out[key] = float(raw) if "." in raw or "e" in raw.lower() else int(raw)
    return out


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/rollout.py --device cuda",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--shape", default=PAPER["shape"], help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--override", default="", help="shape keys to replace, key=value,... (tests)")
    ap.add_argument("--dtype", choices=[d.value for d in Dtype], default=PAPER["dtype"])
    ap.add_argument("--prompt-len", type=int, default=PAPER["prompt_len"])
    ap.add_argument("--gen-len", type=int, default=PAPER["gen_len"])
    ap.add_argument("--batch", type=int, default=PAPER["batch"])
    ap.add_argument("--budget", type=int, default=PAPER["budget"], help="KV tokens kept (sparse)")
    ap.add_argument("--every", type=int, default=PAPER["every"], help="compress_every (N)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--rows", default=",".join(ROW_KINDS), help="which of same, equal, hf")
    ap.add_argument("--equal-gen-len", type=int, default=1024, help="tokens of the equal rows")
    ap.add_argument("--equal-batch", type=int, default=0,
                    help="batch of the equal rows (default: the largest that fits)")
    ap.add_argument("--hf-gen-len", type=int, default=512, help="tokens of the hf pair")
    ap.add_argument("--time-budget", type=float, default=240.0,
                    help="seconds for the whole run (0: none)")
    ap.add_argument("--row-cap", type=float, default=0.0, help="seconds per row at most (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    ap.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = ap.parse_args(argv)
    args.shape = _csv(args.shape, list(SHAPES), "--shape")
    args.policies = _csv(args.policies, POLICIES, "--policies")
    args.rows = _csv(args.rows, ROW_KINDS, "--rows")
    args.override = _overrides(args.override)
    for flag in ("prompt_len", "gen_len", "batch", "budget", "every"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    # shorter rows never run longer than the main ones; 0 means "as long as --gen-len"
    args.equal_gen_len = min(args.equal_gen_len or args.gen_len, args.gen_len)
    args.hf_gen_len = min(args.hf_gen_len or args.gen_len, args.gen_len)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: torch {torch.__version__} sees no CUDA GPU")
    return args


class RowTimeout(BaseException):
    """Raised by SIGALRM inside a row; a BaseException so no ``except Exception`` swallows it."""


@contextlib.contextmanager
def time_cap(seconds: float | None):
    """Stop the body with RowTimeout after ``seconds`` (None/inf: no cap). SIGALRM reaches Python
    between bytecodes, so a CUDA launch or sync in flight finishes first. The grad mode is restored
    on the way out: the alarm can land inside ``torch.no_grad()``'s enter, before its own restore is
    armed, and leave gradients off for the rest of the process (seen: later tests failing with
    "does not require grad")."""
    if seconds in (None, math.inf) or threading.current_thread() is not threading.main_thread():
        yield
        return

    def _stop(signum, frame):
        raise RowTimeout(f"row stopped at its {seconds:.0f} s cap")

    grad = torch.is_grad_enabled()
    old = signal.signal(signal.SIGALRM, _stop)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        torch.set_grad_enabled(grad)


def _sync(dev: torch.device) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def bench_kv(policy: str, args) -> KVConfig:
    """The KV settings of a bench row: ``policy`` at ``args.budget`` / ``args.every``."""
    return KVConfig(policy=policy, compress_every=args.every) if policy == "dense" else \
        KVConfig(policy=policy, budget=args.budget, compress_every=args.every)


def native_row(model, ps, gen_len: int, policy: str, args, kv_limit: int | None = None) -> dict:
    """One native generate call; ``kv_limit``: the equal rows' KV bytes may not exceed dense's."""
    eng = NativeEngine(model, bench_kv(policy, args), batch_size=len(ps))
    dev = next(model.parameters()).device
    t0 = _sync(dev)
    outs = eng.generate(ps, SamplingParams(max_new_tokens=gen_len, seed=args.seed))
    dt = _sync(dev) - t0
    st = eng.last_stats
    if kv_limit is not None and st["allocated_kv_bytes"] > kv_limit:   # the accounting changed
        raise RuntimeError(f"{policy} at batch {len(ps)} allocated {st['allocated_kv_bytes']} KV "
                           f"bytes > dense's {kv_limit}: the equal batch is wrong")
    return {"tokens": sum(len(o.response_ids) for o in outs), "seconds": dt,
            "allocated_kv_bytes": st["allocated_kv_bytes"], "stored_kv_bytes": st["peak_kv_bytes"],
            "attn_slots": st["attended_slots"]}


def hf_row(model, ps, gen_len: int) -> dict:
    """HF ``generate``, static cache, sampling, eager (``disable_compile``: see the docstring)."""
    dev = next(model.parameters()).device
    ids = torch.tensor(ps, device=dev)
    t0 = _sync(dev)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len,
                             min_new_tokens=gen_len, do_sample=True, top_k=0, pad_token_id=0,
                             cache_implementation="static", disable_compile=True)
    dt = _sync(dev) - t0
    kv = ids.shape[0] * (ids.shape[1] + gen_len) * kv_bytes_per_token(model)
    return {"tokens": (out.shape[1] - ids.shape[1]) * ids.shape[0], "seconds": dt,
            "allocated_kv_bytes": kv, "stored_kv_bytes": kv, "attn_slots": None}


def equal_batch(args, bytes_per_token: int) -> tuple[int, int]:
    """(batch of the equal rows, dense's KV bytes at --batch), from the engine's documented
    accounting: rows * capacity * bytes/token."""
    dense = args.batch * (args.prompt_len + args.gen_len) * bytes_per_token
    per_row = min(args.budget + args.every, args.prompt_len + args.equal_gen_len) * bytes_per_token
    fit = dense // per_row
    if args.equal_batch > fit:
        raise SystemExit(f"--equal-batch {args.equal_batch}: more than the {fit} rows whose KV "
                         f"fits in dense's {dense} bytes at batch {args.batch}")
    return args.equal_batch or fit, dense


def plan(args, model, name: str) -> list[tuple[dict, object]]:
    """(row spec, job) pairs in run order: what the bars need first (see the docstring)."""
    vocab, b, g, p = model.config.vocab_size, args.batch, args.gen_len, args.prompt_len
    ps = prompts(b, p, vocab, args.seed)
    base = dict(model=name, engine="native", policy="dense", budget=0, compress_every=0,
                prompt_len=p, gen_len=g, batch=b, memory_matched=False, dense_batch=b,
                dense_gen_len=g)
    jobs: list[tuple[int, dict, object]] = []

    def add(prio: int, job, **kw):
        jobs.append((prio, dict(base, **kw), job))

    sparse = lambda pol: dict(policy=pol, budget=args.budget, compress_every=args.every)  # noqa
    add(0, lambda: native_row(model, ps, g, "dense", args))
    for pol in args.policies if "same" in args.rows else ():
        add(1 if pol in BAR_POLICIES else 4, lambda q=pol: native_row(model, ps, g, q, args),
            **sparse(pol))
    if "equal" in args.rows:
        bpt = NativeEngine(model, KVConfig(), batch_size=1).kv_bytes_per_token()
        eb, limit = equal_batch(args, bpt)
        eps = prompts(eb, p, vocab, args.seed)
        for pol in args.policies:
            add(2 if pol in BAR_POLICIES else 5, lambda q=pol: native_row(
                model, eps, args.equal_gen_len, q, args, kv_limit=limit),
                batch=eb, gen_len=args.equal_gen_len, memory_matched=True, **sparse(pol))
    if "hf" in args.rows:
        gh = args.hf_gen_len
        if gh != g:   # HF's reference: native dense at HF's own length
            add(3, lambda: native_row(model, ps, gh, "dense", args), gen_len=gh, dense_gen_len=gh)
        add(3, lambda: hf_row(model, ps, gh), engine="hf-static", gen_len=gh, dense_gen_len=gh)
    return [(spec, job) for _, spec, job in sorted(jobs, key=lambda j: j[0])]


def measure(job, dev: torch.device, cap: float | None) -> dict:
    """Run one job under the cap; its status, tok/s and peak CUDA memory (null on the CPU)."""
    cuda = dev.type == "cuda"
    gc.collect()
    before = None
    if cuda:   # each row's peak is its own: free what earlier rows left cached, then reset
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
    try:
        with time_cap(cap):
            r = job()
    except RowTimeout:
        return {"status": "timeout"}
    except Exception as e:   # e.g. out of memory at the equal batch: keep the other rows
        return {"status": f"error: {type(e).__name__}: {str(e)[:200]}"}
    r.update(status="ok", tok_per_s=r["tokens"] / r["seconds"])
    if cuda:
        peak = torch.cuda.max_memory_allocated(dev)
        r.update(peak_cuda_bytes=peak, peak_cuda_extra_bytes=peak - before)
    return r


def warm_up(model, args) -> None:
    """Lazy CUDA init, kernel selection and the first compression, out of every row's time; a
    failure is printed and left to that row to report (the other rows still run)."""
    ps = prompts(2, 8, model.config.vocab_size, args.seed)
    small = argparse.Namespace(every=8, budget=16, seed=args.seed)
    jobs = [("dense", lambda: native_row(model, ps, 8, "dense", small))]
    jobs += [(pol, lambda q=pol: native_row(model, ps, 40, q, small))   # 8 + 40 > 16 + 8
             for pol in args.policies]
    jobs += [("hf-static", lambda: hf_row(model, ps, 4))] if "hf" in args.rows else []
    for what, job in jobs:
        try:
            job()
        except Exception as e:
            print(f"# warm-up {what} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)


def build(name: str, args, dev: torch.device):
    from common.testmodels import random_model

    t0 = time.perf_counter()
    model = random_model("qwen2.5", dev, torch_dtype(args.dtype), seed=args.seed,
                         **{**SHAPES[name], **args.override})
    params = sum(p.numel() for p in model.parameters())
    c = model.config
    print(f"# {name}: hidden {c.hidden_size} x {c.num_hidden_layers} layers, heads "
          f"{c.num_attention_heads}/{c.num_key_value_heads} KV, vocab {c.vocab_size}, "
          f"{params / 1e6:.1f}M parameters, {args.dtype} on {dev}, built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return model, params


def _find(rows, **want) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in want.items())), None)


def dense_of(rows: list[dict], r: dict) -> dict | None:
    """The native dense row ``r`` is compared with (same shape, dense_batch, dense_gen_len)."""
    return _find(rows, model=r["model"], engine="native", policy="dense", memory_matched=False,
                 status="ok", batch=r["dense_batch"], gen_len=r["dense_gen_len"])


def add_ratios(rows: list[dict]) -> None:
    for r in rows:
        d = dense_of(rows, r)
        ok = r["status"] == "ok" and d is not None
        r["speed_vs_dense"] = r["tok_per_s"] / d["tok_per_s"] if ok else None
        r["kv_vs_dense"] = r["allocated_kv_bytes"] / d["allocated_kv_bytes"] if ok else None
        r["attn_vs_dense"] = r["attn_slots"] / d["attn_slots"] \
            if ok and r.get("attn_slots") is not None else None


def write_json(path: str | None, rows: list[dict]) -> None:
    """Rewritten after every row (through a temporary file), so a killed run keeps its rows."""
    if path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps([{k: r.get(k) for k in FIELDS} for r in rows], indent=1))
        tmp.replace(out)


def run(args) -> list[dict]:
    """Every shape's planned rows under the time budget; each row printed and saved as it ends."""
    t_start = time.monotonic()
    deadline = t_start + args.time_budget if args.time_budget > 0 else math.inf
    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(args.threads)
    rows: list[dict] = []
    for name in args.shape:
        model, params = build(name, args, dev)
        warm_up(model, args)
        for spec, job in plan(args, model, name):
            row = dict(spec, device=args.device, dtype=args.dtype, params=params,
                       overrides=args.override or None, note=None)
            left = deadline - time.monotonic()
            if left < MIN_ROW_S:
                row.update(status="skipped", note=f"--time-budget {args.time_budget:g} s spent")
            else:
                cap = min(left, args.row_cap or math.inf)
                row.update(measure(job, dev, cap))
                if row["status"] == "timeout":
                    row["note"] = (f"stopped at its {cap:.0f} s cap: < "
                                   f"{row['batch'] * row['gen_len'] / cap:.0f} tok/s")
            rows.append(row)
            add_ratios(rows)
            done = (f"{row['tok_per_s']:.0f} tok/s in {row['seconds']:.1f} s"
                    if row["status"] == "ok" else f"{row['status']} {row['note'] or ''}")
            print(f"# [t={time.monotonic() - t_start:.0f}s] {name} {row['engine']} "
                  f"{row['policy']} batch {row['batch']} x {row['gen_len']}: {done}", flush=True)
            write_json(args.json, rows)
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


COLUMNS = (("model", 12, "{}"), ("engine", 9, "{}"), ("policy", 9, "{}"), ("budget", 6, "{}"),
           ("N", 4, "{}"), ("gen_len", 7, "{}"), ("batch", 5, "{}"), ("tok_per_s", 9, "{:.0f}"),
           ("speed_vs_dense", 14, "{:.2f}x"), ("kv_MiB", 9, "{:.1f}"),
           ("kv_vs_dense", 11, "{:.3f}"), ("attn_vs_dense", 13, "{:.3f}"),
           ("cuda_GiB", 8, "{:.2f}"), ("seconds", 7, "{:.1f}"), ("status", 0, "{}"))


def _line(cells) -> str:
    return " ".join(f"{c:<{w}}" if i < 3 else f"{c:>{w}}"
                    for i, (c, (_, w, _)) in enumerate(zip(cells, COLUMNS))).rstrip()


def fmt_row(r: dict) -> str:
    ok = r["status"] == "ok"
    vals = dict(r, N=r["compress_every"] or "-", budget=r["budget"] or "-",
                kv_MiB=r["allocated_kv_bytes"] / 2**20 if ok else None,
                cuda_GiB=r["peak_cuda_bytes"] / 2**30 if r.get("peak_cuda_bytes") else None,
                status="" if ok else f"{r['status']} {r['note'] or ''}".strip())
    return _line(["-" if vals.get(n) is None else f.format(vals[n]) for n, _, f in COLUMNS])


def print_table(rows: list[dict], args) -> None:
    """The same, equal and hf sections, in that order, for every shape."""
    print("\n" + _line([n for n, _, _ in COLUMNS]))
    sections = (("same", lambda r: not r["memory_matched"] and r["gen_len"] == args.gen_len
                 and r["engine"] == "native"),
                (f"same KV memory as native dense at batch {args.batch}, {args.equal_gen_len} "
                 f"tokens; ratios vs dense at {args.gen_len}", lambda r: r["memory_matched"]),
                (f"HF generate (static cache, eager) and native dense at {args.hf_gen_len} tokens",
                 lambda r: not r["memory_matched"] and (r["engine"] != "native"
                                                        or r["gen_len"] != args.gen_len)))
    for title, pick in sections:
        part = [r for r in rows if pick(r)]
        if part and title != "same":
            print(f"# {title}")
        for r in part:
            print(fmt_row(r))


def _bar(label: str, row: dict | None, value, target: float, unit: str) -> tuple[str, bool | None]:
    """(line, passed); passed is None (MISSING) when the row is absent, unfinished or has no
    dense row to compare with."""
    v = None if row is None or row["status"] != "ok" else value(row)
    if v is None:
        why = ("not in this run" if row is None else row["status"] if row["status"] != "ok"
               else "no native dense row to compare with")
        return f"{label}: {why}", None
    num = "{:,.0f}" if unit == " tok/s" else "{:.2f}"
    return f"{label}: {num.format(v)}{unit} (>= {target:,g}{unit})", v >= target


def bars(rows: list[dict], args) -> list[tuple[str, bool | None]]:
    """Issue 27's GPU bars per shape, on the rows at --batch and --gen-len (see the docstring)."""
    out = []
    b, g = args.batch, args.gen_len
    for name in dict.fromkeys(r["model"] for r in rows):
        same = dict(model=name, engine="native", memory_matched=False, batch=b, gen_len=g)
        out.append(_bar(f"{name} native dense, batch {b}", _find(rows, policy="dense", **same),
                        lambda r: r["tok_per_s"], BAR_DENSE_TOK_S, " tok/s"))
        for pol in BAR_POLICIES:
            out.append(_bar(f"{name} {pol} vs native dense, both batch {b}",
                            _find(rows, policy=pol, **same), lambda r: r["speed_vs_dense"],
                            BAR_SAME, "x"))
        for pol in BAR_POLICIES:
            r = _find(rows, model=name, policy=pol, memory_matched=True, dense_batch=b,
                      dense_gen_len=g)
            where = f"batch {r['batch']} x {r['gen_len']} tokens" if r else "equal KV memory"
            out.append(_bar(f"{name} {pol} at equal KV memory ({where}) vs native dense at "
                            f"batch {b}", r, lambda r: r["speed_vs_dense"], BAR_EQUAL, "x"))
    return out


def info(rows: list[dict]) -> list[str]:
    """Rows no bar judges: the other policies, HF, and dense at HF's length."""
    out = []
    for r in rows:
        judged = r["policy"] in BAR_POLICIES or (r["policy"] == "dense" and r["engine"] == "native")
        if judged or r["status"] != "ok" or r["speed_vs_dense"] is None:
            continue
        what = "at equal KV memory, " if r["memory_matched"] else ""
        out.append(f"{r['model']} {r['engine']} {r['policy']} {what}batch {r['batch']} x "
                   f"{r['gen_len']}: {r['tok_per_s']:.0f} tok/s, {r['speed_vs_dense']:.2f}x native "
                   f"dense (batch {r['dense_batch']} x {r['dense_gen_len']})")
    return out


def print_bars(rows: list[dict], args) -> None:
    found = bars(rows, args)
    print(f"\nbars (issue 27: {sum(ok is True for _, ok in found)}/{len(found)} pass)")
    now = dict(vars(args), shape=",".join(args.shape))
    differ = [f"{k} {now[k]} (paper {v})" for k, v in PAPER.items() if now[k] != v]
    differ += [f"override {k}={v}" for k, v in args.override.items()]
    if differ:   # the bars are the paper's: say where this run is not
        print(f"  (not the paper's settings: {'; '.join(differ)})")
    for line, ok in found:
        print(f"  {'MISSING' if ok is None else 'PASS' if ok else 'FAIL'}  {line}")
    for line in info(rows):
        print(f"  INFO  {line}")


def main(argv=None) -> list[dict]:
    args = parse(argv)
    rows = run(args)
    print_table(rows, args)
    print_bars(rows, args)
    return rows


if __name__ == "__main__":
    main()
