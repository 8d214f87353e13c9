"""The chunked teacher-forced run (actors/native/forced.py) against the sampler's own decode loop
forced token by token (forced.stepwise): the same compressions at the same positions
keeping the same slots, and the same next-token log-probs, for every KV policy and schedule."""
from __future__ import annotations

import random

import pytest
import torch

from actors.config import KVConfig
from actors.engine import SamplingParams
from actors.native import NativeEngine, forced
from common.modeling import load_model
from common.testmodels import build_model

torch.set_num_threads(1)

CASES = {
    "dense": dict(policy="dense"),
    "streaming": dict(policy="streaming", sink_tokens=2),
    "h2o": dict(policy="h2o"),
    "snapkv": dict(policy="snapkv", obs_window=4, pool_kernel=3),
    "rkv": dict(policy="rkv", obs_window=4),
    "rkv-prompt-kept": dict(policy="rkv", obs_window=4, protect_prompt=True),
    "snapkv-adaptive": dict(policy="snapkv", obs_window=4, keep_mass=0.9, min_budget=6),
    "rkv-bins": dict(policy="rkv", obs_window=4, budgets=[14, 10, 12], bin_tokens=8),
    "h2o-bins": dict(policy="h2o", budgets=[10, 16], bin_tokens=12),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_model(tmp_path_factory.mktemp("m"), "tiny", seed=5))


@pytest.fixture()
def chunk_sizes(monkeypatch):
    """The token count of every chunk a forced run steps, in order."""
    sizes = []
    step = forced.chunk_step

    def counting(dec, pool, tokens, s, h2o):
        sizes.append(tokens.shape[1])
        return step(dec, pool, tokens, s, h2o)

    monkeypatch.setattr(forced, "chunk_step", counting)
    return sizes


def rows(model, lengths, response_lengths, seed=0):
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    responses = [[rng.randrange(3, vocab) for _ in range(n)] for n in response_lengths]
    return prompts, responses


def engine(model, case, batch_size=3):
    cfg = dict(budget=12, compress_every=5)
    cfg.update(CASES[case])
    return NativeEngine(model, KVConfig(**cfg), batch_size=batch_size, trace=True, step="eager")


def same_events(got, want):
    assert [p for p, _ in got] == [p for p, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_replay_equals_the_decode_loop(model, case):
    """Prompts of different lengths (one longer than the budget: compressed at prefill) and
    responses of different lengths, in batches smaller than the call: every row's compression
    events (position, kept slots per layer and head) equal the decode loop's, and its log-probs
    agree to float rounding, at temperature 0.7 with top-k as at greedy."""
    prompts, responses = rows(model, [6, 9, 15, 4, 7], [30, 23, 41, 1, 17])
    params = SamplingParams(temperature=0.7, top_k=20)
    want_logp, want_events = forced.stepwise(engine(model, case), prompts, responses, params)
    eng = engine(model, case)
    got_events = eng.replay_kept_sets(prompts, responses)
    got_logp = eng.replay(prompts, responses, params)
    for g, w, r in zip(got_logp, want_logp, responses):
        assert g.shape == w.shape == (len(r), model.config.vocab_size)
        finite = torch.isfinite(w)
        assert torch.equal(finite, torch.isfinite(g))              # the same top-k everywhere
        torch.testing.assert_close(g[finite], w[finite], atol=1e-5, rtol=0)
    if case != "dense":
        assert sum(len(e) for e in want_events) > 5                # compressions were checked
    for g, w in zip(got_events, want_events):
        same_events(g, w)


def test_chunks_run_to_the_next_compression(model, chunk_sizes):
    """Rows whose prompts have one length compress at the same steps, so each forward covers the
    decode steps up to the next compression: ``compress_every`` tokens (the first chunk fills
    the budget), not one. 8 prompts of 6 tokens, 60-token responses, R-KV at 12 + 5: the
    prefill, then chunks of 6 (to 12 slots) + 5, then 5 tokens each (the last: what is left)."""
    prompts, responses = rows(model, [6] * 8, [60] * 8)
    eng = engine(model, "rkv", batch_size=8)
    eng.replay_kept_sets(prompts, responses)
    assert chunk_sizes == [11] + [5] * 9 + [3]     # 59 decode steps: the last token is not read
    assert sum(chunk_sizes) == 59


def test_kept_sets_follow_the_weights(model):
    """The kept sets are the engine's policy on the current weights: the same call twice gives
    the same events, and scaling one layer's query weights moves R-KV's choices."""
    prompts, responses = rows(model, [6, 8], [40, 40], seed=1)
    eng = engine(model, "rkv")
    first = eng.replay_kept_sets(prompts, responses)
    for g, w in zip(eng.replay_kept_sets(prompts, responses), first):
        same_events(g, w)
    q = model.model.layers[0].self_attn.q_proj.weight
    saved = q.detach().clone()
    try:
        with torch.no_grad():
            q.mul_(torch.linspace(0.1, 4.0, q.shape[0])[:, None])
        moved = eng.replay_kept_sets(prompts, responses)
        assert any(not torch.equal(a, b) for e1, e2 in zip(moved, first)
                   for (_, a), (_, b) in zip(e1, e2))
    finally:
        with torch.no_grad():
            q.copy_(saved)


def test_forced_run_refuses_empty_rows(model):
    eng = engine(model, "rkv")
    with pytest.raises(ValueError, match="non-empty response"):
        eng.replay_kept_sets([[5, 6]], [[]])
    with pytest.raises(ValueError, match="empty prompt"):
        eng.replay([[]], [[5]], SamplingParams(temperature=0.0))


def test_a_cache_that_never_compresses_reads_in_capped_chunks(model, chunk_sizes,
                                                               monkeypatch):
    """Dense (or a budget above the sequence): nothing bounds a chunk but ``CHUNK_TOKENS``, which
    keeps a chunk's scores and logits small; the capped chunks give the decode loop's results."""
    monkeypatch.setattr(forced, "CHUNK_TOKENS", 7)
    prompts, responses = rows(model, [6, 9], [40, 40], seed=2)
    params = SamplingParams(temperature=0.0)
    want, _ = forced.stepwise(engine(model, "dense"), prompts, responses, params)
    got = engine(model, "dense").replay(prompts, responses, params)
    assert chunk_sizes == [7] * 5 + [4]            # 39 decode steps
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
