"""Issue 14: budget per position bin in the engine, exact probe agreement, the re-planner."""
from __future__ import annotations

import json

import pytest
import torch

from actors.config import REPLAN_KEYS, KVConfig, RolloutConfig
from actors.engine import SamplingParams
from actors.native import NativeEngine
from actors.probes import agreement, candidate_budgets, probe_rows
from actors.rollout import RolloutActor
from common.errors import ConfigError
from common.modeling import load_model
from common.testmodels import build_model
from correction.metrics import tv_agreement
from schedule import cost as costmod
from schedule.plan import (bin_alphas, mean_budget, min_tokens, plan, pooled, raise_floors,
                           search, tail, verify)
from tasks.base import Problem
from conftest import ContainsAnswer

torch.set_num_threads(1)
PROMPTS = [list(range(5, 27)), [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_model(tmp_path_factory.mktemp("m"), "tiny", seed=3))


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


def kv(policy="rkv", **kw):
    base = dict(policy=policy, budget=12, compress_every=4, sink_tokens=2, obs_window=4,
                pool_kernel=3)
    return KVConfig(**{**base, **kw})


# ---- alpha -------------------------------------------------------------------------------------
def test_alpha_on_hand_made_distributions():
    lg = lambda *p: torch.tensor(p, dtype=torch.float64).log()  # noqa: E731
    a = torch.stack([lg(0.5, 0.5, 1e-300), lg(1.0, 1e-300, 1e-300), lg(0.2, 0.3, 0.5)])
    b = torch.stack([lg(0.25, 0.25, 0.5), lg(1e-300, 1.0, 1e-300), lg(0.2, 0.3, 0.5)])
    got = tv_agreement(a, b)
    assert torch.allclose(got, torch.tensor([0.5, 0.0, 1.0], dtype=torch.float64), atol=1e-12)


def test_probe_rows_are_an_even_deterministic_share():
    assert probe_rows(16, 0.25) == [0, 4, 8, 12]
    assert probe_rows(10, 0.0) == [] and probe_rows(3, 1.0) == [0, 1, 2]
    assert probe_rows(7, 0.1) == [0]


# ---- engine: budgets per bin -------------------------------------------------------------------
def test_one_bin_schedule_is_the_static_budget(model):
    params = SamplingParams(max_new_tokens=24, temperature=0.9, seed=5)
    a = NativeEngine(model, kv(budget=12)).generate(PROMPTS, params)
    b = NativeEngine(model, kv(budget=99, budgets=[12])).generate(PROMPTS, params)
    for x, y in zip(a, b):
        assert x.response_ids == y.response_ids and x.logprobs == y.logprobs
        assert x.peak_kv_bytes == y.peak_kv_bytes


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "rkv"])
def test_bins_and_recorded_budgets(model, policy):
    """Every compression cuts to the budget of the bin the row is about to write, the cache never
    holds more than that bin's budget + compress_every, and outputs record the budget per bin."""
    budgets, width, every = [20, 8, 12], 10, 4
    eng = NativeEngine(model, kv(policy, budgets=budgets, bin_tokens=width, compress_every=every),
                       trace=True)
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=30, temperature=1.0, seed=2))
    at = lambda pos: budgets[min(pos // width, len(budgets) - 1)]  # noqa: E731
    seen_budgets = set()
    for p, o in zip(PROMPTS, outs):
        total = len(p) + len(o.response_ids)
        assert o.bin_budgets == [at(k * width) for k in range(-(-total // width))]
        for after, kept in o.trace:
            assert kept.shape[-1] == at(after + 1)        # writing position after + 1 next
            seen_budgets.add(kept.shape[-1])
        assert o.peak_kv_bytes <= (max(budgets) + every) * eng.kv_bytes_per_token()
    assert seen_budgets >= {8, 12}                          # both bins' budgets were used


def test_protect_prompt_keeps_every_prompt_token(model):
    eng = NativeEngine(model, kv("rkv", budget=14, protect_prompt=True), trace=True)
    prompts = [list(range(3, 11)), [5, 6, 7, 8, 9]]
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=30, temperature=1.0, seed=1))
    for p, o in zip(prompts, outs):
        assert o.trace
        for _, kept in o.trace:
            assert all(set(range(len(p))) <= set(h.tolist()) for layer in kept for h in layer)


def test_replay_is_the_generation_path(model):
    """Teacher-forced replay at the same schedule gives back the sampler's log-probs (same kept
    sets); alpha against the dense reference equals tv_agreement of the full distributions (a
    dense-cache replay's), and a budget above every length agrees with the dense cache (alpha 1)."""
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_k=20, seed=3)
    eng = NativeEngine(model, kv(budgets=[16, 8], bin_tokens=12))
    outs = eng.generate(PROMPTS, params)
    resp = [o.response_ids for o in outs]
    for o, d in zip(outs, eng.replay(PROMPTS, resp, params)):
        got = d.gather(-1, torch.tensor(o.response_ids)[:, None]).squeeze(-1)
        assert torch.allclose(got, torch.tensor(o.logprobs), atol=1e-5)
    alphas = agreement(eng, PROMPTS, resp, params, micro_batch=2)
    assert [len(a) for a in alphas] == [len(r) for r in resp]
    full = [tv_agreement(s, d) for s, d in zip(eng.replay(PROMPTS, resp, params),
                                               NativeEngine(model).replay(PROMPTS, resp, params))]
    for a, f in zip(alphas, full):
        assert torch.allclose(torch.tensor(a), f, atol=1e-5)
    assert min(min(a) for a in alphas) < 0.999 and all(0 <= x <= 1 for a in alphas for x in a)
    eng.set_budgets([64])
    assert all(x == pytest.approx(1.0, abs=1e-6)
               for a in agreement(eng, PROMPTS, resp, params, 2) for x in a)
    # at given schedules: each as if the engine ran it, and the engine's own one kept
    runs = agreement(eng, PROMPTS, resp, params, 2, [[16, 8], [64]])
    assert runs[0] == alphas and all(x == pytest.approx(1.0, abs=1e-6) for a in runs[1] for x in a)
    assert eng.budgets == [64]


# ---- rollout actor: probes and recorded budgets -------------------------------------------------
def test_actor_rows_probes_and_table(model_dir):
    cfg = RolloutConfig(model_path=model_dir, samples_per_prompt=4, max_new_tokens=16,
                        kv=kv(budget=10, bin_tokens=8, schedule="dynamic", probe_share=0.25,
                              probe_budgets=[6, 10, 40], planner="table"))
    actor = RolloutActor(cfg, task_cfg=None, model_path=model_dir)
    actor._task = ContainsAnswer()
    problems = [Problem(0, "hello there", "x"), Problem(1, "abcdefghijkl", "y")]
    actor.rollout(problems, version=0, batch=1)     # probes, no table (no re-plan reads it)
    assert actor._probes == {} and actor._realized
    rows = actor.rollout(problems, version=0, batch=5)   # re-plan_every=5: the table too
    probed = [r for r in rows if r["kv_agreement"] is not None]
    assert len(probed) == 2 and all(len(r["kv_agreement"]) == r["response_len"] for r in probed)
    for r in rows:
        total = r["prompt_len"] + r["response_len"]
        assert r["kv_bin_budgets"] == [10] * (-(-total // 8))
    got = actor.take_probes()
    assert sorted(got["table"]) == [6, 10, 40] and got["budgets"] == [10]
    exact = got["table"][40]                      # above every length: the dense cache's
    assert all(x == pytest.approx(1.0, abs=1e-6) for v in exact.values() for x in v)
    assert sum(map(len, got["realized"].values())) > sum(r["response_len"] for r in probed)
    assert actor.take_probes()["table"] == {}     # taken once
    actor.set_budgets([12, 6])
    rows = actor.rollout(problems, version=0, batch=6)
    assert all(r["kv_bin_budgets"][0] == 12 for r in rows)


def test_actor_keeps_probe_sequences_for_the_exact_planner(model_dir):
    """planner=exact: the re-plan batch's probe sequences stay in the actor (no table is built)
    and are replayed at any schedule the driver asks for; taking the probes forgets them."""
    cfg = RolloutConfig(model_path=model_dir, samples_per_prompt=4, max_new_tokens=16,
                        kv=kv(budget=10, bin_tokens=8, schedule="dynamic", probe_share=0.25,
                              probe_budgets=[6, 10, 40]))
    actor = RolloutActor(cfg, task_cfg=None, model_path=model_dir)
    actor._task = ContainsAnswer()
    problems = [Problem(0, "hello there", "x"), Problem(1, "abcdefghijkl", "y")]
    actor.rollout(problems, version=0, batch=1)       # not a re-plan batch: nothing kept
    assert actor.probe_summary()["counts"] == {}
    rows = actor.rollout(problems, version=0, batch=5)
    probed = [r for r in rows if r["kv_agreement"] is not None]
    assert actor._probes == {}
    summary = actor.probe_summary()
    assert sum(summary["counts"].values()) == sum(r["response_len"] for r in probed)
    assert summary["longest"] == max(r["prompt_len"] for r in probed) + 16
    at_own, dense, grown = actor.replay_probes([[10], [40], [6, 40]])
    # the schedule in use reproduces the rows' own alphas; above every length: exactly dense
    own = bin_alphas([r["prompt_len"] for r in probed], [r["kv_agreement"] for r in probed], 8)
    assert {k: pytest.approx(v, abs=1e-6) for k, v in own.items()} == at_own
    assert all(x == pytest.approx(1.0, abs=1e-6) for v in dense.values() for x in v)
    assert grown != at_own and set(grown) == set(at_own)
    assert actor.take_probes()["sequences"] == len(probed)
    assert actor.probe_summary()["counts"] == {} and actor.replay_probes([[10]]) == [{}]


def test_actor_samples_probe_prompts_under_a_proposed_schedule(model_dir):
    """``sample_probes``: fresh samples of the latest re-plan's probe prompts at the budgets
    asked for, their own alphas by bin (the rows' alphas when the budgets are the ones in use
    and the seed the batch's), deterministic per key; the engine's schedule is left as it was."""
    cfg = RolloutConfig(model_path=model_dir, samples_per_prompt=4, max_new_tokens=16,
                        kv=kv(budget=10, bin_tokens=8, schedule="dynamic", probe_share=0.25,
                              probe_budgets=[6, 10, 40], verify_samples=4))
    actor = RolloutActor(cfg, task_cfg=None, model_path=model_dir)
    actor._task = ContainsAnswer()
    problems = [Problem(0, "hello there", "x"), Problem(1, "abcdefghijkl", "y")]
    assert actor.sample_probes([6], 4, key=7) == {}      # no re-plan batch yet
    actor.rollout(problems, version=0, batch=5)
    small = actor.sample_probes([6], 4, key=7)
    assert actor.engine.budgets == [10]
    assert small == actor.sample_probes([6], 4, key=7)    # the key fixes the draw
    assert sum(map(len, small.values())) > 0
    assert all(0.0 <= x <= 1.0 + 1e-6 for v in small.values() for x in v)
    dense = actor.sample_probes([40], 4, key=7)          # never compresses: exactly dense
    assert all(x == pytest.approx(1.0, abs=1e-6) for v in dense.values() for x in v)
    assert min(x for v in small.values() for x in v) < 1.0 - 1e-3
    actor.take_probes()                                   # the prompts outlive the probes
    assert actor.sample_probes([6], 4, key=7) == small


def test_schedule_config_errors():
    with pytest.raises(ConfigError, match="rollout.kv.probe_share"):
        kv(schedule="dynamic").validate()
    with pytest.raises(ConfigError, match="rollout.kv.schedule"):
        KVConfig(policy="dense", schedule="dynamic").validate()
    with pytest.raises(ConfigError, match="rollout.kv.planner"):
        kv(schedule="dynamic", probe_share=0.5, planner="greedy").validate()
    with pytest.raises(ConfigError, match="rollout.kv.budgets"):
        kv(budgets=[12, 0]).validate()
    with pytest.raises(ConfigError, match="rollout.kv.min_budgets"):
        kv(min_budgets=[16]).validate()        # static: nothing reads it
    with pytest.raises(ConfigError, match="rollout.kv.min_budgets"):
        kv(schedule="dynamic", probe_share=0.5, min_budgets=[16, -1]).validate()
    kv(schedule="dynamic", probe_share=0.5, min_budgets=[0, 16]).validate()
    with pytest.raises(ConfigError, match="rollout.kv.verify_samples"):
        kv(schedule="dynamic", probe_share=0.5, verify_samples=-1).validate()
    kv(schedule="dynamic", probe_share=0.5, verify_samples=8).validate()
    # every re-planner setting is refused with a static schedule, where nothing would read it
    # (bench/compare.py gives them to its dynamic arm only)
    for key, value in (("verify_samples", 8), ("quantile", 0.01), ("threshold", 0.75),
                       ("margin", 0.02), ("replan_every", 10), ("objective", "memory"),
                       ("planner", "table"), ("probe_budgets", [8, 16])):
        with pytest.raises(ConfigError, match=rf"rollout.kv.{key}': .*its default .* with "
                                              r"rollout.kv.schedule=static"):
            kv(**{key: value}).validate()
    assert set(REPLAN_KEYS) == {"probe_budgets", "threshold", "quantile", "margin", "replan_every",
                                "objective", "min_budgets", "verify_samples", "planner"}
    kv(schedule="dynamic", probe_share=0.5, threshold=0.75, quantile=0.01, margin=0.02,
       replan_every=10, objective="memory", planner="table", probe_budgets=[8, 16]).validate()
    for q in (0.0, 0.6):
        with pytest.raises(ConfigError, match="rollout.kv.quantile"):
            kv(schedule="dynamic", probe_share=0.5, quantile=q).validate()
    with pytest.raises(ConfigError, match="rollout.kv.obs_window"):
        kv(budgets=[12, 3]).validate()
    with pytest.raises(ConfigError, match="rollout.kv.budgets"):
        RolloutConfig(engine="vllm", kv=KVConfig(policy="streaming", budgets=[8])).validate()
    assert candidate_budgets(kv(bin_tokens=16), 61) == [8, 16, 24, 32, 40, 48, 56, 64]
    assert candidate_budgets(kv(probe_budgets=[9, 5, 9]), 61) == [5, 9]


# ---- the scheduler ------------------------------------------------------------------------------
def _table():
    """Synthetic probes: bin 0 passes from budget 8, bin 1 needs 24, bin 2 needs 16 (two bad
    tokens in twenty put the 5th percentile at 0.2)."""
    ok, bad = [0.99] * 20, [0.99] * 18 + [0.2] * 2
    return {8: {0: ok, 1: bad, 2: bad}, 16: {0: ok, 1: bad, 2: ok}, 24: {0: ok, 1: ok, 2: ok},
            32: {0: ok, 1: ok, 2: ok}}


def linear_cost(k, b):
    return float(b)          # cost grows with the budget in every bin


def test_scheduler_cheapest_non_increasing_passing_schedule():
    budgets, info = plan(_table(), linear_cost, threshold=0.86)
    assert budgets == [24, 24, 16]           # bin 0 lifted to bin 1's need (non-increasing)
    assert info["unmet_bins"] == [] and info["floor"] == {0: 8, 1: 24, 2: 16}
    assert plan(_table(), linear_cost, 0.86) == (budgets, info)   # deterministic


def test_scheduler_follows_the_cost_model():
    """A budget that never compresses can be cheaper than a compressing one (compression costs);
    the planner takes it when the cost model says so."""
    cost = lambda k, b: 1.0 if b == 32 else float(b)  # noqa: E731
    assert plan(_table(), cost, 0.86)[0] == [32]


def test_scheduler_feedback_and_unmet_bins():
    realized = {2: [0.1] * 20}          # bin 2 failed at the schedule in use (16 there)
    budgets, _ = plan(_table(), linear_cost, 0.86, realized=realized, current=[24, 24, 16])
    assert budgets == [24]
    table = {8: {0: [0.1] * 10}, 16: {0: [0.5] * 10}}
    budgets, info = plan(table, linear_cost, 0.86)
    assert budgets == [16] and info["unmet_bins"] == [0]    # nothing passes: the largest


def test_sparse_tail_bins_are_pooled_with_the_bin_before():
    """Bin 3, a tail of three tokens, passes at 8 on its own (its 'p5' is its minimum); pooled
    with bin 2 it is judged with bin 2's tokens and keeps at least bin 2's budget."""
    t = _table()
    for b in t:
        t[b][3] = [0.99] * 3
    budgets, info = plan(t, linear_cost, 0.86)
    assert budgets == [24, 24, 16] and info["floor"][3] == 16
    pooled_bins, joined = pooled({0: [1.0] * 25, 1: [0.9] * 5, 2: [0.5] * 30, 3: [0.1]})
    assert joined == {1: 0, 3: 2} and sorted(pooled_bins) == [0, 2]
    assert len(pooled_bins[0]) == 30 and len(pooled_bins[2]) == 31


def irreversible_replay(schedules, log=None):
    """Synthetic probes with irreversible eviction (bins of 8 tokens, 20 alphas each): bin j
    passes when its own budget is >= NEED[j] and no earlier bin evicted below what bin j needs of
    it (EARLY: bin 3 fails once bin 1 ran at 8). A budget below its bin's end binds (evicts), which
    moves the alphas of its bin and every later one slightly, passing or not."""
    need, early = {0: 8, 1: 8, 2: 16, 3: 24}, {(1, 3): 16}
    out = []
    for sched in schedules:
        if log is not None:
            log.append(list(sched))
        b = lambda j: sched[min(j, len(sched) - 1)]  # noqa: E731
        ok = {j: b(j) >= need[j] and all(b(i) >= v for (i, jj), v in early.items() if jj == j)
              for j in need}
        binds = {j: sum(b(i) < 8 * (i + 1) for i in range(j + 1)) for j in need}
        out.append({j: [0.99 - 1e-4 * binds[j]] * 20 if ok[j] else [0.99] * 18 + [0.2] * 2
                    for j in need})
    return out


def test_exact_search_certifies_growing_schedules():
    """The exact planner finds the growing schedule whose every bin passes when replayed as a
    whole; the per-bin floors of the one-budget table would give [8, 8, 16, 24], which fails bin
    3, and the table planner can only certify the non-increasing [24]. Bin 0's 8 never binds
    (nothing evicted, same alphas): it is listed as bin 1's 16."""
    log: list = []
    replay = lambda s: irreversible_replay(s, log)  # noqa: E731
    budgets, info = search(replay, [8, 16, 24, 32], 8, linear_cost, 0.86)
    assert budgets == [16, 16, 16, 24] and info["unmet_bins"] == []
    assert all(tail(v) >= 0.86 for v in irreversible_replay([budgets])[0].values())
    assert tail(irreversible_replay([[8, 8, 16, 24]])[0][3]) < 0.86
    table = {b: irreversible_replay([[b]])[0] for b in (8, 16, 24, 32)}
    assert plan(table, linear_cost, 0.86)[0] == [24]
    # one replay at the top, then per bin the budgets that can evict there and the smallest that
    # cannot (bin 0: 8; bin 1: 8, 16; bin 2: 8, 16, 24; bin 3: all four, the last of them the
    # chosen [8, 16, 16, 24] itself); then a try at raising each budget below the next (bins 2, 0)
    assert info["replays"] == len(log) == 1 + 1 + 2 + 3 + 4 + 2 and log[0] == [32]
    assert log[1:3] == [[8, 32, 32, 32], [8, 8, 32, 32]]
    assert log[-6:] == [[8, 16, 16, 8], [8, 16, 16, 16], [8, 16, 16, 24], [8, 16, 16, 32],
                        [8, 16, 24, 24], [16, 16, 16, 24]]
    assert search(replay, [8, 16, 24, 32], 8, linear_cost, 0.86) == (budgets, info)


def test_exact_search_cost_margin_and_unmet_bins():
    # the cost model says a budget that never compresses is cheapest: bin 3 takes it
    cost = lambda k, b: 1.0 if b == 32 else float(b)  # noqa: E731
    assert search(irreversible_replay, [8, 16, 24, 32], 8, cost, 0.86)[0] == [16, 16, 16, 32]
    # a margin no alpha meets: every bin unmet, each held to its p5 at the top budget (0.99),
    # which every budget that binds lowers a little: nothing is evicted
    budgets, info = search(irreversible_replay, [8, 16, 24, 32], 8, linear_cost, 0.86, 0.2)
    assert info["unmet_bins"] == [0, 1, 2, 3] and budgets == [32]
    # a bin failing whatever the budget: no constraint from it (here it does no worse anywhere)
    failing = lambda s: [{0: [0.99] * 20, 1: [0.1] * 20} for _ in s]  # noqa: E731
    budgets, info = search(failing, [8, 16], 8, linear_cost, 0.86)
    assert info["unmet_bins"] == [1] and budgets == [8]


def test_exact_search_keeps_a_sparse_tail_bin_at_least_at_its_pooled_bin():
    """Bin 4 holds three tokens, pooled with bin 3 (20): evicting there at 8 spoils one of them,
    which the pooled p5 does not see (1 of 23), but it may not go below bin 3's 24."""
    def replay(schedules):
        out = irreversible_replay(schedules)
        for sched, r in zip(schedules, out):
            r[4] = [0.99] * 3 if sched[min(4, len(sched) - 1)] >= 24 else [0.99] * 2 + [0.1]
        return out
    budgets, info = search(replay, [8, 16, 24, 32], 8, linear_cost, 0.86)
    assert budgets == [16, 16, 16, 24] and info["unmet_bins"] == []


def test_raise_floors_blames_the_smallest_budget_up_to_a_failing_bin():
    ok, bad = [0.99] * 20, [0.99] * 18 + [0.2] * 2
    current = [45, 45, 90, 90, 45, 90]
    cands = [45, 90, 180, 400]
    # bin 5 fails: bins 0..5 hold 45 at 0, 1 and 4; the last of them, bin 4, gets the next
    # candidate above it
    assert raise_floors([], {0: ok, 1: ok, 4: ok, 5: bad}, current, cands, 0.86) == \
        [0, 0, 0, 0, 90]
    # it fails again with bin 4 at 90: the blame walks back to bin 1
    again = raise_floors([0, 0, 0, 0, 90], {5: bad}, [45, 45, 90, 90, 90, 90], cands, 0.86)
    assert again == [0, 90, 0, 0, 90]
    # bin 2 fails: bins 0 and 1 are up to it; bounds only rise (bin 3's 180 stays)
    assert raise_floors([0, 0, 0, 180], {2: bad}, current, cands, 0.86) == [0, 90, 0, 180]
    # one budget throughout: the failing bin itself (the table planner's rule); past the
    # schedule's end its last budget holds; failing at the largest candidate keeps it
    assert raise_floors([], {3: bad}, [90], cands, 0.86) == [0, 0, 0, 180]
    assert raise_floors([], {8: bad}, [400], [45, 400], 0.86) == [0] * 8 + [400]
    # passing bins change nothing; a tail bin of too few tokens is judged with the bin before
    assert raise_floors([7], {0: ok, 1: [0.99, 0.99, 0.1]}, current, [45, 90], 0.86) == [7]


def test_floors_bound_both_planners():
    # plan: bin 2 may not go below 24, so the non-increasing schedule is 24 throughout
    assert plan(_table(), linear_cost, 0.86)[0] == [24, 24, 16]
    assert plan(_table(), linear_cost, 0.86, floors=[0, 0, 24])[0] == [24]
    # a bound between candidates means the next candidate up
    assert plan(_table(), linear_cost, 0.86, floors=[0, 0, 17])[0] == [24]
    # search: the growing schedule with bin 2 held at 24 or more, and bin 0 at 24 (20 -> 24)
    budgets, info = search(irreversible_replay, [8, 16, 24, 32], 8, linear_cost, 0.86)
    assert budgets == [16, 16, 16, 24]
    budgets, _ = search(irreversible_replay, [8, 16, 24, 32], 8, linear_cost, 0.86,
                        floors=[0, 0, 24])
    assert budgets == [24]         # bins 0 and 1 at 16 never evict there: lifted to 24
    # a bound past the bins the probes reach (a batch of short sequences) still holds there
    assert search(irreversible_replay, [8, 16, 24, 32], 8, linear_cost, 0.86,
                  floors=[0, 0, 0, 0, 0, 32])[0] == [16, 16, 16, 24, 24, 32]
    assert plan(_table(), linear_cost, 0.86, floors=[0, 0, 0, 0, 32])[0] == [24, 24, 16, 16, 32]
    budgets, _ = search(irreversible_replay, [8, 16, 24, 32], 8, linear_cost, 0.86,
                        floors=[20])
    assert budgets[0] == 24 and all(tail(v) >= 0.86 for v in
                                    irreversible_replay([budgets])[0].values())


def test_a_lower_quantile_sees_the_rare_bad_tokens():
    """Four bad tokens in two hundred: the 5th percentile passes, the 1st does not. Each planner
    and the bounds judge by ``quantile`` (``rollout.kv.quantile``)."""
    rare, ok = [0.99] * 196 + [0.1] * 4, [0.99] * 200
    assert tail(rare) >= 0.86 > tail(rare, 0.01)
    table = {8: {0: ok, 1: rare}, 16: {0: ok, 1: ok}}
    assert plan(table, linear_cost, 0.86)[0] == [8]
    assert plan(table, linear_cost, 0.86, quantile=0.01)[0] == [16]
    # a bin of 50 tokens: judged alone for a 5th percentile, with the bin before for a 1st
    assert pooled({0: ok, 1: ok[:50]}, min_tokens(0.05))[1] == {}
    assert pooled({0: ok, 1: ok[:50]}, min_tokens(0.01))[1] == {1: 0}

    def replay(schedules):
        return [{0: ok, 1: rare if min(s) < 16 else ok} for s in schedules]
    assert search(replay, [8, 16], 8, linear_cost, 0.86)[0] == [8]
    assert search(replay, [8, 16], 8, linear_cost, 0.86, quantile=0.01)[0] == [16]
    assert raise_floors([], {1: rare}, [8], [8, 16], 0.86) == []
    assert raise_floors([], {1: rare}, [8], [8, 16], 0.86, 0.01) == [0, 16]
    sample = lambda schedule: replay([schedule])[0]    # noqa: E731
    assert verify(sample, [8], [16], [], [8, 16], 0.86)[0] == [8]
    assert verify(sample, [8], [16], [], [8, 16], 0.86, quantile=0.01)[0] == [16]


def on_policy_sampler(needs: dict[int, int]):
    """A stand-in for fresh samples under a schedule: bin k fails (p5 0.2) while a bin from 2
    up to it holds less than ``needs[k]`` (bins 0 and 1: the kept prompt, never binding);
    records the schedules drawn."""
    ok, bad = [0.99] * 20, [0.99] * 18 + [0.2] * 2
    drawn = []

    def sample(schedule):
        drawn.append(list(schedule))
        at = [schedule[min(j, len(schedule) - 1)] for j in range(6)]
        return {k: bad if k >= 2 and min(at[2:k + 1]) < needs.get(k, 0) else ok
                for k in range(6)}
    return sample, drawn


def test_verify_checks_a_lowered_schedule_on_its_own_samples():
    cands = [45, 90, 180, 400]
    # the replays certified 45 in bin 4; its own samples fail in bin 5 (needs 90 up to there):
    # bin 4's bound rises, the raised proposal passes on the next draw
    sample, drawn = on_policy_sampler({5: 90})
    got, floors, info = verify(sample, [45, 45, 90, 90, 45, 90], [90], [0, 45], cands, 0.86)
    assert got == [45, 45, 90] and floors == [0, 45, 0, 0, 90]
    assert drawn == [[45, 45, 90, 90, 45, 90], [45, 45, 90, 90, 90, 90]]
    assert info == {"rounds": 2, "gave_way": 0, "tail": [pytest.approx(0.2), 0.99]}
    # a passing proposal is adopted after one draw; one lowering nothing is adopted unchecked
    sample, drawn = on_policy_sampler({})
    assert verify(sample, [45, 90], [90], [], cands, 0.86)[0] == [45, 90] and len(drawn) == 1
    assert verify(sample, [90, 180], [90], [], cands, 0.86)[2]["rounds"] == 0
    assert len(drawn) == 1
    # still failing after the last round: no bin goes below the schedule in use, the bounds
    # raised on the way are kept
    sample, drawn = on_policy_sampler({3: 400})
    got, floors, info = verify(sample, [45, 45, 45, 90], [90, 90, 90, 180], [], cands, 0.86,
                               rounds=2)
    assert info["gave_way"] == 1 and info["rounds"] == 2 and len(drawn) == 2
    assert got == [90, 90, 90, 180] and floors == [0, 90, 90]
    assert drawn[1] == [45, 45, 90, 90]         # round 2: bin 2 (the last 45 up to bin 3) raised


def test_bin_alphas_and_mean_budget():
    by_bin = bin_alphas([3, 6], [[0.9, 0.8, 0.7], [0.5]], bin_tokens=4)
    assert by_bin == {0: [0.9], 1: [0.8, 0.7, 0.5]}
    assert mean_budget([10, 20], {0: 1, 1: 3, 2: 4}) == pytest.approx((10 + 60 + 80) / 8)


# ---- cost model ---------------------------------------------------------------------------------
def test_cost_fit_recovers_a_synthetic_model_and_caches(model_dir, tmp_path):
    pts = []
    for j, (b, s) in enumerate((b, s) for b in (2, 8, 32) for s in (16, 64, 128, 256)):
        pts.append({"kind": "step", "batch": b, "kv": s, "held_out": j % 2 == 1,
                    "seconds": 1e-3 + 2e-5 * b + 3e-7 * b * s})
        pts.append({"kind": "compress", "batch": b, "kv": s, "held_out": j % 2 == 1,
                    "seconds": 2e-3 + 1e-6 * b * s + 2e-8 * b * s * s})
    m = costmod.fit(pts)
    assert m.step == pytest.approx([1e-3, 2e-5, 3e-7], rel=1e-6)
    assert m.compress == pytest.approx([2e-3, 1e-6, 2e-8], rel=1e-6)
    assert m.error["step"] < 1e-9 and m.error["compress"] < 1e-9
    eng = NativeEngine(load_model(model_dir), kv())
    first = costmod.load_or_measure(eng, model_dir, tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"] == first.key
    assert costmod.load_or_measure(eng, model_dir, tmp_path) == first    # from the cache
    assert first.step_s(8, 128) > 0 and set(first.error) == {"step", "compress"}
