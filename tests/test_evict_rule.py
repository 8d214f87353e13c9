"""The compaction rule vLLM's scheduler and runner share (actors/vllm/evict/rule.py), against the
native engine it reproduces: the positions it compacts at and the slots it holds. No vLLM needed."""
from __future__ import annotations

import pytest
import torch

from actors.config import KVConfig
from actors.native import NativeEngine
from actors.engine import SamplingParams
from actors.vllm.evict.rule import BudgetTable, CacheLength
from actors.vllm.kv import evicted_kept_ratio
from common.testmodels import build_model
from common.modeling import load_model


def compactions(kv: KVConfig, prompt_len: int, total: int) -> list[tuple[int, int]]:
    """(after = t - 1, budget) of every compaction of a sequence of ``total`` tokens (positions
    up to total - 2 are written: the last sampled token never enters the cache)."""
    cache = CacheLength(BudgetTable(kv), prompt_len)
    out = []
    for t in range(prompt_len, total - 1):
        step = cache.at(t)
        if step.compacts:
            out.append((t - 1, step.length))
    return out


def test_static_budget_closed_form():
    kv = KVConfig(policy="snapkv", budget=10, compress_every=4)
    # short prompt: the cache grows to budget + N = 14, is cut to 10 before writing t = 14,
    # and then every N steps
    assert compactions(kv, 3, 32) == [(13, 10), (17, 10), (21, 10), (25, 10), (29, 10)]
    # a prompt over the budget is cut right after its prefill, before its first decode step
    assert compactions(kv, 12, 22) == [(11, 10), (15, 10), (19, 10)]
    step = CacheLength(BudgetTable(kv), 3).at(14)
    assert (step.held, step.length, step.offset, step.compacts) == (14, 10, 4, True)


def test_positions_only_grow_and_dense_never_compacts():
    cache = CacheLength(BudgetTable(KVConfig(policy="h2o", budget=8, compress_every=2)), 4)
    cache.at(20)
    cache.at(20)                      # the scheduler may ask twice in one step (retries)
    with pytest.raises(ValueError, match="only grow"):
        cache.at(19)
    dense = CacheLength(BudgetTable(KVConfig(policy="dense")), 5)
    assert all(not dense.at(t).compacts and dense.at(t).offset == 0 for t in range(5, 200))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_model(tmp_path_factory.mktemp("rule")))


@pytest.mark.parametrize("kv", [
    KVConfig(policy="snapkv", budget=12, compress_every=5, obs_window=4, pool_kernel=3),
    KVConfig(policy="h2o", budgets=[20, 8, 12], bin_tokens=10, compress_every=4),
    KVConfig(policy="rkv", budget=6, compress_every=3, obs_window=2, pool_kernel=3),
], ids=["snapkv-static", "h2o-bins", "rkv-small"])
def test_rule_matches_native_engine(model, kv):
    """Same compaction points, budgets and kept ratios as the native engine's trace, for prompts
    shorter and longer than the budget."""
    prompts = [[1, 5, 6], [1] + list(range(30, 52)), [1, 9, 10, 11, 12, 13, 14, 15]]
    eng = NativeEngine(model, kv, batch_size=2, trace=True)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=40, temperature=0.0))
    for p, o in zip(prompts, outs):
        total = len(p) + len(o.response_ids)
        want = [(after, kept.shape[-1]) for after, kept in o.trace]
        assert compactions(kv, len(p), total) == want
        assert evicted_kept_ratio(len(p), len(o.response_ids), kv) == pytest.approx(
            o.kept_ratio, abs=1e-12)
        # slots held: the native engine's peak (tokens after the prefill's compression, then
        # after each decode step's write) is the rule's largest cache
        cache = CacheLength(BudgetTable(kv), len(p))
        peak = max([cache.at(len(p)).length] +
                   [cache.at(t).length + 1 for t in range(len(p), total - 1)])
        assert o.peak_kv_bytes == peak * eng.bytes_per_token
