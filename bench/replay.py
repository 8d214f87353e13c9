"""Teacher-forced replay of the native engine: the decode loop forced token by token against the
chunked run (``actors/native/forced.py``), side by side on the same rows.

    python bench/replay.py                       # the tiny test model, every policy
    python bench/replay.py --model .cache/models/reasoning-quick --prompt-len 25 \\
        --response-len 208 --budget 60 --every 16 --json runs/replay.json

``NativeEngine.replay`` (probes, the dynamic schedule's checks, ``bench/mismatch.py``) and
``replay_kept_sets`` (the kept sets of ``launch/make_base_model.py``'s second stage, every SFT
step) read given responses through the engine's sparse path. ``--rows`` random prompts of
``--prompt-len`` tokens and random responses of ``--response-len`` are read with each policy at
``--budget`` / N = ``--every``, both ways. Per row of the table: seconds of each (the best of
``--repeats``), the speed-up, forwards (decode steps; chunks), and whether the two agree: the
same compression events keeping the same slots (``same_kept``) and the largest difference of a
next-token log-prob (``max_dlogp``, float rounding). Speeds are this machine's, measured in one
run; they depend on the model's size and the device.
"""
from __future__ import annotations

import argparse
import json
import random
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
from actors.native import NativeEngine, forced  # noqa: E402

POLICIES = ("dense", "streaming", "h2o", "snapkv", "rkv")
COLS = ("policy", "rows", "tokens", "stepwise_s", "chunked_s", "speedup", "steps", "chunks",
        "same_kept", "max_dlogp")


def best_of(repeats: int, fn):
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def same_kept(a: list, b: list) -> bool:
    return all([p for p, _ in x] == [p for p, _ in y] and
               all(torch.equal(k1, k2) for (_, k1), (_, k2) in zip(x, y)) for x, y in zip(a, b))


def row(model, policy: str, prompts, responses, args) -> dict:
    kv = KVConfig(policy=policy, budget=args.budget, compress_every=args.every)
    eng = NativeEngine(model, kv, batch_size=len(prompts), trace=True, step="eager")
    params = SamplingParams(temperature=0.0)
    t_step, (logp_step, kept_step) = best_of(
        args.repeats, lambda: forced.stepwise(eng, prompts, responses, params))
    chunks = []
    step = forced.chunk_step

    def counted(*a):
        chunks.append(1)
        return step(*a)

    forced.chunk_step = counted
    try:
        t_chunk, kept = best_of(args.repeats, lambda: eng.replay_kept_sets(prompts, responses))
    finally:
        forced.chunk_step = step
    logp = eng.replay(prompts, responses, params)
    dlogp = max(float((a - b).abs().max()) for a, b in zip(logp, logp_step))
    return {"policy": policy, "rows": len(prompts), "tokens": sum(map(len, responses)),
            "stepwise_s": t_step, "chunked_s": t_chunk, "speedup": t_step / t_chunk,
            "steps": max(map(len, responses)) - 1, "chunks": len(chunks) // args.repeats,
            "same_kept": same_kept(kept, kept_step), "max_dlogp": dlogp}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="a model directory (default: the tiny test model)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=25)
    ap.add_argument("--response-len", type=int, default=208)
    ap.add_argument("--budget", type=int, default=60)
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from common.modeling import load_model
    from common.testmodels import build_model

    torch.set_num_threads(args.threads)
    if args.model:
        model = load_model(args.model)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            model = load_model(build_model(Path(tmp) / "m", "tiny", seed=0))
    rng = random.Random(0)
    vocab = min(model.config.vocab_size, 260)
    prompts = [[rng.randrange(4, vocab) for _ in range(args.prompt_len)] for _ in range(args.rows)]
    responses = [[rng.randrange(4, vocab) for _ in range(args.response_len)]
                 for _ in range(args.rows)]
    rows = [row(model, p, prompts, responses, args) for p in args.policies.split(",")]
    print("| " + " | ".join(COLS) + " |\n|" + "---|" * len(COLS))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c])
                                for c in COLS) + " |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
