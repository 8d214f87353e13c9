"""vLLM engine with ``rollout.kv.policy=streaming`` (sliding-window KV, no attention sinks).

* KV memory per sequence stays bounded by the window (measured from vLLM's KV manager blocks) while
  the dense engine's grows with the sequence;
* the tokens and log-probs equal the native engine's streaming policy configured to keep exactly a
  sliding window (``sink_tokens=0``, ``compress_every=1``, ``budget = window - 1``: before each decode
  step the native cache holds ``window - 1`` tokens and the new token makes ``window``), for prompts
  shorter than the window (the native engine prefills densely, vLLM windows the prefill too).
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from actors.config import KVConfig  # noqa: E402
from actors.engine import SamplingParams  # noqa: E402

from common.testmodels import VLLM_CPU, build_model  # noqa: E402

LOGP_TOL = 1e-4   # as in test_vllm_engine.py

WINDOW = 48
BLOCK = 32     # vLLM CPU default is 128; smaller blocks make the bound visible at this size
PROMPTS = [[1, 40, 41, 42, 43], [1, 60, 61], [1, 70, 71, 72, 73, 74, 75, 76, 77], [1, 50]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("vllm_sliding"), seed=1, **VLLM_CPU)


@pytest.fixture(scope="module")
def sliding(model_dir):
    from actors.vllm import VLLMEngine

    return VLLMEngine(model_dir, KVConfig(policy="streaming", budget=WINDOW, sink_tokens=0),
                      batch_size=8, kv_cache_bytes=8 << 20, block_size=BLOCK)


def test_kv_bounded_and_matches_native_window(sliding, model_dir):
    from actors.native import NativeEngine
    from common.modeling import load_model

    params = SamplingParams(max_new_tokens=200, temperature=0.0)
    outs = sliding.generate(PROMPTS, params)
    per_token = sliding.meter.bytes_per_token()
    block = sliding.meter.block_size
    for o in outs:
        assert len(o.response_ids) == 200
        assert 0 < o.peak_kv_bytes <= (WINDOW + 2 * block) * per_token
        assert o.kept_ratio < 0.7
    hf = load_model(model_dir)
    native = NativeEngine(hf, KVConfig(policy="streaming", budget=WINDOW - 1, compress_every=1,
                                       sink_tokens=0), batch_size=8)
    dense_native = NativeEngine(hf, KVConfig(policy="dense"), batch_size=8)
    ref = native.generate(PROMPTS, params)
    dense_ref = dense_native.generate(PROMPTS, params)
    assert any(a.response_ids != b.response_ids for a, b in zip(ref, dense_ref))  # window matters
    for a, b in zip(outs, ref):
        assert a.response_ids == b.response_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LOGP_TOL
        assert a.kept_ratio == pytest.approx(b.kept_ratio, abs=1e-9)


def test_dense_kv_grows_sliding_does_not(sliding, model_dir):
    from actors.vllm import VLLMEngine

    dense = VLLMEngine(model_dir, KVConfig(policy="dense"), batch_size=8, kv_cache_bytes=8 << 20,
                       block_size=BLOCK)
    short = SamplingParams(max_new_tokens=120, temperature=0.0)
    long = SamplingParams(max_new_tokens=400, temperature=0.0)
    d_short = max(o.peak_kv_bytes for o in dense.generate(PROMPTS, short))
    d_long = max(o.peak_kv_bytes for o in dense.generate(PROMPTS, long))
    s_short = max(o.peak_kv_bytes for o in sliding.generate(PROMPTS, short))
    s_long = max(o.peak_kv_bytes for o in sliding.generate(PROMPTS, long))
    assert d_long >= 3 * d_short                     # dense: grows with the sequence
    assert s_long == s_short                         # sliding: flat once past the window
    assert sliding.last_stats["peak_kv_bytes"] < dense.last_stats["peak_kv_bytes"] / 3
