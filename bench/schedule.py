"""Dynamic KV budget schedule vs the best static budget (issue 14), tiny base on the default task.

    python bench/schedule.py --quick                      # ~3 min on the 2-core machine
    python bench/schedule.py --json runs/bench_schedule.json --threshold 0.86
    python bench/schedule.py --task reasoning --protect-prompt --bin-tokens 32   # issue 28's task

``--task`` picks the prompts, the response length and the default model and candidate budgets
(``TASKS``): ``running_sum`` on ``.cache/models/tiny-base``, ``reasoning`` on its own base
(``launch/make_base_model.py --task reasoning``) at 12.5-100% of its mean ~359-token sequence.

Calibration: responses sampled (temperature 1, the dense cache) for training prompts are replayed
teacher-forced through the R-KV engine at each candidate budget and through the dense cache; the
exact per-token agreement alpha = 1 - TV gives the probe table budget x position bin -> alphas
(``actors.probes``). ``static``: the smallest single budget whose 5th percentile of alpha passes
``--threshold`` (+ ``--margin``) in every bin. ``dynamic``: the ``--planner``'s schedule with the
engine's measured cost model (``schedule.cost``, cached under ``.cache/cost_models``): ``exact``
(default) ``schedule.plan.search``, replaying the calibration sequences at candidate schedules,
growing ones included; ``table``: ``schedule.plan.plan`` over the same table (non-increasing).
Both are then judged on held-out prompts (fresh sampled responses, replayed at the chosen budgets):
``agreement_p5_min_bin`` (the worst bin's p5), ``agreement_mean``; ``mean_budget`` (budget in force
at each response token, averaged); ``kv_bytes_vs_dense`` (peak KV bytes per sequence when
generating with the schedule, over the dense cache's), ``kv_slots_vs_dense`` (KV slots a decode
step holds over what a dense cache holds for the same sequence, averaged over response tokens:
what a schedule saves over the whole generation, not only at its peak) and
``tok_per_s_vs_dense`` (same prompts, same seed, best of ``--repeat``). ``dynamic-speed`` minimises
predicted decode time, ``dynamic-memory`` KV slots held. ``static-heldout-best`` (when it differs):
the smallest single budget passing on the held-out prompts themselves, the bar's reference (a
dynamic schedule passes held-out at a smaller mean budget than the best static one that does).
``distill`` rows: the same schedules picked and judged for the sparse sampler base + a DistillSparse
adapter (a peft folder, ``--adapter <run>/final/distill_sparse``, or one trained here,
``--distill-steps N``, with ``bench/distill.py``'s ``train_adapter``), its agreement measured
against the dense *base* model.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, bench/ leads sys.path and this file would shadow the ``schedule`` package:
# drop that folder, put the repo first.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [str(ROOT)] + [p for p in sys.path if str(Path(p or ".").resolve()) != _HERE]

from actors.config import KVConfig, KVPolicy  # noqa: E402
from actors.engine import SamplingParams  # noqa: E402
from actors.native import NativeEngine  # noqa: E402
from actors.probes import agreement  # noqa: E402
from schedule.cost import bin_cost, load_or_measure  # noqa: E402
from schedule.plan import bin_alphas, bin_stats, mean_budget, plan, pooled, search  # noqa: E402

# --task: (default model, response tokens sampled, default candidate budgets). reasoning: 12.5,
# 25, 37.5, 50 and 75% of its mean sequence, and 416, which never compresses its longest one
TASKS = {"running_sum": (".cache/models/tiny-base", 80, tuple(range(16, 97, 8))),
         "reasoning": (".cache/models/reasoning-base", 384, (45, 90, 135, 180, 270, 416))}

COLUMNS = ("schedule", "distill", "budgets", "mean_budget", "kv_bytes_vs_dense",
           "kv_slots_vs_dense", "tok_per_s_vs_dense", "agreement_p5_min_bin", "agreement_mean",
           "worst_bin", "passes")


def sequences(engine, tok, problems, samples: int, seed: int, max_new: int):
    prompts = [tok(p.prompt)["input_ids"] for p in problems for _ in range(samples)]
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=seed,
                            stop_token_ids=(tok.eos_token_id,))
    outs = engine.generate(prompts, params)
    keep = [o for o in outs if o.response_ids]
    return [o.prompt_ids for o in keep], [o.response_ids for o in keep], params


def replayer(engine, prompts, responses, params, width, reference=None):
    """``replay(schedules)`` for ``schedule.plan.search``: alphas by bin at each schedule."""
    plens = [len(p) for p in prompts]

    def replay(schedules):
        runs = agreement(engine, prompts, responses, params, 16, schedules, reference)
        return [bin_alphas(plens, a, width) for a in runs]
    return replay


def table_for(engine, prompts, responses, params, budgets, width, reference=None):
    runs = replayer(engine, prompts, responses, params, width, reference)([[b] for b in budgets])
    return dict(zip(budgets, runs))


def judge(engine, dense, schedule, held, params, width, repeat: int, reference=None) -> dict:
    prompts, responses = held[0], held[1]
    engine.set_budgets(schedule)
    by_bin = bin_alphas([len(p) for p in prompts],
                        agreement(engine, prompts, responses, params, 16, reference=reference),
                        width)
    stats = bin_stats(by_bin)
    judged = bin_stats(pooled(by_bin)[0])   # bins of too few tokens join the bin before them
    worst = min(judged, key=lambda k: judged[k]["p5"])
    alphas = [x for v in by_bin.values() for x in v]
    speed, kv, slots = {}, {}, {}
    for name, eng in (("dense", dense), ("sparse", engine)):
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            outs = eng.generate(prompts, params)
            best = min(best, time.perf_counter() - t0)
        speed[name] = sum(len(o.response_ids) for o in outs) / best
        kv[name] = sum(o.peak_kv_bytes for o in outs) / len(outs)
        # kept / seen slots of each sequence's own decode steps, weighted by its tokens
        slots[name] = (sum(o.kept_ratio * len(o.response_ids) for o in outs)
                       / max(1, sum(len(o.response_ids) for o in outs)))
    return {"budgets": list(schedule),
            "mean_budget": mean_budget(schedule, {k: len(v) for k, v in by_bin.items()}),
            "kv_bytes_vs_dense": kv["sparse"] / kv["dense"],
            "kv_slots_vs_dense": slots["sparse"] / slots["dense"],
            "tok_per_s_vs_dense": speed["sparse"] / speed["dense"],
            "agreement_p5_min_bin": judged[worst]["p5"], "agreement_mean": sum(alphas) / len(alphas),
            "worst_bin": worst, "per_bin": {k: round(v["p5"], 4) for k, v in stats.items()}}


def passes(by_bin: dict, threshold: float) -> bool:
    """Every bin's p5 >= threshold (bins of too few tokens pooled, ``schedule.plan.pooled``)."""
    return all(s["p5"] >= threshold for s in bin_stats(pooled(by_bin)[0]).values())


