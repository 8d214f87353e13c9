"""The per-row adaptive KV budget (``rollout.kv.keep_mass``): the rule on hand-made tensors, the
engine's bookkeeping under it, and the config's refusals."""
from __future__ import annotations

import pytest
import torch

from actors.config import KVConfig, RolloutConfig
from actors.engine import SamplingParams
from actors.native import NativeEngine, policies
from common.errors import ConfigError
from common.kept import evictions
from common.modeling import load_model
from common.testmodels import build_model

torch.set_num_threads(1)
PROMPTS = [list(range(5, 27)), [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [4, 5]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(str(build_model(tmp_path_factory.mktemp("m"), "tiny", seed=3)))


def kv(**kw):
    base = dict(policy="rkv", budget=16, compress_every=4, obs_window=4, pool_kernel=3,
                keep_mass=0.9, min_budget=6)
    return KVConfig(**{**base, **kw})


# ---- the rule ------------------------------------------------------------------------------------
def test_window_mass_is_each_slots_share_of_the_windows_attention():
    win = torch.full((1, 1, 2, 3, 4), float("-inf"))
    win[0, 0, :, :, :2] = 0.0                       # every query: half on slot 0, half on slot 1
    win[0, 0, 1, 2] = torch.tensor([0.0, float("-inf"), float("-inf"), float("-inf")])
    mass = policies.window_mass(win)                # [1,1,4]; 5 of 6 queries split, 1 on slot 0
    assert torch.allclose(mass[0, 0], torch.tensor([3.5 / 6, 2.5 / 6, 0.0, 0.0]))
    none = torch.full((1, 1, 1, 2, 3), float("-inf"))
    assert torch.equal(policies.window_mass(none), torch.zeros(1, 1, 3))   # sees nothing: 0


def test_coverage_follows_the_policys_ranking_forced_slots_first():
    scores = torch.tensor([[[0.1, 0.9, 0.5, 0.0, 0.3]]])
    mass = torch.tensor([[[0.4, 0.1, 0.2, 0.3, 0.0]]])
    cov = policies.coverage(policies.ranking(scores, 0, 1, torch.tensor([5])), mass)
    # order: slot 4 (forced last), then 1, 2, 0, 3 by score
    assert torch.allclose(cov[0, 0], torch.tensor([0.0, 0.1, 0.3, 0.7, 1.0]))


def test_mass_budgets_take_the_fewest_slots_holding_the_share_within_bounds():
    # two rows; one layer, two heads; coverage after k slots (k = 1..6)
    c = torch.tensor([[[0.5, 0.8, 0.9, 0.95, 1.0, 1.0], [0.7, 0.9, 0.95, 1.0, 1.0, 1.0]],
                      [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]]])
    n = torch.tensor([6, 6])
    # row 0: mean curve 0.6, 0.85, 0.925, 0.975, 1.0 -> 0.9 needs 3 slots; row 1 never: hi
    assert policies.mass_budgets([c], n, 1, 5, 0.9).tolist() == [3, 5]
    assert policies.mass_budgets([c], n, 4, 5, 0.9).tolist() == [4, 5]       # floor
    assert policies.mass_budgets([c, c], n, 1, 5, 0.97).tolist() == [4, 5]   # layers averaged
    assert policies.mass_budgets([c], torch.tensor([6, 2]), 1, 5, 0.9).tolist() == [3, 2]
    assert policies.mass_budgets([c], n, torch.tensor([5, 1]), 5, 0.9).tolist() == [5, 5]


def test_keep_rows_keeps_each_rows_own_count_in_slot_order():
    scores = torch.tensor([[[0.1, 0.9, 0.5, 0.0, 0.3]], [[0.8, 0.1, 0.2, 0.9, 0.4]]])
    order = policies.ranking(scores, 0, 1, torch.tensor([5, 5]))
    idx = policies.keep_rows(order, torch.tensor([2, 3]), 3)
    assert idx[0, 0, :2].tolist() == [1, 4]            # forced last slot, then the best
    assert idx[1, 0].tolist() == [0, 3, 4]
    # the fixed rule keeps the same slots when every row keeps the same count
    fixed = policies._keep(scores, 0, 1, torch.tensor([5, 5]), 3)
    same = policies.keep_rows(order, torch.tensor([3, 3]), 3)
    assert torch.equal(fixed, same)


# ---- the engine ------------------------------------------------------------------------------------
def test_rows_keep_their_own_budget_and_compress_every_n_steps_after(model):
    eng = NativeEngine(model, kv(protect_prompt=True), batch_size=4, trace=True)
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=40, temperature=1.0, seed=2))
    bpt = eng.kv_bytes_per_token()
    kept_counts = set()
    for p, o in zip(PROMPTS, outs):
        assert len(o.response_ids) == 40
        assert o.trace
        prev_after, prev_k = None, None
        for after, kept in o.trace:
            k = kept.shape[-1]
            kept_counts.add(k)
            assert 6 <= k <= 16 or k == len(p)          # min_budget .. budget (a long prompt)
            assert kept.shape[:2] == (eng.dec.n_layers, eng.dec.n_kv)
            if len(p) + 4 <= 16:                        # the prompt and the window fit: kept
                assert k >= len(p) + 4
                assert all(set(range(len(p))) <= set(h.tolist()) for layer in kept for h in layer)
            if prev_after is not None:    # compress_every steps after the last (from >= min)
                assert after - prev_after == min(max(prev_k, 6), 16) + 4 - prev_k
            prev_after, prev_k = after, k
        assert o.peak_kv_bytes <= (16 + 4) * bpt
    assert len(kept_counts) > 1 and min(kept_counts) < 16      # rows kept different counts


