"""Which tokens the Sparse-RL rejection band and veto take out, in right and in wrong samples
(issue 28).

    python bench/mismatch.py --model .cache/models/reasoning-base --budgets 45,90 [--n 64] \\
        [--compress-every N] [--protect-prompt] [--tail 0.01 [--bin-tokens 32]] [--json PATH]

Samples ``--n`` training prompts x ``--samples`` responses of the model's task with a sparse cache
(``--policy``, default R-KV, at each budget; temperature 1, as the rollouts do), re-scores every
sampled token densely (the scorer's ``dense_logprobs``), and applies the correction's own
``rejection_mask`` (``correction.config.RejectionConfig``'s defaults: the paper's band [0.5, 1.5]
and veto 1e-4) to rho_t = pi_dense(y_t) / pi_sparse(y_t). Each token is classed by its text:
``digit`` (the task's facts, intermediate results and answers), ``name`` (a one-letter fact name)
or ``other``. Per budget and outcome (the task's reward > 0 or not) it reports:

* ``low_per_sample`` / ``high_per_sample``: tokens rejected below / above the band, per sample;
* ``low_digit_share``: the share of the rejected-below tokens that are digits, beside
  ``digit_share``, the share of digits among all sampled tokens;
* ``with_low``: the share of samples with at least one token rejected below the band;
* ``vetoed``: the share of samples the veto removes;
* ``digit_weight`` / ``other_weight``: the mean importance weight min(rho_t, 1.5) (the correction's
  ``importance_weights`` at ``ISConfig``'s defaults, before normalisation, rejection and veto) of
  the digit tokens / of every other token: how much of each kind's signal the weighting keeps.

A band that picks out the errors would reject more in wrong samples than in right ones. The task is
the one the model was built for (``sft_metrics.json``), or that its run trained it on (a run's
``final/``), as ``bench/attention.task_of`` reads it; ``--task`` names another.

``--tail Q`` also replays every sample through the same sparse engine against the dense model
(``actors.probes.agreement``: the sampled sequence's own per-token agreement alpha = 1 - TV, as the
dynamic schedule's probes measure it) and adds, over all samples of a budget (``all``): the
``Q``-quantile of alpha per position bin of ``--bin-tokens`` (``schedule.plan.tail``: the dynamic
schedule's statistic, ``rollout.kv.quantile``), the share of samples holding an alpha below 0.1,
the vetoed share, the mean reward and the peak KV against a dense cache of the same tokens
(``launch.metrics.kv_vs_dense``). That is the calibration of RESULTS.md's "dynamic schedule at
N = 32": which budgets keep the tail in which bins. ``--protect-prompt`` keeps the prompt
(``rollout.kv.protect_prompt``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Run as a script, bench/ leads sys.path (bench/buffer.py would shadow the buffer package).
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [str(REPO)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

FIELDS = ("samples", "mean_tokens", "low_per_sample", "high_per_sample", "low_digit_share",
          "digit_share", "with_low", "vetoed", "digit_weight", "other_weight")


def token_class(text: str) -> str:
    """``digit`` (all digits), ``name`` (one letter) or ``other``, on the stripped text."""
    t = text.strip()
    if t.isdigit():
        return "digit"
    return "name" if len(t) == 1 and t.isalpha() else "other"


def _mean(values, where) -> float:
    """Mean of ``values`` where ``where`` holds (0.0 where it never does)."""
    n = int(where.sum())
    return float(values[where].sum()) / n if n else 0.0


def tally(right: list[bool], classes: list[list[str]], sampler_logp: list[list[float]],
          dense_logp: list[list[float]], rejection=None) -> dict:
    """Per outcome (``right`` / ``wrong``), the figures of the module doc for these samples:
    sample i's tokens have classes ``classes[i]`` and log-probs ``sampler_logp[i]`` (sparse
    sampler) / ``dense_logp[i]`` (dense re-score). ``rejection``: a ``RejectionConfig``
    (default: the correction's defaults)."""
    import torch

    from correction.config import ISConfig, RejectionConfig
    from correction.weights import importance_weights, log_ratio, rejection_mask

    rejection = rejection or RejectionConfig()
    n = len(right)
    if not n == len(classes) == len(sampler_logp) == len(dense_logp):
        raise ValueError("right, classes, sampler_logp and dense_logp: one entry per sample")
    width = max((len(c) for c in classes), default=0)

    def padded(rows: list[list[float]]):
        return torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float64)

    valid = torch.tensor([[t < len(c) for t in range(width)] for c in classes], dtype=torch.bool)
    sl, dl = padded(sampler_logp), padded(dense_logp)
    lr = log_ratio(sl, dl, valid)
    _, rejected, vetoed = rejection_mask(lr, valid, rejection)
    low, high = rejected & (lr < 0), rejected & (lr > 0)
    weights = importance_weights(lr, valid, ISConfig())[0]
    digit = torch.tensor([[t < len(c) and c[t] == "digit" for t in range(width)] for c in classes],
                         dtype=torch.bool)
    out = {}
    for outcome, want in (("right", True), ("wrong", False)):
        rows = [i for i in range(n) if right[i] == want]
        s = max(len(rows), 1)
        low_cls = [classes[i][t] for i in rows for t in range(len(classes[i])) if low[i, t]]
        all_cls = [c for i in rows for c in classes[i]]
        out[outcome] = {
            "samples": len(rows),
            "mean_tokens": len(all_cls) / s,
            "low_per_sample": len(low_cls) / s,
            "high_per_sample": float(high[rows].sum()) / s if rows else 0.0,
            "low_digit_share": low_cls.count("digit") / max(len(low_cls), 1),
            "digit_share": all_cls.count("digit") / max(len(all_cls), 1),
            "with_low": float(low[rows].any(dim=1).sum()) / s if rows else 0.0,
            "vetoed": float(vetoed[rows].sum()) / s if rows else 0.0,
            "digit_weight": _mean(weights[rows], digit[rows]),
            "other_weight": _mean(weights[rows], valid[rows] & ~digit[rows]),
        }
    return out