def pick(table, replay, budgets: list[int], cost, a) -> dict[str, list[int]]:
    """The schedules to judge: the smallest single budget passing every bin of the calibration
    table (at ``--threshold`` + ``--margin``), and the ``--planner``'s schedule with each
    objective (``schedule.plan.search`` replaying calibration sequences, or ``plan`` over the
    table)."""
    passing = [b for b in budgets if passes(table[b], a.threshold + a.margin)]
    plans = {"static": [passing[0] if passing else budgets[-1]]}
    counts = {k: len(v) for k, v in table[budgets[0]].items()}
    for objective in ("speed", "memory"):
        per_bin = bin_cost(objective, cost, a.bin_tokens, a.compress_every, 64, counts)
        if a.planner == "exact":
            plans[f"dynamic-{objective}"], info = search(replay, budgets, a.bin_tokens, per_bin,
                                                         a.threshold, a.margin)
        else:
            plans[f"dynamic-{objective}"], info = plan(table, per_bin, a.threshold, a.margin)
        print(f"[schedule] dynamic ({objective}): {plans[f'dynamic-{objective}']} "
              f"(unmet bins {info['unmet_bins']})")
    print(f"[schedule] cost model held-out error: step {cost.error['step']:.3f}, compress "
          f"{cost.error['compress']:.3f}; static {plans['static']} (passing: {passing})")
    return plans


def verdicts(rows: list[dict], threshold: float) -> None:
    """``passes`` per row; the bar per dynamic row: it passes held-out at a smaller mean budget
    than the best static row that passes."""
    rows = [r for r in rows if "missing" not in r]
    for r in rows:
        r["passes"] = r["agreement_p5_min_bin"] >= threshold
    best = min((r for r in rows if r["schedule"].startswith("static") and r["passes"] and
                not r["distill"]), key=lambda r: r["mean_budget"], default=None)
    for r in rows:
        if r["schedule"].startswith("dynamic"):
            bar = r["passes"] and best is not None and r["mean_budget"] < best["mean_budget"]
            # the KV a schedule actually holds: budgets that never bind lower the mean budget
            # without evicting anything
            less = best is not None and r["kv_slots_vs_dense"] < best["kv_slots_vs_dense"] - 1e-3
            print(f"[schedule] bar {r['schedule']}{' + distill' if r['distill'] else ''}: "
                  f"held-out min-bin p5 "
                  f"{r['agreement_p5_min_bin']:.3f} (>= {threshold}: {r['passes']}), mean budget "
                  f"{r['mean_budget']:.1f} vs best passing static "
                  f"{best and best['mean_budget']}: {'PASS' if bar else 'FAIL'}; KV slots held "
                  f"{r['kv_slots_vs_dense']:.3f} vs {best and round(best['kv_slots_vs_dense'], 3)}"
                  f" of dense: {'fewer' if less else 'not fewer'}")