def test_adaptive_budget_holds_less_than_the_fixed_budget(model):
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=2)
    fixed = NativeEngine(model, kv(keep_mass=0.0, min_budget=0), batch_size=4)
    adapt = NativeEngine(model, kv(keep_mass=0.5), batch_size=4)
    f = sum(o.peak_kv_bytes for o in fixed.generate(PROMPTS, params))
    a = sum(o.peak_kv_bytes for o in adapt.generate(PROMPTS, params))
    assert a < f
    # a share no kept set reaches below the whole cache keeps the fixed budget: the same samples
    full = NativeEngine(model, kv(keep_mass=0.999999, min_budget=16), batch_size=4)
    assert [o.response_ids for o in full.generate(PROMPTS, params)] == \
        [o.response_ids for o in fixed.generate(PROMPTS, params)]


def test_replay_reproduces_the_adaptive_samplers_logprobs_and_kept_sets(model):
    params = SamplingParams(max_new_tokens=30, temperature=0.8, seed=5)
    eng = NativeEngine(model, kv(), batch_size=2, trace=True)
    outs = eng.generate(PROMPTS, params)
    resp = [o.response_ids for o in outs]
    for o, d in zip(outs, eng.replay(PROMPTS, resp, params)):
        got = d.gather(-1, torch.tensor(o.response_ids)[:, None]).squeeze(-1)
        assert torch.allclose(got, torch.tensor(o.logprobs), atol=1e-5)
    for o, events in zip(outs, eng.replay_kept_sets(PROMPTS, resp)):
        total = len(o.prompt_ids) + len(o.response_ids)
        assert torch.equal(evictions(o.trace, eng.dec.n_layers, eng.dec.n_kv, total),
                           evictions(events, eng.dec.n_layers, eng.dec.n_kv, total))


# ---- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, key", [
    (dict(keep_mass=1.0), "keep_mass"),
    (dict(keep_mass=-0.1), "keep_mass"),
    (dict(keep_mass=0.0, min_budget=6), "min_budget"),
    (dict(policy="h2o"), "keep_mass"),
    (dict(policy="streaming", sink_tokens=2), "keep_mass"),
    (dict(min_budget=3), "min_budget"),          # below obs_window
    (dict(min_budget=17), "min_budget"),         # above the budget
    (dict(budgets=[16, 5], bin_tokens=8), "min_budget"),   # above the smallest bin's budget
    (dict(schedule="dynamic", probe_share=0.5), "keep_mass"),
])
def test_bad_adaptive_settings_are_refused_naming_the_key(kw, key):
    with pytest.raises(ConfigError, match=f"rollout.kv.{key}"):
        kv(**kw).validate("rollout.kv")


def test_vllm_refuses_the_adaptive_budget(tmp_path):
    cfg = RolloutConfig(model_path=str(tmp_path), engine="vllm", kv=kv())
    with pytest.raises(ConfigError, match="rollout.kv.keep_mass"):
        cfg.validate("rollout")
