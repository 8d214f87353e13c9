"""The native engine in bf16 on CPU (issue 17: its rows must compare fairly with vLLM's bf16 ones).

The engine takes its dtype from the model it is given. Greedy dense tokens equal the HF bf16
forward's argmax; sampled log-probs (float32, from bf16 logits) are within bf16 noise of a float32
teacher-forced recomputation; every KV policy runs in bf16 and its log-probs are those of its kept
sets (``recompute_logprobs`` on the same bf16 model), farther from the dense recomputation than
bf16 noise. On the CPU attention scores and softmax are float32 in every path (as vLLM's kernels);
the CUDA bf16 path is tests/test_gpu.py's.

Tolerances: ``BF16_TOL`` (5e-2, the GPU tests' bf16 bound, tests/test_gpu.py) on the largest
absolute log-prob difference. Decode and teacher forcing run different attention kernels whose
bf16 outputs round differently; the error grows with the logits' size (bf16 keeps 8 bits of
mantissa), so the test model keeps transformers' default init. No top-k/top-p in the sampled
comparisons: one rounding can move a token across the truncation boundary (log-prob -inf in one
computation, finite in the other), which says nothing about the engine.
"""
from __future__ import annotations

import pytest
import torch

from actors.config import KVConfig
from actors.engine import SamplingParams
from actors.native import NativeEngine
from actors.native.model import attend, decode_attend
from actors.native.reference import recompute_logprobs
from common.modeling import load_model
from common.testmodels import build_model

torch.set_num_threads(1)
BF16_TOL = 5e-2
POLICIES = ["streaming", "h2o", "snapkv", "rkv"]
PROMPTS = [list(range(5, 27)), [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
SAMPLED = SamplingParams(max_new_tokens=30, temperature=0.9, seed=1)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("bf16"), "tiny", seed=3)


@pytest.fixture(scope="module")
def bf16(path):
    return load_model(path, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def fp32(path):
    return load_model(path)


@pytest.mark.parametrize("family", ["tiny", "qwen3", "llama3"])
def test_dense_bf16_greedy_equals_hf_bf16_argmax(family, tmp_path):
    # a wider init than the default, so greedy continuations vary instead of repeating one token
    model = load_model(build_model(tmp_path / family, family, seed=1, initializer_range=0.1),
                       dtype=torch.bfloat16)
    eng = NativeEngine(model)
    assert eng.dec.dtype == torch.bfloat16
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0))
    assert len({t for o in outs for t in o.response_ids}) > 3
    clear_positions = 0
    for p, o in zip(PROMPTS, outs):
        ids = torch.tensor([p + o.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(p) - 1:-1].float()
        # greedy = HF's argmax wherever the top two differ by more than bf16 noise; at a near-tie
        # incremental decode and the full forward may round to either token, so there the
        # engine's token must only be one of the tied ones
        top2 = logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * BF16_TOL
        chosen = logits.gather(-1, torch.tensor(o.response_ids)[:, None]).squeeze(-1)
        assert (chosen >= top2[:, 0] - 2 * BF16_TOL).all()
        assert (logits.argmax(-1)[clear] == torch.tensor(o.response_ids)[clear]).all()
        clear_positions += int(clear.sum())
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(o.response_ids)[:, None])
        assert (ref.squeeze(-1) - torch.tensor(o.logprobs)).abs().max() < BF16_TOL
    assert clear_positions >= 8 * len(PROMPTS) // 2     # most positions are no tie: not vacuous


def test_dense_bf16_logprobs_near_float32_teacher_forcing(bf16, fp32):
    eng = NativeEngine(bf16)
    outs = eng.generate(PROMPTS, SAMPLED)
    for p, o in zip(PROMPTS, outs):
        got = torch.tensor(o.logprobs, dtype=torch.float64)
        # float32 log-probs of bf16 logits, not bf16 numbers
        assert (got != got.to(torch.bfloat16).double()).any()
        want = recompute_logprobs(fp32, p, o.response_ids, [], 0.9, sparse=False)
        assert (want.double() - got).abs().max() < BF16_TOL
    # the cache is bf16: half the bytes per token of the float32 engine
    assert eng.kv_bytes_per_token() * 2 == NativeEngine(fp32).kv_bytes_per_token()


