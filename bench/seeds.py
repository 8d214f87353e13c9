"""Several ``bench/compare.py`` results pooled over seeds: each arm's share of dense with its
standard error, and how many seeds a bar needs (issue 28).

    python bench/seeds.py runs/compare-A runs/compare-B/compare.json ... [--seeds 0,1,2] \\
        [--bar 0.97] [--key acc_dense_decode] [--json PATH]

One comparison is often run as several ``compare.py`` calls (a seed or an arm at a time). This
reads their ``compare.json`` files and groups the rows by (eviction policy, arm, budget, the
overrides after ``--`` in the command): the same arm run under two designs, e.g. with
``rollout.kv.protect_prompt`` true and false, is two groups. The dense arm trains once per seed
and never evicts (its rows repeat per budget), so dense rows are keyed by seed alone and are
every group's reference (overrides in another order are the same design). The same (policy,
arm, budget, overrides, seed) in two inputs is refused, naming both, as is a dense seed whose
two inputs disagree: which run counts is the caller's choice, made by the inputs given.
``--seeds`` keeps those seeds only.

Per group, over the seeds ``s`` that have both the arm and dense (values ``a_s``, ``d_s`` of
``--key``, the final model decoded dense on the comparison's held-out problems by default):

* ``share`` = mean(a) / mean(d), the bars' reading (share of dense's mean over the same seeds);
* ``share_se``: its standard error by the ratio estimator's first-order (delta) expansion,
  sd(a_s - share * d_s) / (sqrt(n) * mean(d)). Pairing by seed is in it: a seed that is good
  for dense and the arm alike moves a and d together and adds nothing. Both the training noise
  (seed to seed) and the evaluation noise of each figure are in the spread it is computed from;
* ``seed_shares``: a_s / d_s per seed;
* ``seeds_for_bar``: with ``--bar`` and n >= 2, the seeds at which, at this spread, the share
  would sit two standard errors from the bar, n * (2 * share_se / |share - bar|)^2 rounded up
  (a planning figure: it assumes the spread measured from these few seeds holds);
* from its runs' ``metrics.jsonl``, means over runs and steps: the rollout KV against a dense
  cache of the same rows (``rollout/kv_vs_dense``, peak bytes per sequence, the KV the bars are
  read on) and ``kept_ratio`` (time-averaged: tokens kept over tokens seen, mean over decode
  steps, which credits a schedule that holds less early in a sequence); and the ``--``
  overrides of the commands its rows came from (a table column when the groups differ).

Writes a markdown table to stdout and, with ``--json``, the groups as a list of objects.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Run as a script, bench/ leads sys.path (bench/buffer.py would shadow the buffer package).
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [str(REPO)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from bench.compare_eval import run_stats  # noqa: E402

REFERENCE = "dense"
# the KV figures of a group, from its runs' metrics.jsonl (self-contained: each step's rollouts
# against a dense cache of the same rows, so no dense run of the same compare call is needed)
KV_STATS = (("rollout_kv_vs_dense", "rollout/kv_vs_dense", "mean"),
            ("kept_ratio", "kept_ratio", "mean"))


def load(paths: list[str]) -> list[dict]:
    """Rows of the ``compare.json`` files (a file, or a ``compare-*`` directory holding one), each
    with its source file, eviction policy and the overrides after ``--`` in its command (sorted,
    so one design has one spelling)."""
    rows = []
    for p in paths:
        path = Path(p) / "compare.json" if Path(p).is_dir() else Path(p)
        if not path.is_file():
            raise SystemExit(f"bench/seeds.py: no compare.json at {p}")
        doc = json.loads(path.read_text())
        if "rows" not in doc:
            raise SystemExit(f"bench/seeds.py: {path} has no 'rows' (not a compare.py result)")
        cmd = doc.get("command", "")
        # a design is its set of overrides: the same ones in another order are the same design
        overrides = " ".join(sorted(cmd.split(" -- ", 1)[1].split())) if " -- " in cmd else ""
        for r in doc["rows"]:
            rows.append(r | {"source": str(path), "policy": doc.get("policy", "rkv"),
                             "overrides": overrides})
    return rows


def index(rows: list[dict], key: str, seeds: set[int] | None) -> tuple[dict, dict]:
    """``(dense by seed, {(policy, arm, budget, overrides): {seed: row}})``; refuses
    duplicates. Dense never evicts, so one dense run a seed serves every design."""
    dense, groups = {}, {}
    for r in rows:
        if seeds is not None and r["seed"] not in seeds:
            continue
        if r.get(key) is None:
            raise SystemExit(f"bench/seeds.py: {r['source']}: arm {r['arm']} seed {r['seed']} "
                             f"has no {key!r}")
        if r["arm"] == REFERENCE:
            old = dense.get(r["seed"])
            if old is not None and old[key] != r[key]:
                raise SystemExit(f"bench/seeds.py: dense seed {r['seed']} twice, {old[key]} in "
                                 f"{old['source']} and {r[key]} in {r['source']}; give one")
            dense[r["seed"]] = r
            continue
        # runs of another design (other overrides) are another group, not a duplicate
        g = groups.setdefault((r["policy"], r["arm"], r["budget"], r["overrides"]), {})
        if r["seed"] in g:
            raise SystemExit(f"bench/seeds.py: {r['policy']} {r['arm']} budget {r['budget']} "
                             f"seed {r['seed']} twice: {g[r['seed']]['source']} and "
                             f"{r['source']}; give one")
        g[r["seed"]] = r
    return dense, groups


def share_stats(a: list[float], d: list[float], bar: float | None = None) -> dict:
    """Share of dense over paired seeds, its delta-method standard error, per-seed shares and
    the seeds a ``bar`` needs (module docstring)."""
    n = len(a)
    ma, md = statistics.fmean(a), statistics.fmean(d)
    share = ma / md
    se = (statistics.stdev([x - share * y for x, y in zip(a, d)]) / (math.sqrt(n) * md)
          if n > 1 else None)
    need = None
    if bar is not None and se is not None and share != bar:
        need = max(1, math.ceil(n * (2.0 * se / abs(share - bar)) ** 2))
    return {"n": n, "mean": ma, "dense_mean": md, "share": share, "share_se": se,
            "seed_shares": [x / y for x, y in zip(a, d)], "seeds_for_bar": need}


def pool(rows: list[dict], key: str = "acc_dense_decode", seeds: set[int] | None = None,
         bar: float | None = None) -> list[dict]:
    """One record per (policy, arm, budget, overrides) with the paired statistics, dense
    first."""
    dense, groups = index(rows, key, seeds)
    out = []
    if dense:
        out.append({"policy": None, "arm": REFERENCE, "budget": None, "seeds": sorted(dense),
                    **_values([dense[s][key] for s in sorted(dense)]),
                    "overrides": sorted({dense[s]["overrides"] for s in dense})})
    for (policy, arm, budget, overrides), g in sorted(groups.items(), key=lambda kv: str(kv[0])):
        both = sorted(s for s in g if s in dense)
        rec = {"policy": policy, "arm": arm, "budget": budget, "seeds": sorted(g),
               **_values([g[s][key] for s in sorted(g)]), "paired_seeds": both,
               "overrides": [overrides],   # the group's key: one design a group
               **_kv([g[s] for s in sorted(g)])}
        if both:
            paired = share_stats([g[s][key] for s in both], [dense[s][key] for s in both], bar)
            rec |= {k: v for k, v in paired.items() if k != "mean"}
        out.append(rec)
    return out


def _values(vals: list[float]) -> dict:
    """The values, their mean and sample standard deviation (None for a single value)."""
    return {"values": vals, "mean": statistics.fmean(vals),
            "sd": statistics.stdev(vals) if len(vals) > 1 else None}


def _kv(rows: list[dict]) -> dict:
    """Mean over the group's runs of each run's ``KV_STATS`` (``compare_eval.run_stats``); None
    when no run's ``metrics.jsonl`` is at its ``run_dir``."""
    runs = [run_stats(Path(r["run_dir"]), KV_STATS) for r in rows
            if r.get("run_dir") and (Path(r["run_dir"]) / "metrics.jsonl").is_file()]
    means = {}
    for name, _, _ in KV_STATS:
        vals = [st[name] for st in runs if st[name] is not None]
        means[name] = statistics.fmean(vals) if vals else None
    return means


