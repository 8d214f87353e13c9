"""Learner memory benchmark: peak memory of one train step, naive full-vocabulary log-probs vs ours.

A model with a real vocabulary (Qwen2.5's 152,064 by default) and small random layers (the
vocabulary is what matters: the [tokens, vocab] fp32 logits dominate), one batch of prompt +
response tokens, one step: token log-probs -> ``correction.policy_loss`` -> backward -> AdamW.

  naive  ``learner.testing.naive_token_logprobs``: the model's forward, fp32 logits for every
         position and the whole vocabulary, ``log_softmax``, gather (what the learner did before)
  ours   ``common.modeling.token_logprobs``: response positions only, the LM head and the
         log-softmax ``--chunk`` tokens at a time under activation checkpointing

Each (impl, response length) runs in a fresh process, so its peak is its own: peak RSS on CPU
(``ru_maxrss``), peak allocated on a GPU. Rows: impl, vocab, resp_len, batch, peak_bytes,
base_bytes (the process before the step: model, optimiser, batch), step_s, loss. Bar: ours <=
0.25x naive peak at the longest response, with the same loss.

    python bench/learner_memory.py [--quick] [--json PATH] [--resp-lens 1024,4096] [--vocab N]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

COLUMNS = ("impl", "vocab", "resp_len", "batch", "peak_bytes", "base_bytes", "step_s", "loss")
BAR = 0.25


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--resp-lens", default="1024,4096")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--chunk", type=int, default=None,
                   help="ours: tokens per LM-head chunk (default: learner.logprob_chunk_tokens)")
    p.add_argument("--quick", action="store_true", help="responses of 256 and 1024 tokens")
    p.add_argument("--json", default=None, help="write one JSON row per line here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: impl,resp_len,model
    return p.parse_args(argv)


def _rss_peak() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_step(impl: str, resp_len: int, model_dir: str, args) -> dict:
    """One train step in this process; returns its row (see module doc)."""
    import torch

    from common.modeling import load_model, token_logprobs
    from correction import CorrectionConfig, policy_loss
    from learner.config import LearnerConfig
    from learner.testing import naive_token_logprobs

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    model = load_model(model_dir).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    b, t = args.batch, args.prompt_len + resp_len
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (b, t), generator=g).to(dev)
    attn = torch.ones(b, t, dtype=torch.long, device=dev)
    resp = torch.zeros(b, t, dtype=torch.bool, device=dev)
    resp[:, args.prompt_len:] = True
    old = (-torch.rand(b, t, generator=g) * 5).to(dev)
    adv = torch.randn(b, generator=g).to(dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else _current_rss()
    chunk = args.chunk or LearnerConfig().logprob_chunk_tokens
    t0 = time.perf_counter()
    if impl == "naive":
        new = naive_token_logprobs(model, ids, attn)[0]
    else:
        new = token_logprobs(model, ids, attn, response_mask=resp, chunk_tokens=chunk)
    loss, _ = policy_loss(new, old, adv, resp.float(), resp.float(), CorrectionConfig())
    loss.backward()
    opt.step()
    if cuda:
        torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else _rss_peak()
    return {"impl": impl, "vocab": args.vocab, "resp_len": resp_len, "batch": b,
            "peak_bytes": int(peak), "base_bytes": int(base), "step_s": round(step_s, 3),
            "loss": float(loss)}


def _child(impl: str, resp_len: int, model_dir: str, argv: list[str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--one", f"{impl},{resp_len},{model_dir}"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"{impl} at {resp_len} tokens failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.one:
        impl, resp_len, model_dir = args.one.split(",", 2)
        print(json.dumps(one_step(impl, int(resp_len), model_dir, args)))
        return []
    from common.testmodels import build_model

    lens = [256, 1024] if args.quick else [int(x) for x in args.resp_lens.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-lm-") as tmp:
        model_dir = build_model(os.path.join(tmp, "model"), vocab_size=args.vocab,
                                hidden_size=args.hidden, num_hidden_layers=args.layers)
        for n in lens:
            for impl in ("naive", "ours"):
                rows.append(_child(impl, n, model_dir, argv))
    report(rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def report(rows: list[dict]) -> None:
    print("| impl | vocab | resp_len | batch | peak MiB | base MiB | step s | loss | peak vs naive |")
    print("|---|---|---|---|---|---|---|---|---|")
    naive = {r["resp_len"]: r for r in rows if r["impl"] == "naive"}
    for r in rows:
        ratio = r["peak_bytes"] / naive[r["resp_len"]]["peak_bytes"]
        print(f"| {r['impl']} | {r['vocab']} | {r['resp_len']} | {r['batch']} | "
              f"{r['peak_bytes'] / 2**20:.0f} | {r['base_bytes'] / 2**20:.0f} | {r['step_s']:.2f} | "
              f"{r['loss']:.6f} | {ratio:.3f}x |")
    longest = max(naive)
    ours = next(r for r in rows if r["impl"] == "ours" and r["resp_len"] == longest)
    ratio = ours["peak_bytes"] / naive[longest]["peak_bytes"]
    same = abs(ours["loss"] - naive[longest]["loss"]) <= 1e-4 * max(1.0, abs(ours["loss"]))
    verdict = "PASS" if ratio <= BAR and same else "FAIL"
    print(f"bar: ours <= {BAR}x naive peak at {longest} tokens with the same loss: {ratio:.3f}x, "
          f"loss {ours['loss']:.6f} vs {naive[longest]['loss']:.6f} -> {verdict}")


if __name__ == "__main__":
    main()
