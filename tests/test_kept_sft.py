"""SFT under a compressed cache's kept sets (``launch/make_base_model.py --kept-share``, issue 28):
the engine's teacher-forced kept sets are the ones sampling records, an uncompressed budget gives
the dense loss, a small one changes it, and bad options are refused by name."""
from __future__ import annotations

import random

import pytest
import torch

from actors.config import KVConfig
from actors.engine import SamplingParams
from actors.native import NativeEngine
from common.kept import NEVER
from common.modeling import load_model
from common.testmodels import build_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_model(tmp_path_factory.mktemp("kept")))


@pytest.mark.parametrize("policy", ["rkv", "snapkv", "streaming"])
def test_replay_kept_sets_are_the_sampled_ones(model, policy):
    """Forcing a sampled response through the engine again compresses at the same points and
    keeps the same positions per layer and KV head as sampling it did."""
    kv = KVConfig(policy=policy, budget=10, compress_every=4, obs_window=3, pool_kernel=3)
    prompts = [[1, 5, 6], [1] + list(range(30, 52)), [1, 9, 10, 11]]
    outs = NativeEngine(model, kv, batch_size=2, trace=True).generate(
        prompts, SamplingParams(max_new_tokens=30, temperature=1.0, seed=3))
    got = NativeEngine(model, kv, batch_size=3, trace=True).replay_kept_sets(
        prompts, [o.response_ids for o in outs])
    for o, trace in zip(outs, got):
        assert len(trace) == len(o.trace) >= 4
        for (a_after, a_kept), (b_after, b_kept) in zip(o.trace, trace):
            assert a_after == b_after and torch.equal(a_kept, b_kept)
    with pytest.raises(ValueError, match="trace=True"):
        NativeEngine(model, kv).replay_kept_sets(prompts, [o.response_ids for o in outs])


def _args(**kw):
    from launch.make_base_model import parse_args

    a = parse_args(["--task", "reasoning"])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_batch_loss_dense_when_nothing_is_evicted_and_not_otherwise(model):
    from launch.make_base_model import batch_loss, collate, kept_set_evictions
    from learner.distill import register_attention

    register_attention()
    rng = random.Random(0)
    examples = []
    for n in (40, 33, 47, 38, 90):                       # prompt 6, response and EOS n - 6
        ids = [1] + [rng.randint(3, 200) for _ in range(n - 1)]
        examples.append((ids, [-100] * 6 + ids[6:]))     # the last one: a long "drill"
    batch = collate(examples, pad_id=0)
    args = _args(kept_compress_every=4)
    model.train()
    dense = model(**batch).loss                          # every row padded to the longest
    ev = kept_set_evictions(model, examples[:2], 64, "rkv", 4, 47)
    assert ev.shape == (2, model.config.num_hidden_layers * model.config.num_key_value_heads, 47)
    assert (ev == NEVER).all()                           # the budget holds every sequence
    assert model.training                                # the replay leaves the mode as it was
    # Each group padded to its own longest: the same mean token loss as one padded batch.
    assert torch.allclose(batch_loss(model, examples, 0, 4, 0, 0, args), dense, atol=1e-5)
    assert torch.allclose(batch_loss(model, examples, 0, 4, 2, 64, args), dense, atol=1e-5)
    assert torch.allclose(batch_loss(model, examples, 0, 5, 0, 0, args), dense, atol=1e-5)
    assert model.config._attn_implementation != "sparse_kept_sets"
    ev = kept_set_evictions(model, examples[:2], 12, "rkv", 4, 47)
    assert (ev[0, :, :40] != NEVER).any() and (ev[0, :, 40:] == NEVER).all()   # padding never
    assert (ev[ev != NEVER] >= 12).all()                 # nothing goes before the budget fills
    sparse = batch_loss(model, examples, 0, 4, 2, 12, args)
    assert not torch.allclose(sparse, dense, atol=1e-4)
    every = batch_loss(model, examples, 0, 4, 4, 12, args)   # all task rows kept, none dense
    assert torch.isfinite(every) and not torch.allclose(every, sparse, atol=1e-5)
    sparse.backward()                                    # the kept rows' loss trains the model
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("bad, match", [
    (["--kept-share", "1.5"], "--kept-share 1.5 must lie in"),
    (["--kept-budgets", "90,x"], "--kept-budgets '90,x': not comma-separated integers"),
    (["--kept-budgets", "0,90"], "budgets must be >= 1"),
    (["--kept-budgets", ""], "--kept-share > 0 needs --kept-budgets"),
    (["--kept-compress-every", "0"], "--kept-compress-every 0 must be >= 1"),
])
def test_bad_kept_options_refused_by_name(tmp_path, bad, match):
    import launch.make_base_model as mbm

    with pytest.raises(SystemExit, match=match):
        mbm.build(mbm.parse_args(["--task", "reasoning", "--out", str(tmp_path / "x"), *bad]),
                  log=lambda s: None)
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.tmp").exists()
