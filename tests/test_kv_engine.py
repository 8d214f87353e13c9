"""Sparse policies inside the engine: dense equivalence, exact sampler log-probs, bounded memory."""
from __future__ import annotations

import pytest
import torch

from actors.config import KVConfig
from actors.engine import SamplingParams
from actors.native import NativeEngine
from actors.native.reference import recompute_logprobs
from common.modeling import load_model
from common.testmodels import build_model

torch.set_num_threads(1)
POLICIES = ["streaming", "h2o", "snapkv", "rkv"]
# Ragged prompts; the first is longer than the budget below (prompt compression at prefill).
PROMPTS = [list(range(5, 27)), [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module", params=["tiny", "qwen3", "llama3"])
def model(request, tmp_path_factory):
    return load_model(build_model(tmp_path_factory.mktemp(request.param), request.param, seed=3))


def kv(policy, budget=12, every=5):
    return KVConfig(policy=policy, budget=budget, compress_every=every, sink_tokens=2,
                    obs_window=4, pool_kernel=3)


@pytest.mark.parametrize("policy", POLICIES)
def test_budget_covering_everything_reproduces_dense(model, policy):
    dense = NativeEngine(model)
    sparse = NativeEngine(model, kv(policy, budget=64, every=4), trace=True)
    for params in (SamplingParams(max_new_tokens=20, temperature=0),
                   SamplingParams(max_new_tokens=20, temperature=0.9, top_k=40, seed=4)):
        for d, s in zip(dense.generate(PROMPTS, params), sparse.generate(PROMPTS, params)):
            assert s.response_ids == d.response_ids
            assert max(abs(a - b) for a, b in zip(s.logprobs, d.logprobs)) < 1e-5
            assert s.trace == [] and s.kept_ratio == 1.0


@pytest.mark.parametrize("mode", ["processed", "raw"])
@pytest.mark.parametrize("policy", POLICIES)
def test_sampler_logprobs_are_the_sparse_policys(model, policy, mode):
    t, k, p = 0.9, 30, 0.95
    eng = NativeEngine(model, kv(policy), trace=True)
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=30, temperature=t, top_k=k,
                                                top_p=p, seed=1, logprob_mode=mode))
    for prompt, o in zip(PROMPTS, outs):
        assert o.trace, "every sequence exceeds the budget, so it must have been compressed"
        rec = torch.tensor(o.logprobs)
        sparse = recompute_logprobs(model, prompt, o.response_ids, o.trace, t, k, p, mode)
        dense = recompute_logprobs(model, prompt, o.response_ids, o.trace, t, k, p, mode,
                                   sparse=False)
        assert torch.allclose(sparse, rec, atol=1e-5)
        assert (dense - rec).abs().max() > 1e-3
        assert o.kept_ratio < 1.0


@pytest.mark.parametrize("policy", POLICIES)
def test_peak_kv_bytes_bounded_by_budget_plus_n(model, policy):
    budget, every = 10, 6
    eng = NativeEngine(model, kv(policy, budget, every))
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=40, temperature=1.0, seed=2))
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    for o in outs:
        assert o.peak_kv_bytes == (budget + every) * per_token     # reached, never exceeded
    assert eng.last_stats["allocated_kv_bytes"] == len(PROMPTS) * (budget + every) * per_token
    dense = NativeEngine(model)
    dense.generate(PROMPTS, SamplingParams(max_new_tokens=40, temperature=1.0, seed=2))
    assert dense.last_stats["peak_kv_bytes"] > eng.last_stats["peak_kv_bytes"]


def _mean_attended(prompt_len: int, gen: int, cap: int, budget: int) -> float:
    """The compression rule replayed: decode step j appends one token to n slots (cut to ``budget``
    first when n reached ``cap``) and attends n + 1; the first token comes from the prefill."""
    n, total = prompt_len, 0
    for _ in range(gen - 1):
        n = budget if n >= cap else n
        n += 1
        total += n
    return total / (gen - 1)


def test_attended_slots_follow_the_compression_rule(model):
    prompts, gen, budget, every = PROMPTS[1:], 40, 10, 6
    dense = NativeEngine(model)
    dense.generate(prompts, SamplingParams(max_new_tokens=gen, temperature=1.0, seed=2))
    # closed form for dense: P + 1 .. P + G - 1 slots, mean P + G / 2, averaged over the rows
    want = sum(len(p) + gen / 2 for p in prompts) / len(prompts)
    assert dense.last_stats["attended_slots"] == pytest.approx(want)
    eng = NativeEngine(model, kv("h2o", budget, every))
    eng.generate(prompts, SamplingParams(max_new_tokens=gen, temperature=1.0, seed=2))
    want = sum(_mean_attended(len(p), gen, budget + every, budget) for p in prompts) / len(prompts)
    assert eng.last_stats["attended_slots"] == pytest.approx(want)
    assert want < dense.last_stats["attended_slots"]


def test_continuous_batching_keeps_logprobs_exact(model):
    """batch_size 2 with 5 ragged prompts and an early stop token: rows leave, new prompts are
    prefilled and join; every sequence still matches its teacher-forced sparse recomputation and
    its greedy tokens equal a one-by-one run."""
    prompts = PROMPTS + [[30, 31, 32, 33, 34, 35], [40] * 15]
    cfg = kv("h2o", budget=8, every=3)
    greedy = SamplingParams(max_new_tokens=14, temperature=0)
    solo = [NativeEngine(model, cfg).generate([p], greedy)[0] for p in prompts]
    stop = solo[1].response_ids[4]
    params = SamplingParams(max_new_tokens=14, temperature=0, stop_token_ids=(stop,))
    outs = NativeEngine(model, cfg, batch_size=2, trace=True).generate(prompts, params)
    for p, o, s in zip(prompts, outs, solo):
        cut = s.response_ids.index(stop) + 1 if stop in s.response_ids else len(s.response_ids)
        assert o.response_ids == s.response_ids[:cut]
        assert o.finish_reason == ("stop" if cut < 14 or s.response_ids[-1] == stop else "length")
        rec = recompute_logprobs(model, p, o.response_ids, o.trace, temperature=0)
        assert torch.allclose(rec, torch.tensor(o.logprobs), atol=1e-5)
