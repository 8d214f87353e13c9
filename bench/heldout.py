"""Trained runs re-scored on a larger held-out set: arm means with their evaluation noise
(issue 28).

    python bench/heldout.py --group dense 'runs/compare-*/runs/dense-s*' \\
        --group sparse_rl 'runs/compare-*/runs/sparse_rl-b90-s*' --problems 1024 [--sparse 90] \\
        [--base .cache/models/reasoning-base] [--json PATH]

A run's own evaluation scores ``run.eval_problems`` held-out problems (128 in the reasoning
preset): at an accuracy near 0.5 one greedy evaluation then has a binomial standard error of
sqrt(p (1 - p) / n) = 0.044, as large as the gaps between arms it is asked to rank. This bench
decodes each run's ``final/`` model (``bench/compare_eval.decode_accuracy``, dense cache, greedy as
the run's config says) on the first ``--problems`` problems of a held-out split of that size (a
synthetic task's held-out split is set aside by a hash of the prompt, so it never meets the train
split whatever its size) and reports, per group: the runs, their accuracies, mean and spread over
runs, the binomial standard error of one run's figure (``se_run``) and of the group mean
(``se_mean``: evaluation noise only; the spread over seeds adds the training noise), beside the
runs' own last evaluation (``acc_own_eval``). ``--sparse B`` also decodes with the run's eviction
policy at budget B; ``--base`` adds the base model, scored with the first run's config.
``--set key=value`` (repeatable) changes every run's config for these decodes, as on train.py's
command line: e.g. ``--set rollout.kv.compress_every=32 --set rollout.kv.protect_prompt=true``
decodes dense-trained runs, and the base, sparse at another compression interval than they ran.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Run as a script, bench/ leads sys.path (bench/buffer.py would shadow the buffer package).
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [str(REPO)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def binomial_se(p: float, n: int) -> float:
    """Standard error of an accuracy p measured on n independent problems."""
    return math.sqrt(p * (1.0 - p) / n) if n > 0 else float("nan")


def summarize(label: str, accs: list[float], problems: int, own: list | None = None) -> dict:
    """One group's row: per-run accuracies, mean, spread, evaluation standard errors."""
    from bench.compare_eval import spread

    mean, std = spread(accs)
    return {"group": label, "runs": len(accs), "accs": accs, "mean": mean, "std": std,
            "problems": problems,
            "se_run": binomial_se(mean, problems),
            "se_mean": binomial_se(mean, problems) / math.sqrt(len(accs)),
            "acc_own_eval": own or []}


def run_config(run: Path, overrides: list[str] = ()):
    """A run's config with the ``--set`` overrides applied."""
    from launch.config import load_config

    return load_config(["--config", str(run / "config.yaml"), *overrides], default=False)


def score_group(label: str, runs: list[Path], problems: int, sparse: int | None,
                overrides: list[str] = ()) -> dict:
    from bench.compare_eval import decode_accuracy, run_stats

    dense, sp, own = [], [], []
    for run in runs:
        cfg = run_config(run, overrides)
        policy = cfg.rollout.kv.policy.value if cfg.rollout.kv.policy.value != "dense" else "rkv"
        acc = decode_accuracy(run / "final", run, sparse or cfg.rollout.kv.budget, policy,
                              problems=problems, sparse=sparse is not None, overrides=overrides)
        dense.append(acc["dense"])
        sp.append(acc["sparse"])
        curve = run_stats(run)["curve"]                 # the run's own evaluations
        own.append(curve[-1][1] if curve else None)
        print(f"[heldout] {label} {run.name}: dense {acc['dense']:.4f}"
              + (f", sparse {acc['sparse']:.4f}" if sparse else ""), flush=True)
    row = summarize(label, dense, problems, own)
    row["runs_dirs"] = [str(r) for r in runs]
    if sparse:
        row["sparse"] = summarize(label, sp, problems)
    return row


def base_row(model: Path, run: Path, problems: int, sparse: int | None,
             overrides: list[str] = ()) -> dict:
    """The base model's row, scored with ``run``'s config (its budget unless ``sparse``)."""
    from bench.compare_eval import decode_accuracy

    budget = sparse or run_config(run, overrides).rollout.kv.budget
    acc = decode_accuracy(model, run, budget, "rkv", problems=problems, sparse=sparse is not None,
                          overrides=overrides)
    row = summarize("base", [acc["dense"]], problems)
    if sparse:
        row["sparse"] = summarize("base", [acc["sparse"]], problems)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| group | runs | acc (dense decode) | per run | se of one run / of the mean | "
             "acc sparse decode | runs' own eval |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        sp = r.get("sparse")
        sparse = f"{sp['mean']:.3f} ± {sp['std']:.3f}" if sp else "–"
        own = ", ".join(f"{a:.3f}" for a in r["acc_own_eval"] if a is not None) or "–"
        lines.append(f"| {r['group']} | {r['runs']} | {r['mean']:.3f} ± {r['std']:.3f} | "
                     + ", ".join(f"{a:.3f}" for a in r["accs"])
                     + f" | {r['se_run']:.3f} / {r['se_mean']:.3f} | {sparse} | {own} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group", nargs=2, action="append", metavar=("LABEL", "GLOB"), required=True,
                    help="a label and a glob of run directories (each with final/ and config.yaml)")
    ap.add_argument("--problems", type=int, default=1024, help="held-out problems per model")
    ap.add_argument("--sparse", type=int, default=None,
                    help="also decode with each run's eviction policy at this budget")
    ap.add_argument("--base", type=Path, default=None, help="also score this base model")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every decode (repeatable), e.g. "
                         "rollout.kv.compress_every=32")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.problems < 1:
        ap.error(f"--problems: a positive count (got {args.problems})")
    groups = []
    for label, pattern in args.group:
        runs = sorted(Path(p) for p in glob.glob(pattern))
        bad = [str(r) for r in runs
               if not ((r / "final").is_dir() and (r / "config.yaml").is_file())]
        if not runs or bad:
            ap.error(f"--group {label} {pattern!r}: " + (f"these lack final/ or config.yaml: {bad}"
                                                         if bad else "matches nothing"))
        groups.append((label, runs))
    from common.errors import ConfigError

    try:  # a bad --set stops here, naming the item, before any decode
        run_config(groups[0][1][0], args.set)
    except ConfigError as err:
        ap.error(f"--set: {err}")
    rows = [score_group(label, runs, args.problems, args.sparse, args.set)
            for label, runs in groups]
    if args.base:
        rows.insert(0, base_row(args.base, groups[0][1][0], args.problems, args.sparse, args.set))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"command": sys.argv, "problems": args.problems,
                                         "sparse_budget": args.sparse, "overrides": args.set,
                                         "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    from common.cpu_isa import pin_cpu_isa

    pin_cpu_isa()
    main()
