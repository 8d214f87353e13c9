"""The native engine's decode fast path: pre-transposed weights never go stale, the RoPE table
equals the model's rotary module, and the decode step equals the whole-sequence forward."""
from __future__ import annotations

import pytest
import torch

from actors.engine import SamplingParams
from actors.native import NativeEngine
from actors.native.model import Decoder, RopeTable, rotate, rotate_rows
from common.modeling import load_model
from common.testmodels import build_model

torch.set_num_threads(1)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23]]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast")
    return [build_model(root / str(s), "tiny", seed=s) for s in (1, 2)]


def test_in_place_weight_updates_reach_the_transposed_copies(models):
    mine, other = load_model(models[0]), load_model(models[1])
    eng = NativeEngine(mine)
    before = eng.generate(PROMPTS, GREEDY)
    eng.load_weights(list(other.named_parameters()), version=1)       # param.copy_: in place
    got = eng.generate(PROMPTS, GREEDY)
    want = NativeEngine(load_model(models[1])).generate(PROMPTS, GREEDY)
    # log-probs, not ids: with tied embeddings both random models greedily repeat the last token
    assert all(g.logprobs != pytest.approx(b.logprobs, abs=1e-3) for g, b in zip(got, before))
    for g, w in zip(got, want):
        assert g.response_ids == w.response_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-6)


def test_rope_table_equals_the_rotary_module(models):
    dec = Decoder(load_model(models[0]))
    table = RopeTable(dec, 300, "cpu")
    pos = torch.tensor([0, 7, 299, 128])
    x = torch.randn(4, dec.n_heads, dec.head_dim)
    cos, sin = dec.rope(torch.zeros(4, 1, dec.hidden), pos[:, None])
    want = rotate(x[:, :, None], cos, sin)[:, :, 0]
    assert torch.allclose(rotate_rows(x, *table.at(pos)), want, atol=1e-6)


def test_decode_logprobs_equal_a_teacher_forced_forward(models):
    """Greedy log-probs from the step path equal log_softmax of HF's forward over the sequence."""
    model = load_model(models[0])
    outs = NativeEngine(model).generate(PROMPTS, GREEDY)
    for o in outs:
        ids = torch.tensor([o.prompt_ids + o.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(o.prompt_ids) - 1:-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(o.prompt_ids):, None])[:, 0]
        assert torch.allclose(torch.tensor(o.logprobs), ref, atol=1e-5)