def report(rows: list[dict], a, cost) -> None:
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for r in rows:
        print("| " + " | ".join(_fmt(r.get(c, r.get("missing", "-") if c == "budgets" else "-"))
                                for c in COLUMNS) + " |")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"rows": rows, "task": a.task, "threshold": a.threshold,
                                            "margin": a.margin, "planner": a.planner,
                                            "cost_error": cost.error, "argv": sys.argv}, indent=1))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="running_sum", choices=sorted(TASKS),
                    help="prompts, response length, default --model and --budgets (TASKS)")
    ap.add_argument("--model", default="", help="a local HF folder (default: the task's base)")
    ap.add_argument("--quick", action="store_true", help="16 prompts per split (~1.5 min)")
    ap.add_argument("--prompts", type=int, default=0,
                    help="prompts per split, 4 samples each (default 48, --quick 16)")
    ap.add_argument("--max-new-tokens", type=int, default=0,
                    help="response tokens sampled (default: the task's, TASKS)")
    ap.add_argument("--threshold", type=float, default=0.86)
    ap.add_argument("--margin", type=float, default=0.0,
                    help="added to the threshold when picking on calibration (rollout.kv.margin)")
    ap.add_argument("--planner", default="exact", choices=["exact", "table"],
                    help="the dynamic rows' planner (rollout.kv.planner)")
    ap.add_argument("--bin-tokens", type=int, default=16)
    ap.add_argument("--compress-every", type=int, default=16)
    ap.add_argument("--budgets", default="",
                    help="candidate budgets (default: the task's, TASKS; running_sum: 16..96 "
                         "step 8)")
    ap.add_argument("--policy", default="rkv",
                    choices=[p.value for p in KVPolicy if p is not KVPolicy.dense],
                    help="eviction policy replayed at each budget (default rkv)")
    ap.add_argument("--protect-prompt", action="store_true")
    ap.add_argument("--adapter", default="",
                    help="a DistillSparse adapter (peft folder, e.g. <run>/final/distill_sparse)")
    ap.add_argument("--distill-steps", type=int, default=0,
                    help="else train one here for N steps (bench/distill.py); 0 and no --adapter: "
                         "the distill rows are reported missing")
    ap.add_argument("--distill-budget", type=int, default=32, help="budget it trains at")
    ap.add_argument("--distill-kl-coef", type=float, default=0.001)
    ap.add_argument("--distill-lr", type=float, default=1e-3)
    ap.add_argument("--distill-divergence", default="k3", choices=["k3", "tv"],
                    help="the adapter's divergence term (rollout.distill_sparse.divergence)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    if a.adapter and a.distill_steps:
        ap.error("--adapter and --distill-steps: one adapter, loaded or trained")
    if a.distill_steps and a.task != "running_sum":
        ap.error(f"--distill-steps trains on running_sum's sampler (bench/distill.py); with --task "
                 f"{a.task} pass a trained adapter: --adapter <run>/final/distill_sparse")
    default_model, max_new, default_budgets = TASKS[a.task]
    max_new = a.max_new_tokens or max_new
    a.model = a.model or str(ROOT / default_model)
    torch.set_num_threads(1)
    from common.modeling import load_model, load_tokenizer
    from tasks import make_task
    from tasks.config import TaskConfig

    model, tok = load_model(a.model), load_tokenizer(a.model)
    task = make_task(TaskConfig(name=a.task))
    n = a.prompts or (16 if a.quick else 48)
    kv = KVConfig(policy=KVPolicy(a.policy), budget=48, compress_every=a.compress_every,
                  obs_window=8, bin_tokens=a.bin_tokens, protect_prompt=a.protect_prompt)
    engine, dense = NativeEngine(model, kv, 64), NativeEngine(model, KVConfig(), 64)
    calib = sequences(dense, tok, task.problems("train")[:n], 4, seed=1, max_new=max_new)
    held = sequences(dense, tok, task.problems("heldout")[:n], 4, seed=2, max_new=max_new)
    params = calib[2]
    budgets = [int(b) for b in a.budgets.split(",")] if a.budgets else list(default_budgets)
    t0 = time.time()
    table = base_table = table_for(engine, calib[0], calib[1], params, budgets, a.bin_tokens)
    print(f"[schedule] probe table: {len(budgets)} budgets x {len(calib[0])} sequences "
          f"in {time.time() - t0:.0f} s")
    for b in budgets:
        stats = bin_stats(table[b])
        print(f"  budget {b:3d}: " + " ".join(f"bin{k} p5={s['p5']:.3f}" for k, s in stats.items()))
    cost = load_or_measure(engine, a.model, ROOT / ".cache/cost_models")
    plans = pick(table, replayer(engine, calib[0], calib[1], params, a.bin_tokens), budgets,
                 cost, a)
    rows = []
    for name, sched in plans.items():
        rows.append({"schedule": name, "distill": False,
                     **judge(engine, dense, sched, held, params, a.bin_tokens, a.repeat)})
    # the bar's reference: the smallest single budget that passes on the held-out prompts
    held_table = table_for(engine, held[0], held[1], params, budgets, a.bin_tokens)
    held_ok = [b for b in budgets if passes(held_table[b], a.threshold)]
    best = held_ok[0] if held_ok else None
    if best is not None and best not in [r["budgets"] for r in rows]:
        rows.append({"schedule": "static-heldout-best", "distill": False,
                     **judge(engine, dense, [best], held, params, a.bin_tokens, a.repeat)})
    rows += distill_rows(model, a, task, kv, dense, calib, held, params, budgets, base_table, cost)
    verdicts(rows, a.threshold)
    report(rows, a, cost)
    return rows


def distill_rows(model, a, task, kv, dense, calib, held, params, budgets, base_table, cost):
    """The schedules picked and judged as in ``main`` for the sampler base + a DistillSparse
    adapter, measured against the dense base model; rows marked missing without an adapter."""
    rows = []
    sampler = distill_sampler(model, a, task)
    if sampler is None:
        for name in ("static", "dynamic-speed", "dynamic-memory"):
            rows.append({"schedule": name, "distill": True,
                         "missing": "no DistillSparse adapter (--adapter or --distill-steps)"})
    else:  # the same procedure for base + adapter, measured against the dense base model
        eng = NativeEngine(sampler, kv, 64)
        table = table_for(eng, calib[0], calib[1], params, budgets, a.bin_tokens, model)
        replay = replayer(eng, calib[0], calib[1], params, a.bin_tokens, model)
        for name, sched in pick(table, replay, budgets, cost, a).items():
            rows.append({"schedule": name, "distill": True, **judge(
                eng, dense, sched, held, params, a.bin_tokens, a.repeat, reference=model)})
        for b in budgets:
            print(f"  distill budget {b:3d}: " + " ".join(
                f"bin{k} p5={s['p5']:.3f}" for k, s in bin_stats(table[b]).items()))
        worst = {name: {b: min(s["p5"] for s in bin_stats(pooled(t[b])[0]).values())
                        for b in budgets} for name, t in (("base", base_table), ("distill", table))}
        raised = [b for b in budgets if worst["distill"][b] > worst["base"][b]]
        print(f"[schedule] bar distill (min-bin p5 at a fixed budget raised): at "
              f"{len(raised)} of {len(budgets)} budgets {raised}; at {a.distill_budget}: "
              f"{worst['base'].get(a.distill_budget, float('nan')):.3f} -> "
              f"{worst['distill'].get(a.distill_budget, float('nan')):.3f}")
    return rows


def distill_sampler(model, a, task):
    """A copy of ``model`` with a DistillSparse adapter merged in (``--adapter`` or trained for
    ``--distill-steps``), or None without one."""
    import copy

    from actors.config import DistillSparseConfig
    from common import lora

    if a.adapter:
        conf = json.loads((Path(a.adapter) / "adapter_config.json").read_text())
        lcfg = DistillSparseConfig(rank=int(conf["r"]), alpha=float(conf["lora_alpha"]),
                                   target_modules=sorted(conf["target_modules"]))
        tensors = lora.read_adapter(a.adapter)
    elif a.distill_steps:
        from bench.distill import rollout_config, train_adapter

        lcfg = DistillSparseConfig(lr=a.distill_lr, kl_coef=a.distill_kl_coef,
                                   divergence=a.distill_divergence)
        # trained under the sampler the rows measure: the same policy, cadence and prompt rule
        cfg = rollout_config(a.model, a.distill_budget, policy=a.policy,
                             compress_every=a.compress_every, distill=lcfg,
                             protect_prompt=a.protect_prompt)
        t0 = time.time()
        tensors, _ = train_adapter(cfg, task.problems("train"), a.distill_steps, log=None)
        print(f"[schedule] DistillSparse adapter: {a.distill_steps} steps at budget "
              f"{a.distill_budget} in {time.time() - t0:.0f} s")
    else:
        return None
    sampler = copy.deepcopy(model)
    lora.merge(sampler, model, tensors, lcfg)
    return sampler


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    from common.cpu_isa import pin_cpu_isa

    pin_cpu_isa()
    main()
