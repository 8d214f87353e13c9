"""bench/compare.py's measurements: held-out accuracy decoded dense and sparse, per-run training
statistics from ``metrics.jsonl``, the mean/spread table, and the plots."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

# per-run training statistics: (row key, metrics.jsonl key, reduction over the training steps)
STATS = (("reward_last", "reward", "last"), ("agreement_mean", "mismatch/agreement_mean", "mean"),
         ("agreement_p5", "mismatch/agreement_p5", "mean"), ("k3", "mismatch/k3", "mean"),
         ("frac_rejected", "correction/frac_rejected", "mean"),
         ("frac_vetoed", "correction/frac_vetoed", "mean"),
         ("signal_dropped_pos", "correction/signal_dropped_pos", "mean"),
         ("signal_dropped_neg", "correction/signal_dropped_neg", "mean"),
         ("rollout_s", "time/rollout_gen_s", "mean"),
         ("rollout_kv_bytes", "rollout/kv_bytes_per_seq", "mean"),
         ("kv_budget_mean", "rollout/kv_budget_mean", "mean"),
         ("probe_p5_min_bin", "mismatch/probe_agreement_p5_min_bin", "mean"))
# compare.md columns, mean ± spread over seeds
COLUMNS = ("acc_dense_decode", "acc_sparse_decode", "acc_base", "acc_base_sparse", "reward_last",
           "agreement_mean", "agreement_p5", "k3", "frac_rejected", "frac_vetoed",
           "signal_dropped_pos", "signal_dropped_neg", "kv_bytes_vs_dense", "rollout_s_vs_dense",
           "rollout_kv_vs_dense", "kv_budget_mean",
           "probe_p5_min_bin", "to_dense_acc_wall_s", "to_dense_acc_rollout_s")


POLICY_NAMES = {"rkv": "R-KV", "h2o": "H2O", "snapkv": "SnapKV", "streaming": "StreamingLLM"}


def decode_accuracy(model_dir: Path, run_dir: Path, budget: int, policy: str = "rkv",
                    problems: int | None = None, sparse: bool = True,
                    overrides: list[str] = ()) -> dict:
    """Held-out accuracy of ``model_dir`` on ``run_dir``'s evaluation problems (its task,
    ``run.eval_problems``, ``run.eval_greedy``), decoded with a dense cache and with ``policy``
    (R-KV by default) at ``budget`` (the run's other KV settings; a DistillSparse run's sparse
    decode with the adapter saved beside the model), and the mean peak KV bytes per sequence of
    each. ``problems``: the first that many of a held-out split of that size instead (a synthetic
    task's held-out split never meets its train split, whatever its size); ``sparse=False``: the
    dense decode only (the sparse keys are None); ``overrides``: ``key=value`` items applied to
    the run's config first, as on train.py's command line (e.g. ``rollout.kv.compress_every=32``
    decodes a run at another compression interval than it trained with)."""
    from actors.config import KVPolicy
    from actors.rollout import RolloutActor
    from launch.config import load_config
    from launch.preflight import check_model, task_prompts
    from tasks import make_task

    cfg = load_config(["--config", str(Path(run_dir) / "config.yaml"), *overrides], default=False)
    cfg.rollout.model_path = str(model_dir)
    cfg.rollout.kv.policy, cfg.rollout.kv.budget = KVPolicy(policy), int(budget)
    if problems is not None:
        cfg.task.n_heldout = cfg.run.eval_problems = int(problems)
    _, encoder = check_model(cfg)
    _, evals, _ = task_prompts(make_task(cfg.task), encoder, cfg.run.eval_problems)
    actor = RolloutActor(cfg.rollout, cfg.task, model_path=str(model_dir))
    adapter = Path(model_dir) / "distill_sparse"   # DistillSparse: the sparse decode uses it
    if cfg.rollout.distill_sparse.enabled and adapter.is_dir():
        from common.lora import read_adapter

        actor.load_weights(list(read_adapter(adapter).items()), 0)
    dense = actor.evaluate(evals["heldout"], cfg.run.eval_greedy, dense=True)
    out = {"dense": dense["accuracy"], "dense_kv_bytes": dense["peak_kv_bytes"],
           "sparse": None, "sparse_kv_bytes": None, "problems": len(evals["heldout"])}
    if sparse:
        sp = actor.evaluate(evals["heldout"], cfg.run.eval_greedy, dense=False)
        out.update(sparse=sp["accuracy"], sparse_kv_bytes=sp["peak_kv_bytes"])
    return out


def run_stats(run_dir: Path, stats=STATS) -> dict:
    """``stats`` (default STATS) of one run (training records only) and its accuracy curve
    [(step, eval/accuracy)]."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "reward" in r]
    out = {}
    for name, key, how in stats:
        vals = [float(r[key]) for r in train if key in r]
        out[name] = (vals[-1] if how == "last" else sum(vals) / len(vals)) if vals else None
    curve = {int(r["step"]): r["eval/accuracy"] for r in records if "eval/accuracy" in r}
    out["curve"] = sorted(curve.items())
    # per training step: (step seconds, rollout seconds), for the time to an accuracy
    out["seconds"] = [(int(r["step"]), (float(r.get("time/step_s", 0.0)),
                                        float(r.get("time/rollout_gen_s", 0.0)))) for r in train]
    return out


def spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def aggregate(rows: list[dict]) -> list[dict]:
    """One entry per (arm, budget): mean and standard deviation over seeds of each COLUMN."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["arm"], r["budget"]), []).append(r)
    out = []
    for (arm, budget), rs in groups.items():
        entry = {"arm": arm, "budget": budget, "seeds": len(rs),
                 "budget_share": rs[0].get("budget_share"),
                 "reached_dense_acc": sum(r.get("to_dense_acc_wall_s") is not None for r in rs)}
        for c in COLUMNS:
            vals = [r[c] for r in rs if r.get(c) is not None]
            if vals:
                entry[c], entry[c + "_std"] = spread(vals)
        out.append(entry)
    return out


def markdown(result: dict) -> str:
    head = ["arm", "budget", "seeds", "acc dense-decode", "acc sparse-decode", "base (dense/sparse)",
            "reward last", "agree mean", "agree p5", "k3", "rejected", "vetoed",
            "signal dropped A>0 / A<0", "KV vs dense", "rollout KV vs dense", "rollout s vs dense",
            "to dense acc: runs, train s, rollout s"]
    lines = [f"# sparse-rl comparison\n\n`{result['command']}`: {result['wall_s']:.0f} s; budgets "
             f"{result['budgets']} tokens, seeds {result['seeds']}. Mean ± std over seeds."
             + (f" Base `{result['base']['path']}`, weights sha256 `{result['base']['sha256']}`."
                if result.get("base") else "") + "\n",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in result["summary"]:
        def cell(c, e=e):
            if c not in e:
                return "-"
            return f"{e[c]:.3f}" + (f" ± {e[c + '_std']:.3f}" if e["seeds"] > 1 else "")
        share = f" ({e['budget_share']:g})" if e.get("budget_share") else ""
        reach = (f"{e.get('reached_dense_acc', 0)}/{e['seeds']}, {cell('to_dense_acc_wall_s')}, "
                 f"{cell('to_dense_acc_rollout_s')}")
        lines.append("| " + " | ".join([
            e["arm"], f"{e['budget']}{share}", str(e["seeds"]), cell("acc_dense_decode"),
            cell("acc_sparse_decode"), f"{cell('acc_base')} / {cell('acc_base_sparse')}",
            *(cell(c) for c in ("reward_last", "agreement_mean", "agreement_p5", "k3",
                                "frac_rejected", "frac_vetoed")),
            f"{cell('signal_dropped_pos')} / {cell('signal_dropped_neg')}",
            *(cell(c) for c in ("kv_bytes_vs_dense", "rollout_kv_vs_dense",
                                "rollout_s_vs_dense")), reach]) + " |")
    policy = POLICY_NAMES.get(result.get("policy", "rkv"), result.get("policy"))
    counts = sorted({r["acc_problems"] for r in result.get("rows", []) if r.get("acc_problems")})
    on = f" on {', '.join(map(str, counts))} held-out problems" if counts else ""
    lines.append(f"\nacc: held-out accuracy{on} of the trained model decoded with a dense cache / "
                 f"with {policy} at the budget (the dense arm's one model is decoded at every "
                 "budget). KV vs dense: peak KV bytes per sequence of the arm's rollout policy "
                 "over a dense cache; rollout KV: the training rollouts' own, over the dense "
                 "arm's. agreement, k3, rejected, vetoed: means over training steps; signal "
                 "dropped: the share of |advantage| x tokens that rejection and veto take out "
                 "of the loss, for rows with a positive / negative advantage (step mean). To "
                 "dense acc: runs whose "
                 "evaluation reached the same-seed dense run's final accuracy, and the training "
                 "and rollout seconds to get there (mean over those runs). A budget in brackets: "
                 "the share of the mean sequence it was given as.")
    for m in result["missing"]:
        lines.append(f"\n- missing arm `{m['arm']}`: {m['reason']}")
    for f in result["failed"]:
        lines.append(f"\n- FAILED `{f['arm']}` budget {f['budget']} seed {f['seed']}: {f['log']}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> Path:
    """Per budget: held-out accuracy (dense decode) vs step, mean over seeds, one line per arm;
    and final accuracy decoded dense and sparse per arm (bars, std as error bars)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({r["budget"] for r in rows})
    fig, axes = plt.subplots(2, len(budgets), figsize=(6 * len(budgets), 8), squeeze=False,
                             constrained_layout=True)
    titles = []
    for col, b in enumerate(budgets):
        sel = [r for r in rows if r["budget"] == b]
        arms = list(dict.fromkeys(r["arm"] for r in sel))
        ax = axes[0][col]
        for arm in arms:
            curves = [dict(run_stats(Path(r["run_dir"]))["curve"]) for r in sel if r["arm"] == arm]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            ax.plot(steps, [statistics.fmean(c[s] for c in curves) for s in steps], marker=".",
                    label=arm)
        ax.set_title(f"held-out accuracy (dense decode), budget {b}")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax = axes[1][col]
        for k, (key, label) in enumerate((("acc_dense_decode", "dense decode"),
                                          ("acc_sparse_decode", f"sparse {b} decode"))):
            stats = [spread([r[key] for r in sel if r["arm"] == a]) for a in arms]
            ax.bar([i + 0.4 * k for i in range(len(arms))], [m for m, _ in stats], 0.4,
                   yerr=[s for _, s in stats], label=label)
        ax.set_xticks([i + 0.2 for i in range(len(arms))], arms, rotation=20, fontsize=8)
        ax.set_title(f"final accuracy, budget {b}")
        ax.legend(fontsize=8)
        titles += [axes[0][col].get_title(), ax.get_title()]
    fig.savefig(path, dpi=80, metadata={"Description": json.dumps({"panels": titles})})
    plt.close(fig)
    return path