LOW_ALPHA = 0.1   # an alpha below this is a token the dense policy would rarely have drawn


def tail_by_bin(prompt_lens: list[int], alphas: list[list[float]], quantile: float,
                bin_tokens: int) -> dict:
    """Per position bin (absolute position // ``bin_tokens``): the ``quantile``-quantile of the
    alphas of the response tokens there and their count; and the share of samples with an alpha
    below ``LOW_ALPHA``."""
    from schedule.plan import bin_alphas, tail

    by_bin = bin_alphas(prompt_lens, alphas, bin_tokens)
    low = sum(any(a < LOW_ALPHA for a in row) for row in alphas)
    return {"by_bin": {k: {"tail": tail(v, quantile), "tokens": len(v)}
                       for k, v in sorted(by_bin.items())},
            "low_alpha_share": low / max(len(alphas), 1)}


def measure(model_dir: Path, budgets: list[int], n: int = 64, samples: int = 8,
            policy: str = "rkv", compress_every: int = 16, obs_window: int = 8,
            max_new_tokens: int | None = None, seed: int = 1, protect_prompt: bool = False,
            tail: float | None = None, bin_tokens: int = 32, task_name: str | None = None,
            keep_mass: tuple[float, ...] = (0.0,), min_budget: int = 0) -> list[dict]:
    """One row per budget and ``keep_mass`` share (0: the fixed budget; else the adaptive budget
    of ``rollout.kv.keep_mass`` under it, at least ``min_budget``): ``{"budget", "keep_mass",
    "right": {...}, "wrong": {...}}`` (``tally``'s), and with ``tail`` (a quantile) ``"all"``:
    the figures of ``--tail`` in the module doc."""
    import torch
    from actors.config import KVConfig, KVPolicy
    from actors.engine import SamplingParams
    from actors.native.engine import NativeEngine
    from actors.scorer import dense_logprobs
    from bench.attention import task_of
    from common.modeling import load_model, load_tokenizer
    from common.tokens import eos_token_ids, pad_token_id

    torch.manual_seed(seed)
    task = task_of(model_dir, task_name)
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir)
    problems = task.problems("train")[:n]
    prompts = [tok(p.prompt)["input_ids"] for p in problems for _ in range(samples)]
    longest = max(len(tok(task.solution(p.prompt))["input_ids"]) for p in problems) + 1
    sp = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens or longest,
                        stop_token_ids=eos_token_ids(tok), seed=seed)
    rows = []
    for budget, share in [(b, m) for b in budgets for m in keep_mass]:
        kv = KVConfig(policy=KVPolicy(policy), budget=budget, compress_every=compress_every,
                      obs_window=obs_window, protect_prompt=protect_prompt, keep_mass=share,
                      min_budget=min_budget if share > 0 else 0)
        kv.validate("bench")
        engine = NativeEngine(model, kv, batch_size=64)
        outs = engine.generate(prompts, sp)
        resp = [list(o.response_ids) for o in outs]
        dense = dense_logprobs(model, prompts, resp, 1.0, pad_token_id(tok), 16)
        rewards = [task.reward(tok.decode(r, skip_special_tokens=True),
                               problems[i // samples].answer) for i, r in enumerate(resp)]
        classes = [[token_class(tok.decode([t])) for t in r] for r in resp]
        row = {"budget": budget, "keep_mass": share, "min_budget": kv.min_budget,
               **tally([r > 0 for r in rewards], classes, [list(o.logprobs) for o in outs],
                       dense)}
        if tail is not None:
            row["all"] = _all_samples(engine, prompts, resp, outs, sp, rewards, row, tail,
                                      bin_tokens)
        rows.append(row)
    return rows


def _all_samples(engine, prompts, resp, outs, params, rewards, row, quantile, bin_tokens) -> dict:
    """``--tail``'s figures over every sample of one budget (``resp``: the sampled responses of
    ``outs``; ``row``: their per-outcome tally)."""
    import pyarrow as pa
    from actors.probes import agreement
    from launch.metrics import kv_vs_dense

    alphas = agreement(engine, prompts, resp, params, micro_batch=16)
    n = len(outs)
    kv = kv_vs_dense(pa.table({"peak_kv_bytes": [o.peak_kv_bytes for o in outs],
                               "prompt_len": [len(p) for p in prompts],
                               "response_len": [len(r) for r in resp]}),
                     engine.kv_bytes_per_token())
    vetoed = sum(row[o]["vetoed"] * row[o]["samples"] for o in ("right", "wrong")) / n
    return {"samples": n, "reward": sum(rewards) / n, "vetoed": vetoed, "kv_vs_dense": kv,
            "quantile": quantile, "bin_tokens": bin_tokens,
            **tail_by_bin([len(p) for p in prompts], alphas, quantile, bin_tokens)}


def label(row: dict) -> str:
    """A row's KV setting: ``90``, or ``90 mass 0.95 >= 45`` for the adaptive budget."""
    if not row.get("keep_mass"):
        return str(row["budget"])
    return f"{row['budget']} mass {row['keep_mass']:g} >= {row['min_budget']}"


def table(rows: list[dict]) -> str:
    head = "| budget | outcome | " + " | ".join(FIELDS) + " |"
    lines = [head, "|" + "---|" * (len(FIELDS) + 2)]
    for r in rows:
        for outcome in ("right", "wrong"):
            v = r[outcome]
            cells = [str(v[f]) if f == "samples" else f"{v[f]:.3f}" for f in FIELDS]
            lines.append(f"| {label(r)} | {outcome} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tail_table(rows: list[dict]) -> str:
    """``--tail``'s rows: one line a budget, the bins' quantiles in order."""
    bins = sorted({k for r in rows for k in r["all"]["by_bin"]})
    q = rows[0]["all"]["quantile"]
    lines = ["| budget | samples | vetoed | alpha < 0.1 | reward | KV vs dense | "
             + " | ".join(f"q{q:g} bin {k}" for k in bins) + " |",
             "|" + "---|" * (6 + len(bins))]
    for r in rows:
        a = r["all"]
        cells = [f"{a['by_bin'][k]['tail']:.3f}" if k in a["by_bin"] else "–" for k in bins]
        lines.append(f"| {label(r)} | {a['samples']} | {a['vetoed']:.3f} | "
                     f"{a['low_alpha_share']:.3f} | {a['reward']:.3f} | {a['kv_vs_dense']:.3f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    from actors.config import KVPolicy

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True,
                    help="an SFT'd base model directory, or a run's final/")
    ap.add_argument("--task", default=None, help="default: the task the model was built for")
    ap.add_argument("--budgets", required=True, help="KV budgets in tokens, comma-separated")
    ap.add_argument("--n", type=int, default=64, help="training prompts")
    ap.add_argument("--samples", type=int, default=8, help="responses per prompt")
    ap.add_argument("--policy", default="rkv",
                    choices=[p.value for p in KVPolicy if p.value != "dense"],
                    help="eviction policy")
    ap.add_argument("--compress-every", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="default: the longest worked solution of the prompts + 1")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--protect-prompt", action="store_true",
                    help="keep every prompt token (rollout.kv.protect_prompt)")
    ap.add_argument("--tail", type=float, default=None, metavar="Q",
                    help="also the Q-quantile of each sample's own agreement per position bin "
                         "(e.g. 0.01), the vetoed share, reward and KV vs dense over all samples")
    ap.add_argument("--bin-tokens", type=int, default=32, help="position bin width for --tail")
    ap.add_argument("--keep-mass", default="0",
                    help="comma-separated shares, each measured at every budget: 0 = the fixed "
                         "budget, else the adaptive one (rollout.kv.keep_mass) under it")
    ap.add_argument("--min-budget", type=int, default=0,
                    help="the least an adaptive row keeps (rollout.kv.min_budget)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    try:
        budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        ap.error(f"--budgets: whole numbers, comma-separated (got {args.budgets!r})")
    try:
        shares = tuple(float(m) for m in args.keep_mass.split(","))
    except ValueError:
        ap.error(f"--keep-mass: numbers, comma-separated (got {args.keep_mass!r})")
    from actors.config import KVConfig
    from common.errors import ConfigError

    for b in budgets:    # every setting checked as the engine would, before any decode
        for m in shares:
            try:
                KVConfig(policy=args.policy, budget=b, protect_prompt=args.protect_prompt,
                         compress_every=args.compress_every, keep_mass=m,
                         min_budget=args.min_budget if m > 0 else 0).validate("bench")
            except ConfigError as err:
                flag = {"bench.keep_mass": "--keep-mass", "bench.min_budget": "--min-budget"}
                ap.error(f"{flag.get(err.key, '--budgets')}: {err}")
    if not (args.model / "config.json").is_file():
        ap.error(f"--model: no model at {args.model} (config.json missing)")
    if args.tail is not None and not 0.0 < args.tail < 1.0:
        ap.error(f"--tail: a quantile strictly between 0 and 1 (got {args.tail})")
    if args.bin_tokens < 1:
        ap.error(f"--bin-tokens: a positive width (got {args.bin_tokens})")
    from bench.attention import task_of

    try:  # which task: refused here, before any decode, if the model does not say
        task_of(args.model, args.task)
    except ValueError as err:
        ap.error(f"--model: {err}")
    rows = measure(args.model, budgets, args.n, args.samples, args.policy, args.compress_every,
                   max_new_tokens=args.max_new_tokens, seed=args.seed,
                   protect_prompt=args.protect_prompt, tail=args.tail, bin_tokens=args.bin_tokens,
                   task_name=args.task, keep_mass=shares, min_budget=args.min_budget)
    print(table(rows))
    if args.tail is not None:
        print(tail_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    from common.cpu_isa import pin_cpu_isa

    pin_cpu_isa()
    main()
