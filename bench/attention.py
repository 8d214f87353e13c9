"""How concentrated a base model's attention is, per position bin (issue 28).

    python bench/attention.py --model .cache/models/reasoning-base [--n 64] [--json PATH]
    python bench/attention.py --model .cache/models/tiny-base       # running_sum, for contrast

Decodes ``--n`` held-out prompts of the model's task greedily with a dense cache, then runs each
prompt + response once more through the model with eager attention and, for every query position
that predicts a response token (every layer and head), measures:

* ``top_share``: the share of its attention mass on its top ``--share`` (25%) of the keys it sees
  (positions 0..q; a uniform head would give 0.25);
* ``top_budget``: the share on its top ``--budget`` keys (default: ``--share`` of the mean
  sequence length, i.e. the KV budget that share of the sequence would give);
* ``far_mass``: the mass on keys more than ``--far`` positions back (default: the budget);
* ``sink_mass``, ``prompt_mass``: the mass on the first ``--sinks`` (4) keys and on the prompt's
  keys (the sinks included): how much of the far mass a policy that keeps the sinks or the
  prompt (``rollout.kv.protect_prompt``) would keep.

Figures are means over heads, layers and sequences, per bin of ``--bin`` query positions (absolute:
prompt included), plus the same per layer over all positions. The task is the one the model was
built for (its ``sft_metrics.json``), or trained on (a run's ``final/``), or ``--task``. ``--json
PATH`` also writes them as one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Run as a script, bench/ leads sys.path (bench/buffer.py would shadow the buffer package).
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [str(REPO)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def task_of(model_dir: Path, name: str | None):
    """The task the model was SFT'd on (``sft_metrics.json``), the one a run trained it on (a
    run's ``final/``: the run's ``config.yaml`` beside it), or the named one with defaults. A model
    that says neither, without a name, is refused (``ValueError``): guessing a task would measure
    the model on prompts it never saw."""
    from tasks import ReasoningConfig, TaskConfig, make_task

    metrics = model_dir / "sft_metrics.json"
    run_config = model_dir.parent / "config.yaml"
    if not metrics.is_file() and not name:
        if model_dir.name == "final" and run_config.is_file():
            from launch.config import load_config

            return make_task(load_config(["--config", str(run_config)], default=False).task)
        raise ValueError(f"{model_dir}: no sft_metrics.json says which task the model was built "
                         "for, and it is not a run's final/ beside the run's config.yaml: name the "
                         "task (--task)")
    saved = json.loads(metrics.read_text()).get("task", {}) if metrics.is_file() else {}
    if name and saved.get("name") != name:
        saved = {"name": name}
    reasoning = ReasoningConfig(**saved.pop("reasoning", {}))
    keep = {k: v for k, v in saved.items() if k in ("name", "seed", "n_train", "n_heldout",
                                                    "min_terms", "max_terms", "max_digit")}
    return make_task(TaskConfig(**keep, reasoning=reasoning))


METRICS = ("top_share", "top_budget", "far_mass", "sink_mass", "prompt_mass")


def concentration(attn, first_query: int, share: float, budget: int, far: int,
                  prompt_len: int = 0, sinks: int = 4) -> dict:
    """Per query position q >= first_query of one sequence, each a [layers, heads, queries]
    tensor, from ``attn`` = per layer [heads, T, T] weights: ``top_share`` (mass on the top
    ``share`` of the keys 0..q), ``top_budget`` (on the top ``budget`` keys), ``far_mass`` (on
    keys more than ``far`` back), ``sink_mass`` (on the first ``sinks`` keys), ``prompt_mass`` (on
    the first ``prompt_len`` keys, the sinks included)."""
    import torch

    a = torch.stack([x.float() for x in attn])                 # [L, H, T, T]
    t = a.shape[-1]
    q = torch.arange(first_query, t)
    rows = a[:, :, q, :]                                       # [L, H, Q, T]
    ranked = rows.sort(dim=-1, descending=True).values.cumsum(-1)
    seen = q + 1                                               # keys visible to each query
    k_share = torch.clamp(torch.ceil(share * seen).long(), min=1) - 1
    k_budget = torch.clamp(torch.minimum(torch.full_like(seen, budget), seen), min=1) - 1
    idx = lambda k: k.view(1, 1, -1, 1).expand(a.shape[0], a.shape[1], -1, 1)  # noqa: E731
    keys = torch.arange(t)
    far_mask = (q.view(-1, 1) - keys.view(1, -1)) > far         # [Q, T]
    return {"top_share": ranked.gather(-1, idx(k_share)).squeeze(-1),
            "top_budget": ranked.gather(-1, idx(k_budget)).squeeze(-1),
            "far_mass": (rows * far_mask).sum(-1),
            "sink_mass": rows[..., :sinks].sum(-1),
            "prompt_mass": rows[..., :prompt_len].sum(-1)}


def measure(model_dir: Path, task_name: str | None = None, n: int = 64, share: float = 0.25,
            budget: int | None = None, far: int | None = None, bin_tokens: int = 64,
            sinks: int = 4, log=print) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from common.modeling import HF_WEIGHTS, load_tokenizer
    from launch.make_base_model import greedy_responses

    task = task_of(model_dir, task_name)
    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **HF_WEIGHTS,
                                                 attn_implementation="eager").eval()
    problems = task.problems("heldout")[:n]
    max_new = max(len(task.solution(p.prompt)) for p in problems) + 16
    responses = greedy_responses(model, tok, [p.prompt for p in problems], max_new)
    acc = sum(task.reward(r, p.answer) for r, p in zip(responses, problems)) / len(problems)
    seqs = []
    for p, r in zip(problems, responses):
        ids = tok(p.prompt)["input_ids"]
        seqs.append((ids, ids + tok(r, add_special_tokens=False)["input_ids"]))
    mean_len = sum(len(s) for _, s in seqs) / len(seqs)
    budget = budget or max(1, round(share * mean_len))
    far = budget if far is None else far
    log(f"[attention] {model_dir}: {task.name}, {len(problems)} held-out prompts decoded dense "
        f"(greedy acc {acc:.3f}), mean sequence {mean_len:.1f} tokens; top {share:.0%} of keys, "
        f"top {budget} keys, mass beyond {far} back, on the first {sinks} keys, on the prompt")
    bins: dict[int, dict] = {}
    layers: list[dict] = []
    with torch.no_grad():
        for prompt_ids, ids in seqs:
            out = model(input_ids=torch.tensor([ids]), output_attentions=True)
            # query q predicts token q + 1: the response's tokens from len(prompt) - 1 on; the
            # last query would predict past the sequence
            m = concentration([x[0] for x in out.attentions], len(prompt_ids) - 1, share, budget,
                              far, len(prompt_ids), sinks)
            m = {k: v[..., :-1] for k, v in m.items()}
            nq = m["top_share"].shape[-1]
            while len(layers) < m["top_share"].shape[0]:
                layers.append({k: 0.0 for k in (*METRICS, "count")})
            for li, acc_l in enumerate(layers):
                for k in METRICS:
                    acc_l[k] += m[k][li].sum().item()
                acc_l["count"] += m["top_share"][li].numel()
            qbin = torch.arange(len(prompt_ids) - 1, len(prompt_ids) - 1 + nq) // bin_tokens
            for b in sorted(set(qbin.tolist())):
                sel = qbin == b
                row = bins.setdefault(b, {k: 0.0 for k in (*METRICS, "count", "queries")})
                for k in METRICS:
                    row[k] += m[k][..., sel].sum().item()
                row["count"] += m["top_share"][..., sel].numel()
                row["queries"] += int(sel.sum())
    mean = lambda r: {k: r[k] / r["count"] for k in METRICS}  # noqa: E731
    per_bin = [{"bin": f"{b * bin_tokens}-{(b + 1) * bin_tokens - 1}",
                "queries": int(r["queries"]), **mean(r)} for b, r in sorted(bins.items())]
    per_layer = [{"layer": i, **mean(r)} for i, r in enumerate(layers)]
    total = {k: sum(r[k] for r in layers) for k in (*METRICS, "count")}
    return {"model": str(model_dir), "task": task.name, "n": len(problems), "acc_dense": acc,
            "mean_seq_tokens": mean_len, "share": share, "budget": budget, "far": far,
            "sinks": sinks, "bin_tokens": bin_tokens, "all": mean(total), "per_bin": per_bin,
            "per_layer": per_layer}


def table(res: dict) -> str:
    heads = [f"top {res['share']:.0%} keys", f"top {res['budget']} keys",
             f"mass >{res['far']} back", f"mass on first {res['sinks']}", "mass on prompt"]
    cells = lambda r: " | ".join(f"{r[k]:.3f}" for k in METRICS)  # noqa: E731
    lines = ["| query positions | queries | " + " | ".join(heads) + " |",
             "|---|---|" + "---|" * len(heads)]
    lines += [f"| {r['bin']} | {r['queries']} | {cells(r)} |" for r in res["per_bin"]]
    lines.append(f"| all | | {cells(res['all'])} |")
    lines += ["", "| layer | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    lines += [f"| {r['layer']} | {cells(r)} |" for r in res["per_layer"]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/attention.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / ".cache/models/reasoning-base")
    ap.add_argument("--task", default=None, help="default: the task the model was built for")
    ap.add_argument("--n", type=int, default=64, help="held-out prompts")
    ap.add_argument("--share", type=float, default=0.25, help="top share of the keys seen")
    ap.add_argument("--budget", type=int, default=None,
                    help="top-k keys (default: --share of the mean sequence length)")
    ap.add_argument("--far", type=int, default=None, help="far_mass distance (default: budget)")
    ap.add_argument("--bin", type=int, default=64, help="query positions per bin")
    ap.add_argument("--sinks", type=int, default=4, help="first keys counted as sinks")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", metavar="PATH", help="write the figures as one JSON object")
    args = ap.parse_args(argv)
    if not 0 < args.share <= 1 or args.n < 1 or args.bin < 1:
        ap.error("--share in (0, 1], --n and --bin >= 1")
    try:  # which task: refused here, naming the model, if it does not say
        task_of(args.model, args.task)
    except ValueError as err:
        ap.error(f"--model: {err}")
    import torch

    torch.set_num_threads(args.threads)
    res = measure(args.model, args.task, args.n, args.share, args.budget, args.far, args.bin,
                  args.sinks)
    print(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    from common.cpu_isa import pin_cpu_isa

    pin_cpu_isa()
    sys.exit(main(sys.argv[1:]))
