"""vLLM rollout engine (actors/vllm) against the native engine, on CPU with vllm-cpu.

Skipped where vLLM is not installed (it is an optional extra: requirements-vllm.txt). One module-
scoped dense engine and one sliding-window engine, each in this process (in-process engine core).
Tolerances: greedy tokens equal; per-token log-probs within 1e-4 absolute (float32 on both sides;
vLLM's CPU kernels reorder the reductions, measured differences are ~1e-6).
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from actors.config import KVConfig, RolloutConfig  # noqa: E402
from actors.engine import SamplingParams  # noqa: E402
from common.testmodels import VLLM_CPU, build_model  # noqa: E402
from common.errors import ConfigError  # noqa: E402

LOGP_TOL = 1e-4
PROMPTS = [[1, 40, 41, 42, 43], [1, 60, 61], [1, 70, 71, 72, 73, 74, 75, 76, 77], [1, 50]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("vllm_tiny"), **VLLM_CPU)


@pytest.fixture(scope="module")
def dense(model_dir):
    from actors.vllm import VLLMEngine

    return VLLMEngine(model_dir, KVConfig(policy="dense"), batch_size=8, kv_cache_bytes=8 << 20)


@pytest.fixture(scope="module")
def native(model_dir):
    from actors.native import NativeEngine
    from common.modeling import load_model

    return NativeEngine(load_model(model_dir), KVConfig(policy="dense"), batch_size=8)


def greedy(n: int = 24, stop=()):
    return SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=tuple(stop))


def test_greedy_matches_native(dense, native):
    v = dense.generate(PROMPTS, greedy())
    n = native.generate(PROMPTS, greedy())
    assert len({tuple(o.response_ids) for o in n}) > 1
    for a, b in zip(v, n):
        assert a.prompt_ids == b.prompt_ids
        assert a.response_ids == b.response_ids
        assert a.finish_reason == b.finish_reason == "length"
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LOGP_TOL
        assert a.kept_ratio == b.kept_ratio == 1.0


def test_sampled_logprobs_are_processed(dense, native):
    """Sampling at T=0.7 with top-k 20: recompute the processed log-probs of the sampled tokens
    with the native sampler's truncation from HF logits; they must match vLLM's."""
    from actors.native.sampling import truncate
    from common.modeling import load_model

    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=20, top_p=0.9, seed=3)
    outs = dense.generate(PROMPTS[:2] * 2, params)
    assert outs[0].response_ids != outs[2].response_ids or outs[1].response_ids != outs[3].response_ids
    model = load_model(dense.model_path)
    for o in outs:
        ids = torch.tensor([o.prompt_ids + o.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(o.prompt_ids) - 1:-1].float()
        ref = torch.log_softmax(truncate(logits / 0.7, 20, 0.9), -1)
        ref = ref.gather(-1, torch.tensor(o.response_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(o.logprobs), ref, atol=LOGP_TOL)


def test_stop_token_kept_and_seeded(dense):
    first = dense.generate(PROMPTS[:1], greedy(24))[0].response_ids
    stop = first[5]
    out = dense.generate(PROMPTS[:1], greedy(24, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and out.response_ids[-1] == stop
    assert out.response_ids == first[:first.index(stop) + 1]
    p = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7)
    assert [o.response_ids for o in dense.generate(PROMPTS, p)] == \
        [o.response_ids for o in dense.generate(PROMPTS, p)]


def test_stop_strings_match_native(dense, native):
    """vLLM's own stop-string check (incremental detokenization) and the native engine's tail
    decoding end every row at the same token, with log-probs for every kept token."""
    from common.modeling import load_tokenizer

    tok = load_tokenizer(dense.model_path)
    full = native.generate(PROMPTS, greedy(24))
    ref = full[0].response_ids
    stop = tok.decode(ref[8:10], skip_special_tokens=True)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, stop=(stop, "\x7f\x7f"))
    v, n = dense.generate(PROMPTS, params), native.generate(PROMPTS, params)
    assert n[0].finish_reason == "stop" and len(n[0].response_ids) <= 10
    for a, b in zip(v, n):
        assert a.response_ids == b.response_ids
        assert a.finish_reason == b.finish_reason
        assert len(a.logprobs) == len(a.response_ids)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LOGP_TOL


def test_reload_changes_output_and_restores_exactly(dense, model_dir):
    from common.modeling import checksum, load_model

    hf = load_model(model_dir)
    original = [(n, p.detach().clone()) for n, p in hf.named_parameters()]
    before = dense.generate(PROMPTS, greedy())
    assert dense.state_checksum() == pytest.approx(checksum(hf.named_parameters()), rel=1e-12)
    torch.manual_seed(1)
    noisy = [(n, t + 0.3 * torch.randn_like(t)) for n, t in original]
    dense.load_weights(noisy, version=1)
    changed = dense.generate(PROMPTS, greedy())
    assert [o.response_ids for o in changed] != [o.response_ids for o in before]
    assert dense.version == 1
    assert dense.state_checksum() == pytest.approx(checksum(noisy), rel=1e-12)
    dense.load_weights(original, version=2)
    after = dense.generate(PROMPTS, greedy())
    for a, b in zip(after, before):
        assert a.response_ids == b.response_ids and a.logprobs == b.logprobs


def test_reloaded_weights_are_the_ones_sampled(dense, native):
    """After a reload the engine samples from the new weights, tied lm_head included: greedy
    tokens and log-probs equal the native engine's over the same tensors (vLLM's in-place reload
    left a tied head's CPU kernel on the old weights)."""
    original = [(n, p.detach().clone()) for n, p in native.model.named_parameters()]
    torch.manual_seed(2)
    for only in ("embed_tokens", ""):      # the tied embedding alone, then every tensor
        noisy = [(n, t + 0.05 * torch.randn_like(t) if only in n else t) for n, t in original]
        native.load_weights(noisy, version=1)
        dense.load_weights(noisy, version=1)
        for a, b in zip(dense.generate(PROMPTS, greedy()), native.generate(PROMPTS, greedy())):
            assert a.response_ids == b.response_ids, only
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LOGP_TOL, only
    native.load_weights(original, version=2)
    dense.load_weights(original, version=2)