@pytest.mark.parametrize("policy", POLICIES)
def test_sparse_bf16_logprobs_are_the_sparse_policys(bf16, fp32, policy):
    kv = KVConfig(policy=policy, budget=12, compress_every=5, sink_tokens=2, obs_window=4,
                  pool_kernel=3)
    eng = NativeEngine(bf16, kv, trace=True)
    outs = eng.generate(PROMPTS, SAMPLED)
    assert eng.last_stats["allocated_kv_bytes"] == 3 * 17 * eng.kv_bytes_per_token()   # rows * cap
    for prompt, o in zip(PROMPTS, outs):
        assert o.trace and o.kept_ratio < 1.0    # every sequence outgrew the budget
        rec = torch.tensor(o.logprobs)
        assert torch.isfinite(rec).all()
        sparse = recompute_logprobs(bf16, prompt, o.response_ids, o.trace, 0.9)
        assert (sparse - rec).abs().max() < BF16_TOL
        teacher = recompute_logprobs(fp32, prompt, o.response_ids, o.trace, 0.9)
        assert (teacher - rec).abs().max() < BF16_TOL
        dense = recompute_logprobs(bf16, prompt, o.response_ids, o.trace, 0.9, sparse=False)
        assert (dense - rec).abs().max() > BF16_TOL      # eviction shows above bf16 noise


@pytest.mark.parametrize("want_probs", [False, True])
def test_bf16_decode_attention_is_float32_inside(want_probs):
    """A decode step in bf16 against float64 attention over the same bf16 inputs: with scores and
    softmax in float32 only the output's own rounding is left (and P in bf16 before P.V on the
    probabilities path), within 1e-2 here; scores rounded to bf16 before the softmax (bf16 GEMMs'
    output) miss by more on these inputs (scores of a few units)."""
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, d, cap, s = 3, 4, 2, 32, 40, 33
    q = (torch.randn(b, hq, d, generator=g) * 2).bfloat16()
    k = (torch.randn(b, hkv, cap, d, generator=g) * 2).bfloat16()
    v = torch.randn(b, hkv, cap, d, generator=g).bfloat16()
    n = torch.tensor([33, 20, 7])
    bias = torch.zeros(b, s).masked_fill_(torch.arange(s)[None] >= n[:, None], float("-inf"))
    bias = bias.bfloat16().repeat_interleave(hkv, dim=0)[:, None]
    out, probs = decode_attend(q, k, v, s, bias, d ** -0.5, want_probs)
    assert out.dtype == torch.bfloat16
    mask = (torch.arange(s)[None] < n[:, None])[:, None, None, None]          # [B,1,1,1,S]
    ref, ref_p = attend(q.double()[:, :, None], k[:, :, :s].double(), v[:, :, :s].double(), mask,
                        d ** -0.5, want_probs=True)
    assert (out.double() - ref.reshape(b, -1)).abs().max() < 1e-2
    if want_probs:
        assert probs.dtype == torch.float32
        assert (probs.double() - ref_p[..., 0, :]).abs().max() < 1e-5
    kk = k[:, :, :s].reshape(b * hkv, s, d)
    scores = torch.baddbmm(bias, q.reshape(b * hkv, hq // hkv, d), kk.transpose(1, 2),
                           alpha=d ** -0.5)                                   # bf16 scores
    rounded = torch.bmm(torch.softmax(scores.float(), -1).bfloat16(),
                        v[:, :, :s].reshape(b * hkv, s, d)).view(b, -1)
    assert (rounded.double() - ref.reshape(b, -1)).abs().max() > 1e-2


def test_bf16_prefill_scores_match_float64():
    """``attend`` (prefill, teacher forcing) in bf16: probabilities from float32 scores."""
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(2, 4, 9, 16, generator=g) * 3).bfloat16()
    k = (torch.randn(2, 2, 9, 16, generator=g) * 3).bfloat16()
    v = torch.randn(2, 2, 9, 16, generator=g).bfloat16()
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None, None]
    _, p = attend(q, k, v, causal, 0.25, want_probs=True)
    _, ref = attend(q.double(), k.double(), v.double(), causal, 0.25, want_probs=True)
    assert p.dtype == torch.float32 and (p.double() - ref).abs().max() < 1e-5
