"""Step 6e of ``launch/train.py`` for ``rollout.kv.schedule=dynamic``: every ``replan_every`` steps
the rollout actors' probes and the engine's cost model give the next KV budget per position bin
(``rollout.kv.planner``: the exact search or the table planner, ``schedule/plan.py``).
"""
from __future__ import annotations

import itertools


def replan_schedule(pools, cfg, step: int) -> dict:
    """``rollout.kv.schedule=dynamic``: every ``replan_every`` steps, the rollout actors' probes
    since the last re-plan and the engine's cost model give the next budget per bin
    (``rollout.kv.planner``: ``_search_schedule`` or ``_table_schedule``), sent to every rollout
    actor and kept in ``cfg.rollout.kv.budgets`` (so replacement actors and checkpoints carry
    it). Bins whose probes failed at the schedule in use raise ``rollout.kv.min_budgets`` first
    (``schedule.plan.raise_floors``), which both planners respect; with
    ``rollout.kv.verify_samples`` a schedule that lowers a bin is checked on its own samples
    before it is adopted (``_verify``). Returns the ``schedule/*`` metrics."""
    import ray

    from actors.config import KVObjective, KVPlanner, KVSchedule
    from schedule.cost import CostModel, bin_cost

    kv = cfg.rollout.kv
    if KVSchedule(kv.schedule) != KVSchedule.dynamic or step % kv.replan_every:
        return {}
    cost = CostModel.from_dict(ray.get(pools.rollout[0].kv_cost_model.remote()))

    def per_bin(counts: dict[int, int]):
        return bin_cost(KVObjective(kv.objective).value, cost, kv.bin_tokens, kv.compress_every,
                        cfg.rollout.batch_size, counts)

    exact = KVPlanner(kv.planner) == KVPlanner.exact
    found = (_search_schedule if exact else _table_schedule)(pools, kv, per_bin)
    if found is None:
        return {"schedule/replanned": 0}
    budgets, info, raised, cands = found
    out = {"schedule/replanned": 1, "schedule/unmet_bins": len(info["unmet_bins"]),
           "schedule/predicted_cost": info["predicted_cost"],
           "schedule/cost_error_step": cost.error.get("step", 0.0),
           "schedule/cost_error_compress": cost.error.get("compress", 0.0)}
    if kv.verify_samples:
        before = list(kv.min_budgets)
        budgets, checked = _verify(pools, kv, budgets, cands, step)
        raised += _rose(before, kv.min_budgets)
        out.update(checked)
    ray.get([a.set_budgets.remote(budgets) for a in pools.rollout])
    kv.budgets = list(budgets)
    out["schedule/raised_bins"] = raised
    if exact:
        out["schedule/replays"] = info["replays"]
    out.update({f"schedule/budget_bin{k}": b for k, b in enumerate(budgets)})
    out.update({f"schedule/min_budget_bin{k}": b for k, b in enumerate(kv.min_budgets) if b})
    return out


def _raise_floors(kv, realized: dict, candidates: list[int]) -> int:
    """``rollout.kv.min_budgets`` raised from the realised alphas at the schedule in use; returns
    how many bins' bounds rose."""
    from schedule.plan import raise_floors

    before = list(kv.min_budgets)
    kv.min_budgets = raise_floors(before, realized, kv.bin_budgets(), candidates, kv.threshold,
                                  kv.quantile)
    return _rose(before, kv.min_budgets)


def _rose(before: list[int], after: list[int]) -> int:
    """How many bins' bounds are higher in ``after``."""
    return sum(b > (before[k] if k < len(before) else 0) for k, b in enumerate(after))


# Seeds of the on-policy draws: apart from every rollout batch number (the rollouts' seeds).
_VERIFY_KEY = 10 ** 9


def _verify(pools, kv, proposed: list[int], cands: list[int], step: int) -> tuple[list, dict]:
    """``schedule.plan.verify``: ``rollout.kv.verify_samples`` sequences, split over the rollout
    actors, sampled under a proposal that lowers a bin below the schedule in use; the bounds it
    raises are kept in ``kv.min_budgets``. Returns (the schedule to adopt, its metrics)."""
    import ray

    from schedule.plan import VERIFY_ROUNDS, merge, verify

    actors, n = pools.rollout, int(kv.verify_samples)
    share = [n // len(actors) + (i < n % len(actors)) for i in range(len(actors))]
    draw = itertools.count(_VERIFY_KEY + step * VERIFY_ROUNDS)    # one seed key per draw

    def sample(schedule: list[int]) -> dict[int, list[float]]:
        key = next(draw)
        runs = ray.get([a.sample_probes.remote(schedule, k, key)
                        for a, k in zip(actors, share) if k])
        return merge([{0: r} for r in runs]).get(0, {})

    budgets, kv.min_budgets, info = verify(sample, proposed, kv.bin_budgets(), kv.min_budgets,
                                           cands, kv.threshold, quantile=kv.quantile)
    out = {"schedule/verify_rounds": info["rounds"], "schedule/verify_gave_way": info["gave_way"]}
    if info["tail"]:
        out["schedule/verify_tail_min"] = info["tail"][-1]
    return budgets, out


def _search_schedule(pools, kv, per_bin):
    """``planner=exact``: ``schedule.plan.search`` over the probe sequences the rollout actors
    kept, each candidate schedule replayed by every actor on its own; None without probes."""
    import ray

    from actors.probes import candidate_budgets
    from schedule.plan import merge, search

    summary = ray.get([a.probe_summary.remote() for a in pools.rollout])
    realized = merge([{0: s["realized"]} for s in summary]).get(0, {})
    counts: dict[int, int] = {}
    for s in summary:
        for k, n in s["counts"].items():
            counts[k] = counts.get(k, 0) + n

    def replay(schedules: list[list[int]]) -> list[dict]:
        runs = ray.get([a.replay_probes.remote(schedules) for a in pools.rollout])
        return [merge([{0: r[i]} for r in runs])[0] for i in range(len(schedules))]

    found = None
    if counts:
        cands = candidate_budgets(kv, max(s["longest"] for s in summary))
        raised = _raise_floors(kv, realized, cands)
        found = (*search(replay, cands, kv.bin_tokens, per_bin(counts), kv.threshold, kv.margin,
                         kv.min_budgets, kv.quantile), raised, cands)
    ray.get([a.take_probes.remote() for a in pools.rollout])     # done with them
    return found


def _table_schedule(pools, kv, per_bin):
    """``planner=table``: ``schedule.plan.plan`` over the actors' candidate-budget tables and
    the realised agreement at the schedule in use; None without probes."""
    import ray

    from schedule.plan import merge, plan

    probes = ray.get([a.take_probes.remote() for a in pools.rollout])
    table = merge([p["table"] for p in probes])
    if not table:
        return None
    realized = merge([{0: p["realized"]} for p in probes]).get(0, {})
    counts = {k: len(v) for k, v in next(iter(table.values())).items()}
    raised = _raise_floors(kv, realized, sorted(table))
    return (*plan(table, per_bin(counts), kv.threshold, kv.margin, realized, kv.bin_budgets(),
                  kv.min_budgets, kv.quantile), raised, sorted(table))