def test_too_long_prompt_fails_cleanly(dense):
    with pytest.raises(Exception, match="maximum context length"):   # vLLM's validation error
        dense.generate([[1, 40], [1] * 5000], greedy(4))
    assert not dense.llm.llm_engine.has_unfinished_requests()
    assert len(dense.generate(PROMPTS[:1], greedy(4))[0].response_ids) == 4


def test_bad_weights_rejected_before_reload(dense):
    name, shape = next((n, s) for n, (s, _) in dense._spec.items())
    with pytest.raises(ValueError, match="no parameter"):
        dense.load_weights([("nope.weight", torch.zeros(3))], version=5)
    with pytest.raises(ValueError, match="shape"):
        dense.load_weights([(name, torch.zeros(*shape[:-1], shape[-1] + 1))], version=5)
    with pytest.raises(ValueError, match="non-finite"):
        dense.load_weights([(name, torch.full(shape, float("nan")))], version=5)
    with pytest.raises(ValueError, match="whole models only"):       # partial reloads corrupt
        dense.load_weights([(name, torch.zeros(shape))], version=5)
    assert dense.version != 5
    assert len(dense.generate(PROMPTS[:1], greedy(4))[0].response_ids) == 4   # still alive


def test_evicting_engine_refuses_tensor_parallelism(model_dir):
    from actors.vllm import VLLMEngine

    with pytest.raises(ConfigError, match="rollout.vllm.tensor_parallel_size"):
        VLLMEngine(model_dir, KVConfig(policy="snapkv", budget=64), tensor_parallel_size=2)


def test_from_config_and_weight_spec(dense):
    from cluster.weight_sync import weight_spec

    spec = weight_spec(dense.model)
    assert all(t.is_floating_point() for _, _, t in [(0, 0, torch.zeros(1, dtype=d))
                                                     for _, _, d in spec])
    assert {n for n, _, _ in spec} == set(dense._spec)
    assert "model.layers.0.self_attn.q_proj.weight" in dense._spec
    cfg = RolloutConfig(engine="vllm")
    assert cfg.engine.value == "vllm"
