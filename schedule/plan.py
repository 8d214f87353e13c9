"""Choosing a KV budget per position bin from probes (pure and deterministic).

Inputs: a probe table ``{budget: {bin: [alpha, ...]}}`` (``actors.probes``: probe sequences replayed
at one budget everywhere; bin = position // bin_tokens of the token, prompt included) and a cost
``cost(bin, budget) -> seconds`` (``schedule.cost``). The statistic is Sparrow's: the 5th
percentile of alpha in a bin (``correction.metrics.sparrow_tail``); a budget passes a bin when it
is >= threshold + margin.

Why the schedule is non-increasing in position: a table entry measures a bin under one budget at
every earlier position. Eviction cannot be undone, so a bin whose earlier bins ran with *smaller*
budgets sees a poorer cache than the table says (a growing schedule would be planned on optimistic
figures); with earlier budgets at least as large it sees a superset-chosen cache, for which the
table is conservative. A large budget early costs nothing until a row has that many tokens, so the
constraint costs little. The realised per-bin p5 of probes at the schedule in use is fed back: a bin
that failed there rules out its current budget and every smaller one.

Among schedules where every bin with probe tokens passes, ``plan`` minimises the summed cost (a
dynamic programme over bins, from the last); ties go to the smaller budgets.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from correction.metrics import SPARROW_QUANTILE, sparrow_tail


# A 5th percentile of fewer than 1/0.05 values is just their minimum: a bin with fewer probe
# tokens (the long tail of lengths) is pooled with the bin before it (``pooled``).
MIN_BIN_TOKENS = round(1 / SPARROW_QUANTILE)


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


def p5(alphas: list[float]) -> float:
    """Sparrow's tail statistic of one bin's alphas (1.0 for none)."""
    t = torch.tensor(alphas, dtype=torch.float64)
    return sparrow_tail(t, torch.ones_like(t, dtype=torch.bool))


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
    return {k: {"p5": p5(v), "mean": sum(v) / len(v), "tokens": len(v)}
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
         current: list[int] | None = None) -> tuple[list[int], dict]:
    """The cheapest non-increasing budget per bin whose probe p5 passes every probed bin.

    ``realized``: {bin: alphas} of probes at the ``current`` schedule; a bin below ``threshold``
    there excludes budgets <= its current one. Bins with fewer than ``MIN_BIN_TOKENS`` alphas are
    judged pooled with the bin before them and get at least that bin's budget. Returns (budgets
    per bin, trailing repeats dropped; info: per-bin lower bounds, bins where nothing passed, the
    schedule's summed cost)."""
    budgets = sorted(table)
    if not budgets:
        raise ValueError("plan: empty probe table")
    nbins = max(k for cells in table.values() for k in cells) + 1
    joined = pooled(table[budgets[0]])[1]   # every budget replays the same probe tokens
    table = {b: pooled(cells)[0] for b, cells in table.items()}
    realized, rjoined = pooled(realized or {})
    bins = sorted({k for cells in table.values() for k in cells})
    need = threshold + margin
    floor = {}
    for k in bins:
        ok = [b for b in budgets if k in table[b] and p5(table[b][k]) >= need]
        if current is not None and k in realized and p5(realized[k]) < threshold:
            now = current[min(k, len(current) - 1)]
            ok = [b for b in ok if b > now]
        floor[k] = ok[0] if ok else budgets[-1]
    unmet = [k for k in bins if floor[k] == budgets[-1] and
             not p5(table[budgets[-1]].get(k, [1.0])) >= need]
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
            tail = min(tails, key=lambda cs: (cs[0], cs[1]))
            best[b] = (cost(k, b) + tail[0], [b] + tail[1])
    total, schedule = min(best.values(), key=lambda cs: (cs[0], cs[1]))
    while len(schedule) > 1 and schedule[-1] == schedule[-2]:
        schedule.pop()
    return schedule, {"floor": floor, "unmet_bins": unmet, "predicted_cost": total}


def mean_budget(schedule: list[int], by_bin_tokens: dict[int, int]) -> float:
    """Token-weighted mean budget of a schedule over bins holding ``by_bin_tokens`` tokens."""
    total = sum(by_bin_tokens.values())
    return sum(schedule[min(k, len(schedule) - 1)] * n
               for k, n in by_bin_tokens.items()) / max(total, 1)
