"""Choosing a KV budget per position bin from probes (pure and deterministic).

The statistic is Sparrow's: the 5th percentile of alpha in a bin (``correction.metrics.
sparrow_tail``; another quantile with ``rollout.kv.quantile``) over probe tokens (bin = position
// bin_tokens, prompt included); a schedule passes a bin when it is >= threshold + margin. Two
planners (``rollout.kv.planner``):

``search`` (exact): bins are decided in order. For bin k every candidate budget b is tried as
``chosen[:k] + [b] + [top, top, ...]`` (``top``: the largest candidate, which evicts least) by
replaying the probes at that schedule, and b is admissible when every bin still passes (a bin that
fails even at ``top`` everywhere: when it does no worse than there). Eviction cannot be undone, so
only a replay of the whole prefix certifies a later bin; a budget in bin k changes nothing before
it, and keeping ``top`` after it leaves every later bin a passing choice (the one just verified),
so the search never dead-ends. Schedules may grow with position, as Sparrow's do; a budget that
never binds on the probes is then raised to the next bin's (``_lift_idle``). A bin with too
few probe tokens for a 5th percentile (``pooled``) is judged with the bin before it and never gets
a smaller budget than that bin (its own few tokens would hide among the other bin's). Cost: one
replay per (bin, candidate that can evict in that bin).

``plan`` (table): one replay per candidate budget at every position gives a table
``{budget: {bin: [alpha, ...]}}``. A table entry measures a bin under one budget at every earlier
position; a bin whose earlier bins ran with *smaller* budgets sees a poorer cache than the table
says, so the table only certifies non-increasing schedules (with earlier budgets at least as large
the bin sees a superset-chosen cache, for which the table is conservative). The realised per-bin p5
of probes at the schedule in use is fed back: a bin that failed there rules out its current budget
and every smaller one.

Both minimise ``cost(bin, budget) -> seconds`` (``schedule.cost``) among passing schedules:
``search`` bin by bin, ``plan`` summed over bins (a dynamic programme from the last bin); ties go
to the smaller budgets.

Both also take per-bin lower bounds (``floors``, ``rollout.kv.min_budgets``) that the driver raises
over a run from how the schedule in use did (``raise_floors``): probes replayed at a candidate were
sampled under the previous schedule, and a smaller budget's own samples can go where dense
disagrees more than those replays show, so a bin that fails at the schedule in use is not given
the budget it failed with again. ``verify`` checks, before it is adopted, a schedule that lowers a
bin below the one in use on sequences sampled under it (on-policy), raising the bounds where
they fail.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from correction.metrics import SPARROW_QUANTILE, sparrow_tail


def min_tokens(quantile: float) -> int:
    """The fewest alphas a bin is judged on alone at ``quantile``: a q-quantile of fewer than 1/q
    values is just their minimum, so a bin with fewer probe tokens (the long tail of lengths) is
    pooled with the bin before it (``pooled``)."""
    return round(1 / quantile)


MIN_BIN_TOKENS = min_tokens(SPARROW_QUANTILE)


def pooled(by_bin: dict[int, list[float]], min_tokens: int = MIN_BIN_TOKENS
           ) -> tuple[dict[int, list[float]], dict[int, int]]:
    """Bins with fewer than ``min_tokens`` alphas joined to the nearest earlier bin that keeps its
    own (the first bins stay as they are until one has enough). Returns (pooled alphas by bin,
    {merged bin: the bin it joined})."""
    out: dict[int, list[float]] = {}
    joined: dict[int, int] = {}
    last = None
    for k in sorted(by_bin):
        if len(by_bin[k]) < min_tokens and last is not None:
            out[last] = out[last] + list(by_bin[k])
            joined[k] = last
        else:
            out[k] = list(by_bin[k])
            last = k
    return out, joined


def tail(alphas: list[float], quantile: float = SPARROW_QUANTILE) -> float:
    """The tail statistic of one bin's alphas, their ``quantile``-quantile (Sparrow's: the 5th
    percentile; ``rollout.kv.quantile``); 1.0 for none."""
    t = torch.tensor(alphas, dtype=torch.float64)
    return sparrow_tail(t, torch.ones_like(t, dtype=torch.bool), quantile)


def bin_alphas(prompt_lens: list[int], alphas: list[list[float]], bin_tokens: int
               ) -> dict[int, list[float]]:
    """Per-token alphas of response tokens grouped by the bin of their absolute position."""
    out: dict[int, list[float]] = {}
    for plen, row in zip(prompt_lens, alphas):
        for t, a in enumerate(row):
            out.setdefault((plen + t) // bin_tokens, []).append(float(a))
    return out


def bin_stats(by_bin: dict[int, list[float]]) -> dict[int, dict[str, float]]:
    """{bin: {p5, mean, tokens}} of grouped alphas."""
    return {k: {"p5": tail(v), "mean": sum(v) / len(v), "tokens": len(v)}
            for k, v in sorted(by_bin.items()) if v}


def merge(tables: list[dict]) -> dict[int, dict[int, list[float]]]:
    """Union of probe tables (several actors, several steps): alphas concatenated per cell, in
    the given order (deterministic for a deterministic order)."""
    out: dict[int, dict[int, list[float]]] = {}
    for table in tables:
        for budget, by_bin in table.items():
            cell = out.setdefault(int(budget), {})
            for k, v in by_bin.items():
                cell.setdefault(int(k), []).extend(v)
    return out


def plan(table: dict[int, dict[int, list[float]]], cost: Callable[[int, int], float],
         threshold: float, margin: float = 0.0, realized: dict[int, list[float]] | None = None,
         current: list[int] | None = None, floors: list[int] | None = None,
         quantile: float = SPARROW_QUANTILE) -> tuple[list[int], dict]:
    """The cheapest non-increasing budget per bin whose probe tail (the ``quantile``-quantile of
    alpha; Sparrow's p5 by default) passes every probed bin.

    ``realized``: {bin: alphas} of probes at the ``current`` schedule; a bin below ``threshold``
    there excludes budgets <= its current one; ``floors[k]`` excludes budgets below it in bin k.
    Bins with fewer than ``min_tokens(quantile)`` alphas are judged pooled with the bin before
    them and get at least that bin's budget. Returns (budgets per bin, trailing repeats dropped;
    info: per-bin lower bounds, bins where nothing passed, the schedule's summed cost)."""
    budgets = sorted(table)
    if not budgets:
        raise ValueError("plan: empty probe table")
    nbins = max(k for cells in table.values() for k in cells) + 1
    few = min_tokens(quantile)
    joined = pooled(table[budgets[0]], few)[1]   # every budget replays the same probe tokens
    table = {b: pooled(cells, few)[0] for b, cells in table.items()}
    realized, rjoined = pooled(realized or {}, few)
    bins = sorted({k for cells in table.values() for k in cells})
    need = threshold + margin
    floor = {}
    for k in bins:
        ok = [b for b in budgets if k in table[b] and tail(table[b][k], quantile) >= need]
        if current is not None and k in realized and tail(realized[k], quantile) < threshold:
            now = _at(current, k)
            ok = [b for b in ok if b > now]
        floor[k] = ok[0] if ok else budgets[-1]
    unmet = [k for k in bins if floor[k] == budgets[-1] and
             not tail(table[budgets[-1]].get(k, [1.0]), quantile) >= need]
    for k, bound in enumerate(floors or []):
        if bound > budgets[0]:      # the smallest candidate at or above the bound
            floor[k] = max(floor.get(k, budgets[0]), _at_least(budgets, bound))
    for k, target in (joined | rjoined).items():   # a pooled bin is certified with its target
        floor[k] = max(floor.get(k, budgets[0]), floor.get(target, budgets[0]))
    # best[b] = (cost of bins k.. with budget b in bin k, their budgets); from the last bin down
    best: dict[int, tuple[float, list[int]]] = {}
    for k in range(nbins - 1, -1, -1):
        nxt, best = best, {}
        for b in budgets:
            if b < floor.get(k, budgets[0]):
                continue
            tails = [cs for bb, cs in nxt.items() if bb <= b] if k < nbins - 1 else [(0.0, [])]
            if not tails:
                continue
            rest = min(tails, key=lambda cs: (cs[0], cs[1]))
            best[b] = (cost(k, b) + rest[0], [b] + rest[1])
    total, schedule = min(best.values(), key=lambda cs: (cs[0], cs[1]))
    schedule = _trimmed(_bounded(schedule, floors, budgets))
    return schedule, {"floor": floor, "unmet_bins": unmet, "predicted_cost": total}


def _bounded(schedule: list[int], floors: list[int] | None, cands: list[int]) -> list[int]:
    """``schedule`` with every bin at least its bound (the smallest candidate at or above it),
    bins past the schedule's end included (its last budget holds there). The probes of one batch
    need not reach every bin a bound was set for; there the budget is raised without a replay,
    which only keeps more."""
    floors = floors or []
    n = max(len(schedule), len(floors))
    return [max(_at(schedule, k),
                _at_least(cands, floors[k]) if k < len(floors) else 0) for k in range(n)]


def _at(schedule: list[int], k: int) -> int:
    """The budget ``schedule`` gives bin ``k`` (its last budget holds on past its end)."""
    return schedule[min(k, len(schedule) - 1)]


def _at_least(cands: list[int], bound: int) -> int:
    """The smallest of the sorted ``cands`` at or above ``bound`` (the largest if none is)."""
    return next((c for c in cands if c >= bound), cands[-1])


def search(replay: Callable[[list[list[int]]], list[dict[int, list[float]]]],
           candidates: list[int], bin_tokens: int, cost: Callable[[int, int], float],
           threshold: float, margin: float = 0.0, floors: list[int] | None = None,
           quantile: float = SPARROW_QUANTILE) -> tuple[list[int], dict]:
    """The exact planner (module docstring). ``replay(schedules)``: for each schedule (budget per
    bin), the probes' alphas grouped by bin; ``floors[k]``: no budget below it in bin k;
    ``quantile``: the tail statistic's (Sparrow's p5 by default). Returns
    (budgets per bin, trailing repeats dropped; info: bins that fail even at ``top``, the
    schedule's summed cost, replays run)."""
    cands = sorted({int(b) for b in candidates})
    if not cands:
        raise ValueError("search: no candidate budgets")
    top, need, few = cands[-1], threshold + margin, min_tokens(quantile)

    def judged(by_bin: dict[int, list[float]]) -> dict[int, float]:
        return {k: tail(v, quantile) for k, v in pooled(by_bin, few)[0].items()}

    first = judged(at_top := replay([[top]])[0])
    joined = pooled(at_top, few)[1]      # every schedule replays the same probe tokens
    nbins = max(at_top, default=-1) + 1
    unmet = sorted(k for k, v in first.items() if v < need)
    # a bin that fails even at ``top`` must do no worse than there
    target = {k: min(v, need) for k, v in first.items()}
    chosen, replays, last = [], 1, {}
    for k in range(nbins):
        # budgets that can evict in bin k, and the smallest that cannot (a row there holds fewer
        # than (k + 1) * bin_tokens tokens): larger ones replay identically
        end = (k + 1) * bin_tokens
        opts = [b for b in cands if b < end] + [b for b in cands if b >= end][:1]
        floor = (floors or [])[k] if k < len(floors or []) else 0
        if k in joined:     # too few tokens to judge alone: never below the bin it is judged with
            floor = max(floor, chosen[joined[k]])
        if floor:
            opts = sorted({b for b in opts if b >= floor} |
                          {_at_least(cands, floor)})
        runs = replay([chosen + [b] + [top] * (nbins - k - 1) for b in opts])
        replays += len(opts)
        ok = [b for b, r in zip(opts, runs) if all(v >= target[j] for j, v in judged(r).items())]
        chosen.append(min(ok or [top], key=lambda b: (cost(k, b), b)))
        last = dict(zip(opts, runs))
    # the last bin's run of the chosen budget is the whole chosen schedule's (nothing after it)
    chosen, lifts = _lift_idle(replay, chosen, last.get(chosen[-1]) if chosen else None)
    chosen = _trimmed(_bounded(chosen or [top], floors, cands))
    total = sum(cost(k, _at(chosen, k)) for k in range(nbins))
    return chosen or [top], {"unmet_bins": unmet, "predicted_cost": total,
                             "replays": replays + lifts}


def _lift_idle(replay, chosen: list[int], ref: dict | None) -> tuple[list[int], int]:
    """A small budget that never binds on the probes (no row fills it plus ``compress_every``
    within its bin) ties in cost with the larger ones and would be listed, misleadingly, as the
    bin's budget. From the last bin down, each budget below the next bin's is raised to it when
    the probes replay identically (``ref``: their alphas at ``chosen``, replayed here if None); a
    raised budget evicts no more, so the schedule stays certified. Returns (schedule, replays
    run)."""
    out, runs = list(chosen), 0
    for k in range(len(out) - 2, -1, -1):
        if out[k] < out[k + 1]:
            if ref is None:
                ref, runs = replay([out])[0], runs + 1
            trial = out[:k] + [out[k + 1]] + out[k + 1:]
            runs += 1
            if replay([trial])[0] == ref:
                out = trial
    return out, runs


def raise_floors(floors: list[int], realized: dict[int, list[float]], current: list[int],
                 candidates: list[int], threshold: float,
                 quantile: float = SPARROW_QUANTILE) -> list[int]:
    """``floors`` (per-bin lower bounds, 0: none) raised from the probes' own alphas at the
    schedule in use (``realized``, by bin; bins of too few tokens pooled). A bin k whose tail is
    below ``threshold`` failed under every eviction up to its end, which cannot be undone; the
    likeliest cause is the smallest budget among bins 0..k, and of the bins holding it the last
    (it compressed the most tokens; with one budget throughout, bin k itself, the ``table``
    planner's rule). That bin gets at least the next candidate above it (the largest candidate if
    none is above); a failure that persists walks back to the next one. Bounds only ever rise."""
    cands = sorted({int(c) for c in candidates})
    out = list(floors)
    for k, alphas in sorted(pooled(realized, min_tokens(quantile))[0].items()):
        if tail(alphas, quantile) >= threshold:
            continue
        upto = [_at(current, j) for j in range(k + 1)]
        least = min(upto)
        j = max(i for i, b in enumerate(upto) if b == least)
        out += [0] * (j + 1 - len(out))
        out[j] = max(out[j], _at_least(cands, least + 1))
    return out


# On-policy rounds before a lowered schedule that keeps failing gives way (``verify``).
VERIFY_ROUNDS = 3


def verify(sample: Callable[[list[int]], dict[int, list[float]]], proposed: list[int],
           current: list[int], floors: list[int], candidates: list[int], threshold: float,
           rounds: int = VERIFY_ROUNDS, quantile: float = SPARROW_QUANTILE
           ) -> tuple[list[int], list[int], dict]:
    """The on-policy check of a proposal that holds less than the schedule in use in some bin.

    Both planners certify on replays of sequences *sampled under the schedule in use*; a smaller
    budget's own samples can go where dense disagrees more (measured on the reasoning task: p5
    0.86 certified, 0.03-0.3 realised). So ``sample(schedule)`` draws fresh sequences under the
    proposal and returns their own alphas by bin. If every (pooled) bin's tail (``quantile``; p5
    by default) is >= ``threshold`` the proposal stands; otherwise the failure raises ``floors``
    (``raise_floors``, the proposal as the schedule in use) and the proposal is raised to them,
    for up to ``rounds`` draws. A proposal that no longer lowers any bin is adopted without a
    draw; one still lowering after the last failed round gives way: no bin goes below
    ``current``. Returns (schedule, floors, info: rounds drawn, whether it gave way, each draw's
    worst-bin tail under the key "tail")."""
    cands = sorted({int(c) for c in candidates})
    sched, floors, worst = list(proposed), list(floors), []
    for _ in range(rounds):
        if not _lowers(sched, current):
            break
        realized = sample(sched)
        worst.append(min((tail(v, quantile) for v in
                          pooled(realized, min_tokens(quantile))[0].values()), default=1.0))
        if worst[-1] >= threshold:
            return _trimmed(sched), floors, {"rounds": len(worst), "gave_way": 0, "tail": worst}
        floors = raise_floors(floors, realized, sched, cands, threshold, quantile)
        sched = _bounded(sched, floors, cands)
    gave_way = int(_lowers(sched, current))
    if gave_way:
        n = max(len(sched), len(current))
        sched = [max(_at(sched, k), _at(current, k))
                 for k in range(n)]
    return _trimmed(sched), floors, {"rounds": len(worst), "gave_way": gave_way, "tail": worst}


def _lowers(schedule: list[int], current: list[int]) -> bool:
    """Whether ``schedule`` holds less than ``current`` in some bin (each list's last budget
    holds on)."""
    n = max(len(schedule), len(current))
    return any(_at(schedule, k) < _at(current, k)
               for k in range(n))


def _trimmed(schedule: list[int]) -> list[int]:
    """``schedule`` without trailing repeats (the last budget holds on anyway)."""
    out = list(schedule)
    while len(out) > 1 and out[-1] == out[-2]:
        out.pop()
    return out


def mean_budget(schedule: list[int], by_bin_tokens: dict[int, int]) -> float:
    """Token-weighted mean budget of a schedule over bins holding ``by_bin_tokens`` tokens."""
    total = sum(by_bin_tokens.values())
    return sum(_at(schedule, k) * n
               for k, n in by_bin_tokens.items()) / max(total, 1)
