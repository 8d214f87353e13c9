"""Native engine, dense policy: equals HF forward for every test-model family (Qwen2, Qwen2.5,
Qwen3, Llama-3 with llama3 RoPE scaling, GQA 4), ragged prompts, sampling, stop tokens."""
from __future__ import annotations

import math

import pytest
import torch

from actors.engine import SamplingParams
from actors.native import NativeEngine
from actors.native.model import Decoder
from common.modeling import load_model
from common.testmodels import FAMILIES, build_model

torch.set_num_threads(1)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(family, tmp_path_factory):
    return load_model(build_model(tmp_path_factory.mktemp(family), family, seed=1))


def hf_logits(model, prompt, response):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        return model(ids).logits[0, len(prompt) - 1:-1].float()


def test_dense_greedy_matches_hf_forward(model):
    outs = NativeEngine(model).generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0))
    for p, o in zip(PROMPTS, outs):
        logits = hf_logits(model, p, o.response_ids)
        assert logits.argmax(-1).tolist() == o.response_ids
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(o.response_ids)[:, None])
        assert torch.allclose(ref.squeeze(-1), torch.tensor(o.logprobs), atol=1e-5)
        assert o.finish_reason == "length" and o.kept_ratio == 1.0 and o.prompt_ids == p


def test_forward_full_logits_equal_hf(model):
    """Dense logits of the engine's own attention == HF forward over 96 tokens (past the llama3
    family's original_max_position_embeddings of 64). Tolerance 1e-4 on float32 logits: the two
    sum the same products in a different order."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 96), generator=g)
    causal = torch.ones(96, 96, dtype=torch.bool).tril()[None, None, None]
    got = Decoder(model).forward_full(ids, torch.arange(96)[None].expand(2, -1), lambda i: causal)
    with torch.no_grad():
        want = model(ids).logits.float()
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())


def test_any_of_several_stop_ids_ends_a_row(model):
    """Llama-3 style: generation_config lists several eos ids; whichever comes first ends the row."""
    eng = NativeEngine(model)
    greedy = dict(max_new_tokens=12, temperature=0)
    full = eng.generate(PROMPTS, SamplingParams(**greedy))[0].response_ids
    a, b = full[6], full[3]
    cut = min(full.index(a), full.index(b))
    out = eng.generate(PROMPTS[:1], SamplingParams(**greedy, stop_token_ids=(a, b)))[0]
    assert out.finish_reason == "stop" and out.response_ids == full[:cut + 1]


def test_batched_equals_one_by_one(model):
    eng = NativeEngine(model)
    params = SamplingParams(max_new_tokens=10, temperature=0)
    together = eng.generate(PROMPTS, params)
    for p, o in zip(PROMPTS, together):
        alone = eng.generate([p], params)[0]
        assert alone.response_ids == o.response_ids
        assert max(abs(a - b) for a, b in zip(alone.logprobs, o.logprobs)) < 1e-5


def naive_processed_logprob(logits, temperature, top_k, top_p, token):
    """Independent reference: loop over sorted tokens."""
    scaled = (logits / temperature).tolist()
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = order[:top_k] if top_k else order
    z = [math.exp(scaled[i]) for i in keep]
    total = sum(z)
    kept, mass = [], 0.0
    for i, e in zip(keep, z):
        if mass >= top_p:
            break
        kept.append(i)
        mass += e / total
    if token not in kept:
        return None
    norm = math.log(sum(math.exp(scaled[i]) for i in kept))
    return scaled[token] - norm


@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_sampled_logprobs_are_of_the_sampling_distribution(model, mode):
    t, k, p = 0.8, 20, 0.9
    params = SamplingParams(max_new_tokens=12, temperature=t, top_k=k, top_p=p, seed=3,
                            logprob_mode=mode)
    for prompt, o in zip(PROMPTS, NativeEngine(model).generate(PROMPTS, params)):
        logits = hf_logits(model, prompt, o.response_ids)
        for step, tok in enumerate(o.response_ids):
            ref = naive_processed_logprob(logits[step], t, k, p, tok)
            assert ref is not None, "sampled a token outside the top-k/top-p support"
            if mode == "raw":
                ref = float(torch.log_softmax(logits[step] / t, -1)[tok])
            assert abs(ref - o.logprobs[step]) < 1e-4


def test_seeded_sampling_is_reproducible(model):
    eng = NativeEngine(model)
    a = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, seed=7))
    b = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, seed=7))
    c = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, seed=8))
    assert [o.response_ids for o in a] == [o.response_ids for o in b]
    assert [o.response_ids for o in a] != [o.response_ids for o in c]


def test_stop_tokens_end_rows_and_others_continue(model):
    eng = NativeEngine(model, batch_size=2)     # also exercises several engine batches
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    full = eng.generate(PROMPTS, greedy)
    stop = full[0].response_ids[3]
    cut = full[0].response_ids.index(stop)
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0,
                                                stop_token_ids=(stop,)))
    assert outs[0].finish_reason == "stop"
    assert outs[0].response_ids == full[0].response_ids[:cut + 1]
    for f, o in zip(full, outs):
        n = len(o.response_ids)
        assert o.response_ids == f.response_ids[:n]
        assert (o.finish_reason == "stop") == (stop in o.response_ids)


def test_load_weights_and_checksum(family, tmp_path):
    other = load_model(build_model(tmp_path / "other", family, seed=2))
    eng = NativeEngine(load_model(build_model(tmp_path / "mine", family, seed=1)))
    assert eng.state_checksum() != NativeEngine(other).state_checksum()
    eng.load_weights(list(other.named_parameters()), version=5)
    assert eng.version == 5
    assert eng.state_checksum() == NativeEngine(other).state_checksum()
    with pytest.raises(KeyError, match="no parameter"):
        eng.load_weights([("nope.weight", torch.zeros(1))], version=6)


def test_bfloat16_model_runs_with_a_bf16_cache(model, family, tmp_path):
    from actors.config import KVConfig

    bf = load_model(build_model(tmp_path / "bf", family, seed=1),
                    dtype=torch.bfloat16)
    eng = NativeEngine(bf, KVConfig(policy="h2o", budget=8, compress_every=4))
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, seed=0))
    assert all(len(o.response_ids) == 12 and all(math.isfinite(x) and x <= 0 for x in o.logprobs)
               for o in outs)
    per_token_fp32 = NativeEngine(model, KVConfig(policy="h2o", budget=8, compress_every=4))
    per_token_fp32.generate(PROMPTS, SamplingParams(max_new_tokens=12, seed=0))
    assert eng.last_stats["allocated_kv_bytes"] * 2 == per_token_fp32.last_stats["allocated_kv_bytes"]


def test_replaced_parameters_are_picked_up(family, tmp_path):
    """Fused QKV/gate-up weights are rebuilt when parameters are replaced, not updated in place."""
    mine = load_model(build_model(tmp_path / "a", family, seed=1))
    other = load_model(build_model(tmp_path / "b", family, seed=2))
    eng = NativeEngine(mine)
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    eng.generate(PROMPTS, greedy)
    state = {k: v.clone() for k, v in other.state_dict().items()}
    mine.load_state_dict(state, assign=True)
    want = NativeEngine(other).generate(PROMPTS, greedy)
    got = eng.generate(PROMPTS, greedy)
    for g, w in zip(got, want):
        assert g.response_ids == w.response_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-6)
