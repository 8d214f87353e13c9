"""Steps 5 and 7 of ``launch/train.py`` (and ``run.eval_every``): held-out accuracy over the rollout
actors, decoded dense (or with the rollout KV policy), one bar per set on a terminal.
"""
from __future__ import annotations

from launch.rollouts import launch


def evaluate_sets(rollout_actors: list, sets: dict[str, list], greedy: bool,
                  progress: bool = False) -> dict[str, float]:
    """Accuracy on each evaluation set (``launch.preflight.task_prompts``): ``eval/accuracy`` for
    the task's held-out problems, ``eval/<name>/accuracy`` for each of ``task.eval_sets``.
    ``progress``: a bar per set on a terminal (``launch.observe.progress_on``)."""
    return {("eval/accuracy" if name == "heldout" else f"eval/{name}/accuracy"):
            evaluate(rollout_actors, problems, greedy, progress=progress, desc=f"eval {name}")
            for name, problems in sets.items()}


def accuracy_before(state: dict, rollout_actors: list, sets: dict[str, list], greedy: bool,
                    log) -> float:
    """Step 5: held-out accuracy before RL, logged (``log``: ``launch.metrics.MetricsLog``) and
    printed as step 0. A resumed run returns its checkpoint's ``accuracy_before`` and evaluates
    nothing, so its before/after pair stays the first run's."""
    if state.get("accuracy_before") is not None:
        return state["accuracy_before"]
    before = evaluate_sets(rollout_actors, sets, greedy, log.progress)
    print(f"[eval] step 0: {before} ({len(sets['heldout'])} held-out problems)")
    log.write({"step": 0, **before})
    return before["eval/accuracy"]


def evaluate(rollout_actors: list, problems: list, greedy: bool, *, dense: bool = True,
             progress: bool = False, desc: str = "eval") -> float:
    """Held-out accuracy over all actors (weighted by how many problems each scored); decoded
    with a dense cache, or with the rollout KV policy when ``dense=False``. The bar advances as
    each actor's share comes back (the shares are not split further: that would change the
    sampling seeds, and so the accuracy, of sampled evaluation)."""
    import ray

    from launch.observe import bar

    refs = launch(rollout_actors, "evaluate", problems, greedy, dense)
    pbar, results = bar(len(problems), desc, progress), []
    while refs:
        done, refs = ray.wait(refs, num_returns=1)
        results.append(ray.get(done[0]))
        if pbar is not None:
            pbar.update(results[-1]["num_problems"])
    if pbar is not None:
        pbar.close()
    total = sum(r["num_problems"] for r in results)
    return sum(r["accuracy"] * r["num_problems"] for r in results) / max(total, 1)
