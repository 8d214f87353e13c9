"""Dense vs naive sparse vs Sparse-RL, trained with the same seeds and step budget (issue 15).

    python bench/compare.py                          # budgets 48,16; 3 seeds; default.yaml's steps
    python bench/compare.py --quick --model DIR      # CI: 1 seed, 2 steps, budget 16, 8 problems
    python bench/compare.py --budgets 48,24,16 --seeds 0,1,2 --steps 40 -- run.eval_every=10
    python bench/compare.py --task reasoning --budgets 0.25,0.125   # budgets as shares

``--task``: ``running_sum`` (the default config and ``.cache/models/tiny-base``) or ``reasoning``
(``launch/configs/reasoning.yaml`` and ``.cache/models/reasoning-base``); without ``--model`` the
task's base model is built first when missing (``launch/make_base_model.py --task``). ``--budgets``
takes tokens (>= 1) or shares of the task's mean held-out sequence, prompt + gold response + EOS
(< 1; ``budget_share`` in the rows), resolved once before any run.

Arms (``ARMS``): ``dense`` (full-cache rollouts, no correction: the reference), ``naive_sparse``
(sparse rollouts at the budget, no correction), ``sparse_rl`` (sparse + the Sparse-RL correction),
and ``sparse_rl_dynamic`` / ``distill_sparse`` when the config has their keys (issue 14): an arm
whose key is absent is listed as missing in the report, never run under another name. ``tis``
(truncated IS alone, ``correction.tis``) runs only when ``--arms`` names it. Each (arm,
budget, seed) is one ``launch/train.py`` run (the dense arm trains once per seed; its rows repeat
per budget). The sparse arms evict with ``--policy`` (default R-KV, the paper's). The overrides
after ``--`` go to every run, except those setting a key only the dynamic re-planner reads
(``rollout.kv.threshold``, ``quantile``, ``replan_every``, ...: ``actors.config.REPLAN_KEYS``),
which a static run refuses: they go to the dynamic arm alone (refused when no arm has one).

After each run its ``final/`` model is decoded on the held-out problems (``--final-problems``; 1024
with ``--task reasoning``) twice, in this process: with
a dense cache (``acc_dense_decode``) and with the policy at the row's budget
(``acc_sparse_decode``): the paper's claim that sparse training makes the model robust to sparse
inference, measured for the dense-trained model too; the base model the same way (``acc_base``,
``acc_base_sparse``). ``kv_bytes_vs_dense``: peak KV bytes per sequence of the arm's rollout policy
over a dense cache on those problems (the policy at the row's single budget);
``rollout_kv_vs_dense``: the rollouts' own peak KV bytes per sequence during training
(``rollout/kv_bytes_per_seq``, the dynamic schedule's budgets) over the dense arm's;
``kv_budget_mean``: budget in force per response token; ``probe_p5_min_bin``: the worst position
bin's probe agreement p5 (arms with probes); ``rollout_s_vs_dense``: engine seconds generating a
step's rollouts (``time/rollout_gen_s``), mean over steps, over the dense arm's with the same seed;
``to_dense_acc_wall_s`` / ``to_dense_acc_rollout_s``: training seconds (``time/step_s``) and
rollout seconds summed up to the first evaluation at or above the same-seed dense run's final
``eval/accuracy`` (None: never reached).

Writes ``<out>/compare-<time>/``: ``compare.json`` (rows + missing arms + command + wall time),
``compare.md`` (mean and spread over seeds), ``compare.png`` (accuracy curves, final accuracies)
and ``report-b<budget>/`` (``launch/report.py`` over every run at that budget). ``--quick`` exits
non-zero unless every available arm ran and reported.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Run as a script, bench/ leads sys.path and `import buffer` (launch.config's) would find
# bench/buffer.py: drop that folder, put the repo first.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [str(REPO)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from common.cpu_isa import cpu_capability  # noqa: E402
from bench.compare_eval import aggregate, decode_accuracy, markdown, plot, run_stats  # noqa: E402

# The project modules this driver and bench/compare_eval import inside functions (the final
# decode, the reports). A comparison runs for hours: main imports them at its start, so an edit to
# the tree meanwhile cannot leave the driver holding two versions of the code (one such edit once
# stopped a run's final decode on an ImportError). tests/test_compare.py checks the list is whole.
LATE_IMPORTS = ("actors.config", "actors.rollout", "common.lora", "common.modeling",
                "launch.config", "launch.make_base_model", "launch.preflight", "launch.report",
                "tasks")


DYNAMIC = "rollout.kv.schedule=dynamic"   # the override that makes an arm's schedule dynamic


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...]      # key=value; "{budget}" and "{policy}" are filled in
    requires: str = ""              # a dotted config key the arm needs; absent -> reported missing
    sparse: bool = True             # trains with the budget (False: once per seed, every budget)
    default: bool = True            # run without --arms (False: only when --arms names it)


ARMS = (
    Arm("dense", ("rollout.kv.policy=dense", "correction.method=none"), sparse=False),
    Arm("naive_sparse", ("rollout.kv.policy={policy}", "rollout.kv.budget={budget}",
                         "correction.method=none")),
    Arm("sparse_rl", ("rollout.kv.policy={policy}", "rollout.kv.budget={budget}",
                      "correction.method=sparse_rl")),
    Arm("sparse_rl_dynamic", ("rollout.kv.policy={policy}", "rollout.kv.budget={budget}",
                              "correction.method=sparse_rl", DYNAMIC,
                              "rollout.kv.probe_share=0.125"),
        requires="rollout.kv.schedule"),
    Arm("distill_sparse", ("rollout.kv.policy={policy}", "rollout.kv.budget={budget}",
                           "correction.method=sparse_rl", "rollout.distill_sparse.enabled=true"),
        requires="rollout.distill_sparse"),
    # a comparator, not one of the arms: truncated IS alone (Yao et al. 2025), nothing
    # rejected or vetoed: what the Sparse-RL recipe's band and veto are measured against
    Arm("tis", ("rollout.kv.policy={policy}", "rollout.kv.budget={budget}",
                "correction.method=tis"), default=False),
    # issue 28's dynamic bar, a second design: Sparse-RL whose rows each keep an adaptive budget
    # under the static one (rollout.kv.keep_mass: --keep-mass, --min-budget-share)
    Arm("sparse_rl_adaptive", ("rollout.kv.policy={policy}", "rollout.kv.budget={budget}",
                               "correction.method=sparse_rl", "rollout.kv.keep_mass={keep_mass}",
                               "rollout.kv.min_budget={min_budget}"),
        requires="rollout.kv.keep_mass", default=False),
)

# --task: the preset every run starts from (None: launch/config.py's defaults)
TASK_PRESETS = {"running_sum": None, "reasoning": "launch/configs/reasoning.yaml"}

# The reasoning preset's runs evaluate 128 problems (binomial se ~0.044 a run, as large as the
# gaps between arms), so its final models are decoded on more (se ~0.015; docs/RESULTS.md)
REASONING_FINAL_PROBLEMS = 1024

# --quick: the e2e tests' few-second job (tests/conftest.py SMALL_JOB), 2 steps
QUICK = ("run.eval_problems=8", "run.prompts_per_step=4", "rollout.samples_per_prompt=4",
         "rollout.max_new_tokens=24", "rollout.kv.compress_every=4", "scorer.num_actors=1",
         "rollout.num_actors=1", "correction.loss.entropy_coef=0.01")


def has_key(dotted: str) -> bool:
    """Whether the config schema (the dataclasses) has ``dotted``: how a planned arm is detected."""
    from omegaconf import OmegaConf

    from launch.config import TrainConfig

    node = OmegaConf.structured(TrainConfig)
    for part in dotted.split("."):
        if not OmegaConf.is_dict(node) or part not in node:
            return False
        node = node[part]
    return True


def replan_overrides(overrides: list[str]) -> list[str]:
    """The overrides setting a key only the dynamic re-planner reads (``actors.config.
    REPLAN_KEYS``): a static run refuses them, so they go to the dynamic arm alone."""
    from actors.config import REPLAN_KEYS

    keys = {f"rollout.kv.{k}" for k in REPLAN_KEYS}
    return [o for o in overrides if o.split("=", 1)[0] in keys]


def plan(arms, budgets: list[int], seeds: list[int], policy: str = "rkv",
         replan: list[str] = (), keep_mass: float = 0.95, min_share: float = 0.5
         ) -> tuple[list[dict], list[dict]]:
    """(training jobs, missing arms). A job: {arm, budget (None for dense), seed, overrides};
    the sparse arms evict with ``policy``; arms with a dynamic schedule also get ``replan``; the
    adaptive arm keeps ``keep_mass`` of the window's attention, at least ``min_share`` of the
    budget."""
    jobs, missing = [], []
    for arm in arms:
        if arm.requires and not has_key(arm.requires):
            missing.append({"arm": arm.name, "reason": f"config key {arm.requires} does not exist "
                                                      "(issue 14 not merged)"})
            continue
        for seed in seeds:
            for budget in (budgets if arm.sparse else [None]):
                floor = max(1, round(budget * min_share)) if budget else 0
                ov = [o.format(budget=budget, policy=policy, keep_mass=keep_mass,
                               min_budget=floor) for o in arm.overrides]
                ov += list(replan) if DYNAMIC in arm.overrides else []
                jobs.append({"arm": arm.name, "budget": budget, "seed": seed, "overrides": ov})
    return jobs, missing


def run_settings(seed: int, name: str, runs_dir: Path | str) -> dict[str, object]:
    """The keys each run gets after the overrides (``train``): its seeds, name and folder."""
    return {"run.seed": seed, "rollout.seed": seed, "learner.seed": seed, "run.name": name,
            "run.out_dir": runs_dir, "run.progress": "false"}


def override_clashes(overrides: list[str], arms, steps: int | None = None) -> list[str]:
    """The overrides (after --) naming a key that a run sets after them: an arm's own overrides
    (e.g. ``correction.method``), the per-run keys (``run_settings``) and ``run.steps`` with
    ``--steps``. Each would be silently replaced, so ``parse`` refuses them by name."""
    set_by = {k: "every run" for k in run_settings(0, "", "")}
    if steps is not None:
        set_by["run.steps"] = "--steps"
    for arm in arms:
        for o in arm.overrides:
            set_by.setdefault(o.split("=", 1)[0], f"arm {arm.name}")
    keys = [o.split("=", 1)[0] for o in overrides]
    return [f"{k} (set by {set_by[k]})" for k in keys if k in set_by]


def train(job: dict, common: list[str], runs_dir: Path, log_dir: Path) -> dict:
    """One ``launch/train.py`` run; returns the job with ``run_dir`` (None on failure) and ``rc``."""
    name = f"{job['arm']}{'-b' + str(job['budget']) if job['budget'] else ''}-s{job['seed']}"
    seed = job["seed"]
    args = [sys.executable, str(REPO / "launch/train.py"), *common, *job["overrides"],
            *(f"{k}={v}" for k, v in run_settings(seed, name, runs_dir).items())]
    t0 = time.time()
    log = log_dir / f"{name}.log"
    with log.open("w") as f:
        rc = subprocess.run(args, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    found = sorted(runs_dir.glob(f"{name}-*"))
    ok = rc == 0 and found and (found[-1] / "final" / "config.json").is_file()
    print(f"[compare] {name}: {'ok' if ok else f'FAILED (rc {rc}, {log})'} "
          f"in {time.time() - t0:.0f} s", flush=True)
    return {**job, "name": name, "rc": rc, "log": str(log),
            "run_dir": str(found[-1]) if ok else None}


def rows_for(jobs: list[dict], budgets: list[int], model: Path, policy: str,
             shares: dict | None = None, problems: int | None = None) -> list[dict]:
    """One row per (arm, budget, seed) with the accuracies decoded dense and sparse (``policy``)
    on ``problems`` held-out problems (None: the runs' own evaluation set); ``shares``: budget ->
    the share of the mean sequence it was given as."""
    base = {b: decode_accuracy(model, _any_run(jobs), b, policy, problems) for b in budgets}
    dense_stats = {j["seed"]: run_stats(Path(j["run_dir"]))
                   for j in jobs if j["arm"] == "dense" and j["run_dir"]}
    target = {seed: st["curve"][-1][1] for seed, st in dense_stats.items() if st["curve"]}
    dense_roll = {s: st["rollout_s"] for s, st in dense_stats.items()}
    rows = []
    for job in jobs:
        if not job["run_dir"]:
            continue
        run = Path(job["run_dir"])
        stats = run_stats(run)
        for budget in ([job["budget"]] if job["budget"] else budgets):
            acc = decode_accuracy(run / "final", run, budget, policy, problems)
            kv = 1.0 if job["arm"] == "dense" else acc["sparse_kv_bytes"] / acc["dense_kv_bytes"]
            ref = dense_roll.get(job["seed"])
            wall, roll = time_to(stats, target.get(job["seed"]))
            rows.append({
                "arm": job["arm"], "budget": budget, "seed": job["seed"], "run_dir": str(run),
                "budget_share": (shares or {}).get(budget),
                "to_dense_acc_wall_s": wall, "to_dense_acc_rollout_s": roll,
                "acc_dense_decode": acc["dense"], "acc_sparse_decode": acc["sparse"],
                "acc_problems": acc["problems"],
                "acc_base": base[budget]["dense"], "acc_base_sparse": base[budget]["sparse"],
                **{k: v for k, v in stats.items() if k not in ("rollout_s", "seconds")},
                "kv_bytes_vs_dense": kv,
                "rollout_s_vs_dense": stats["rollout_s"] / ref if ref else None,
                "rollout_kv_vs_dense": _ratio(stats, dense_stats.get(job["seed"]),
                                              "rollout_kv_bytes")})
    return rows


def time_to(stats: dict, target: float | None) -> tuple[float | None, float | None]:
    """(training s, rollout s) summed up to the first evaluation with accuracy >= ``target``."""
    if target is None:
        return None, None
    step = next((s for s, acc in stats["curve"] if acc >= target), None)
    if step is None:
        return None, None
    upto = [t for s, t in stats["seconds"] if s <= step]
    return sum(w for w, _ in upto), sum(r for _, r in upto)


def _ratio(stats: dict, ref: dict | None, key: str) -> float | None:
    """stats[key] over the dense run's (same seed), when both were measured."""
    if not ref or not stats.get(key) or not ref.get(key):
        return None
    return stats[key] / ref[key]


def _any_run(jobs: list[dict]) -> Path:
    """A finished run whose config (task, eval problems) decodes the base model."""
    return next(Path(j["run_dir"]) for j in jobs if j["run_dir"])


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/compare.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI: 1 seed, 2 steps, budget 16")
    ap.add_argument("--task", default="running_sum", choices=sorted(TASK_PRESETS),
                    help="the task, its preset and its base model (default running_sum)")
    ap.add_argument("--budgets", default=None,
                    help="KV budgets, comma-separated: tokens (>= 1) or shares of the task's mean "
                         "sequence (< 1) (default 48,16; reasoning 0.25,0.125)")
    ap.add_argument("--seeds", default=None, help="seeds, comma-separated (default 0,1,2)")
    ap.add_argument("--steps", type=int, default=None, help="run.steps (default: the preset's)")
    ap.add_argument("--eval-every", type=int, default=None,
                    help="accuracy curve points (run.eval_every; default 5, --quick 1)")
    ap.add_argument("--model", type=Path, default=None,
                    help="base model (default: the task's, built when missing)")
    ap.add_argument("--out", type=Path, default=REPO / "runs")
    ap.add_argument("--parallel", type=int, default=1,
                    help="runs at once (on a cluster, or each on its own local Ray: their "
                         "seconds then share the machine; default 1)")
    ap.add_argument("--arms", default=None,
                    help="arms to run, comma-separated (default: all but tis; the dense arm is the "
                         "reference of the rollout-time and KV ratios)")
    from actors.config import KVPolicy

    ap.add_argument("--policy", default="rkv",
                    choices=[p.value for p in KVPolicy if p is not KVPolicy.dense],
                    help="the sparse arms' eviction policy, in training and in the sparse decode "
                         "(rollout.kv.policy; default rkv, the paper's)")
    ap.add_argument("--keep-mass", type=float, default=0.95,
                    help="the sparse_rl_adaptive arm's rollout.kv.keep_mass (default 0.95)")
    ap.add_argument("--min-budget-share", type=float, default=0.5,
                    help="its rollout.kv.min_budget as a share of each budget (default 0.5)")
    ap.add_argument("--final-problems", type=int, default=None,
                    help="held-out problems the final models are decoded on (default: the runs' "
                         f"own evaluation set; --task reasoning: {REASONING_FINAL_PROBLEMS})")
    ap.add_argument("overrides", nargs="*", help="key=value for every run (after --)")
    args = ap.parse_args(argv)
    quick = args.quick
    default = "16" if quick else ("0.25,0.125" if args.task == "reasoning" else "48,16")
    try:
        args.budgets = [float(b) if float(b) < 1 else int(b)
                        for b in (args.budgets or default).split(",")]
    except ValueError:
        ap.error(f"--budgets: tokens (integers >= 1) or shares (0 < x < 1), got {args.budgets!r}")
    args.seeds = [int(s) for s in (args.seeds or ("0" if quick else "0,1,2")).split(",")]
    if args.final_problems is None and args.task == "reasoning" and not quick:
        args.final_problems = REASONING_FINAL_PROBLEMS
    if args.final_problems is not None and args.final_problems < 1:
        ap.error(f"--final-problems: a positive count (got {args.final_problems})")
    if args.steps is None and quick:
        args.steps = 2
    if args.eval_every is None:
        args.eval_every = 1 if quick else 5
    if args.parallel < 1 or any(b <= 0 for b in args.budgets) or not args.seeds:
        ap.error("--parallel must be >= 1, --budgets > 0, and --seeds non-empty")
    args.build_model = args.model is None      # the task's default model: built when missing
    if args.model is None:
        from launch.make_base_model import TASK_DEFAULTS

        args.model = REPO / TASK_DEFAULTS[args.task]["out"]
    elif not (args.model / "config.json").is_file():
        ap.error(f"--model {args.model}: no model there (config.json missing)")
    names = [a.name for a in ARMS]
    args.arms = args.arms.split(",") if args.arms else [a.name for a in ARMS if a.default]
    if not args.arms or set(args.arms) - set(names):
        ap.error(f"--arms: names from {names}")
    if "sparse_rl_adaptive" in args.arms:
        from actors.config import ADAPTIVE_POLICIES

        if args.policy not in ADAPTIVE_POLICIES:
            ap.error(f"--policy {args.policy}: the sparse_rl_adaptive arm needs one of "
                     f"{[p.value for p in ADAPTIVE_POLICIES]} (it reads the observation "
                     "window's attention)")
        if not 0 < args.keep_mass < 1:
            ap.error(f"--keep-mass: a share strictly between 0 and 1 (got {args.keep_mass})")
        if not 0 < args.min_budget_share <= 1:
            ap.error(f"--min-budget-share: a share in (0, 1] (got {args.min_budget_share})")
    clashes = override_clashes(args.overrides, [a for a in ARMS if a.name in args.arms],
                               args.steps)
    if clashes:
        ap.error(f"overrides {', '.join(clashes)}: a run sets these after the overrides, so "
                 "they would be lost; drop them or choose the arm or option that sets them")
    args.replan = replan_overrides(args.overrides)
    if args.replan and not any(DYNAMIC in a.overrides for a in ARMS if a.name in args.arms):
        ap.error(f"overrides {', '.join(args.replan)}: only the dynamic schedule's re-planner "
                 f"reads them, and no arm in --arms ({','.join(args.arms)}) has one")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    for name in LATE_IMPORTS:
        importlib.import_module(name)
    t0 = time.time()
    out = args.out / f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
    (out / "logs").mkdir(parents=True)
    preset = TASK_PRESETS[args.task]
    common = [*(["--config", str(REPO / preset)] if preset else []),
              f"rollout.model_path={args.model}", f"run.eval_every={args.eval_every}",
              "run.checkpoint_every=0", *(QUICK if args.quick else ()),
              *(o for o in args.overrides if o not in args.replan)]
    if args.build_model:
        ensure_model(args.task, args.model)
    base = {"path": str(args.model), "sha256": weights_digest(args.model),
            "cpu_capability": cpu_capability()}
    print(f"[compare] base {base['path']}: weights sha256 {base['sha256']}, "
          f"{base['cpu_capability']} kernels", flush=True)
    args.budgets, shares = resolve_budgets(args.budgets, common)
    if args.steps is not None:
        common.append(f"run.steps={args.steps}")
    jobs, missing = plan([a for a in ARMS if a.name in args.arms], args.budgets, args.seeds,
                         args.policy, args.replan, args.keep_mass, args.min_budget_share)
    if args.replan:
        print(f"[compare] to the dynamic arm only: {' '.join(args.replan)}", flush=True)
    for m in missing:
        print(f"[compare] arm {m['arm']} missing: {m['reason']}", flush=True)
    with ThreadPoolExecutor(args.parallel) as pool:
        jobs = list(pool.map(lambda j: train(j, common, out / "runs", out / "logs"), jobs))
    finished = any(j["run_dir"] for j in jobs)
    rows = (rows_for(jobs, args.budgets, args.model, args.policy, shares, args.final_problems)
            if finished else [])
    failed = [{"arm": j["arm"], "budget": j["budget"], "seed": j["seed"], "log": j["log"]}
              for j in jobs if not j["run_dir"]]
    wall = round(time.time() - t0, 1)
    command = "python bench/compare.py " + " ".join(argv)
    result = {"command": command, "wall_s": wall, "budgets": args.budgets, "seeds": args.seeds,
              "policy": args.policy, "task": args.task, "budget_shares": shares, "base": base,
              "rows": rows, "summary": aggregate(rows), "missing": missing, "failed": failed}
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    (out / "compare.md").write_text(markdown(result))
    if rows:
        plot(rows, out / "compare.png")
        _reports(jobs, args.budgets, out)
    print((out / "compare.md").read_text())
    print(f"[compare] {out} ({wall:.0f} s)")
    ran = {r["arm"] for r in rows}
    expected = set(args.arms) - {m["arm"] for m in missing}
    if failed or ran != expected:
        print(f"[compare] arms without results: {sorted(expected - ran)}; failed: {failed}",
              file=sys.stderr)
        return 1
    return 0


def ensure_model(task: str, model: Path) -> None:
    """Build ``task``'s base model into ``model`` with make_base_model's defaults for the task;
    ``build`` itself leaves a complete directory alone."""
    from launch.make_base_model import build, parse_args

    build(parse_args(["--task", task, "--out", str(model)]))


def weights_digest(model: Path) -> str:
    """sha256 (16 hex digits) of ``model``'s weight files, in name order. Runs compare only on
    the same base, and rebuilding one with the same command and seed need not give the same
    weights (it did not on another machine and commit: docs/RESULTS.md), so the report names it."""
    files = sorted(model.glob("*.safetensors")) or sorted(model.glob("*.bin"))
    if not files:
        raise SystemExit(f"[compare] {model}: no *.safetensors or *.bin weight files")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def mean_sequence(common: list[str]) -> float:
    """Mean tokens of a held-out prompt + its gold response + EOS, for the runs' task config."""
    from common.modeling import load_tokenizer
    from launch.config import load_config
    from launch.make_base_model import encode_example
    from tasks import make_task

    cfg = load_config(common)
    task = make_task(cfg.task)
    tok = load_tokenizer(cfg.rollout.model_path)
    # the SFT encoding: prompt, gold response, EOS
    lens = [len(encode_example(tok, p.prompt, task.solution(p.prompt))[0])
            for p in task.problems("heldout")]
    return sum(lens) / len(lens)


def resolve_budgets(budgets: list, common: list[str]) -> tuple[list[int], dict]:
    """Token budgets, shares (< 1) of the mean sequence rounded; {tokens: share} for the shares."""
    if all(b >= 1 for b in budgets):
        return [int(b) for b in budgets], {}
    mean = mean_sequence(common)
    out, shares = [], {}
    for b in budgets:
        tokens = int(b) if b >= 1 else max(1, round(b * mean))
        if b < 1:
            shares[tokens] = b
            print(f"[compare] budget {b:g} of the mean {mean:.1f}-token sequence: {tokens} tokens",
                  flush=True)
        out.append(tokens)
    return out, shares


def _reports(jobs: list[dict], budgets: list[int], out: Path) -> None:
    """``launch/report.py`` over all runs of each budget (the dense runs in every one)."""
    from launch.report import render

    for b in budgets:
        sel = [j for j in jobs if j["run_dir"] and j["budget"] in (b, None)]
        if sel:
            render([Path(j["run_dir"]) for j in sel], out / f"report-b{b}",
                   [f"{j['arm']}-s{j['seed']}" for j in sel])


if __name__ == "__main__":
    from common.cpu_isa import pin_cpu_isa

    pin_cpu_isa()  # the training runs it starts pin themselves (launch/train.py)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sys.exit(main(sys.argv[1:]))