def markdown(groups: list[dict], key: str, bar: float | None) -> str:
    """The groups as a table; a last column names each group's overrides when they differ (the
    same arm under two designs is two rows)."""
    f = lambda v, spec=".3f": "" if v is None else format(v, spec)  # noqa: E731
    differ = len({o for g in groups for o in g["overrides"]}) > 1
    head = ["policy", "arm", "budget", "seeds", key, "mean ± sd", "dense mean (same seeds)",
            "share of dense", "± se", "per-seed shares", f"seeds for ±2 se at {bar}",
            "rollout KV (peak)", "kept (time-avg)", *(["overrides"] if differ else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        cells = [g["policy"] or "", g["arm"], "" if g["budget"] is None else str(g["budget"]),
                 ",".join(map(str, g["seeds"])), " ".join(f(v) for v in g["values"]),
                 f(g["mean"]) + ("" if g["sd"] is None else f" ± {f(g['sd'])}"),
                 f(g.get("dense_mean")), f(g.get("share"), ".1%"), f(g.get("share_se"), ".1%"),
                 " / ".join(f(v, ".1%") for v in g.get("seed_shares", [])),
                 "" if g.get("seeds_for_bar") is None else str(g["seeds_for_bar"]),
                 f(g.get("rollout_kv_vs_dense")), f(g.get("kept_ratio")),
                 *(["; ".join(f"`{o}`" for o in g["overrides"])] if differ else [])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="compare.json files or compare-* directories")
    ap.add_argument("--key", default="acc_dense_decode",
                    help="the row figure pooled (default: final model decoded dense)")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds to keep (default: all)")
    ap.add_argument("--bar", type=float, default=None, help="a share of dense, e.g. 0.97")
    ap.add_argument("--json", default=None, help="write the groups here")
    args = ap.parse_args(argv)
    try:
        seeds = None if args.seeds is None else {int(s) for s in args.seeds.split(",")}
    except ValueError:
        ap.error(f"--seeds: comma-separated integers, got {args.seeds!r}")
    if args.bar is not None and not 0 < args.bar:
        ap.error(f"--bar: a positive share of dense, got {args.bar}")
    groups = pool(load(args.inputs), args.key, seeds, args.bar)
    if not any(g["arm"] == REFERENCE for g in groups):
        print("bench/seeds.py: no dense rows among the inputs: shares cannot be computed",
              file=sys.stderr)
    print(markdown(groups, args.key, args.bar))
    if args.json:
        Path(args.json).write_text(json.dumps(groups, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
