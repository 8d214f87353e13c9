"""bench/rollout.py's equal-KV-memory comparison: the batch it picks fits in dense's KV bytes (the
largest that does), measured by the engine itself; those rows stay out of the issue's bars."""
from __future__ import annotations

import pytest

from bench.rollout import (bars, equal_memory_info, memory_matched_batch, native_kv_bytes, prompts,
                           run_native)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from common.testmodels import build_model
    from common.modeling import load_model

    return load_model(build_model(tmp_path_factory.mktemp("bench") / "m", "tiny", seed=0))


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "rkv"])
def test_memory_matched_batch_is_the_largest_that_fits(model, policy):
    gen_len, prompt_len, every, frac, dense_batch = 64, 4, 8, 0.25, 3
    vocab = model.config.vocab_size
    dense = run_native(model, prompts(dense_batch, prompt_len, vocab), gen_len, "dense", None, every)
    limit = dense["peak_kv_bytes"]
    assert limit == native_kv_bytes(model, gen_len, prompt_len, "dense", None, every, dense_batch)
    b = memory_matched_batch(model, gen_len, prompt_len, policy, frac, every, limit)
    assert b > dense_batch   # budget 16 + N 8 = 24 slots per row vs dense's 68
    sparse = run_native(model, prompts(b, prompt_len, vocab), gen_len, policy, frac, every)
    assert sparse["peak_kv_bytes"] == native_kv_bytes(model, gen_len, prompt_len, policy, frac,
                                                      every, b)
    assert sparse["peak_kv_bytes"] <= limit
    assert native_kv_bytes(model, gen_len, prompt_len, policy, frac, every, b + 1) > limit


def test_memory_matched_rows_are_info_not_bars():
    base = {"model": "tiny", "engine": "native", "gen_len": 2048, "budget_frac": 0.25,
            "compress_every": 128}
    rows = [dict(base, policy="dense", budget_frac=1.0, compress_every=0, batch=16, tok_per_s=100.0,
                 speed_vs_dense=1.0, kv_vs_dense=1.0),
            dict(base, policy="rkv", batch=16, tok_per_s=150.0, speed_vs_dense=1.5, kv_vs_dense=0.31,
                 attn_vs_dense=0.5),
            dict(base, policy="rkv", batch=51, tok_per_s=300.0, speed_vs_dense=3.0,
                 kv_vs_dense=0.99, memory_matched=True)]
    lines = bars(rows)
    assert len(lines) == 2 and not any(ok for _, ok in lines)   # same-batch speed 1.5x, KV 0.31
    assert "attention alone would give 2.00x" in lines[0][0]
    info, = equal_memory_info(rows)
    assert "sparse at equal KV memory: 3.00x dense tokens/s (batch 51 vs 16" in info
