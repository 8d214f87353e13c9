"""DistillSparse on ``rollout.engine=vllm``: the sampler is vLLM's own LoRA over the base weights.

The same broadcast (base weights + adapter) reaches a vLLM and a native rollout actor; the vLLM
sampler (LoRA beside each base layer, SnapKV eviction) must sample what the native one does (the
adapter merged into a copy of the model): equal greedy tokens, log-probs within 1e-4, the same
kept sets (the rows' ``kv_evictions``, what the learner recomputes the sparse log-probs under).
The dense paths (evaluation's ``dense_view``) stay the base model's.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from actors.config import DistillSparseConfig, KVConfig, RolloutConfig  # noqa: E402
from actors.engine import SamplingParams  # noqa: E402
from common import lora  # noqa: E402
from common.testmodels import VLLM_CPU, build_model  # noqa: E402
from conftest import ContainsAnswer  # noqa: E402
from tasks.base import Problem  # noqa: E402

LOGP_TOL = 1e-4
PROMPTS = [[1, 5, 9, 3, 7, 11, 4], [1, 40, 41, 42], [1, 7, 7, 7, 7, 7, 7, 7, 7, 30]]
KV = dict(policy="snapkv", budget=16, compress_every=8, obs_window=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_model(tmp_path_factory.mktemp("vllm_distill"), **VLLM_CPU))


def actor(model_dir, engine: str):
    from actors.rollout import RolloutActor

    cfg = RolloutConfig(engine=engine, model_path=model_dir, samples_per_prompt=2,
                        max_new_tokens=32, batch_size=8, kv=KVConfig(**KV),
                        distill_sparse=DistillSparseConfig(enabled=True))
    a = RolloutActor(cfg, task_cfg=None, model_path=model_dir, actor_id=1)
    a._task = ContainsAnswer()
    return a


def broadcast(model_dir, seed: int) -> list:
    """A weight broadcast: the base weights, perturbed, then a random (non-zero) adapter."""
    from common.modeling import load_model

    hf = load_model(model_dir)
    g = torch.Generator().manual_seed(seed)
    base = [(n, p.detach() + 0.02 * torch.randn(p.shape, generator=g))
            for n, p in hf.named_parameters()]
    adapter = [(n, 0.2 * torch.randn(shape, generator=g))
               for n, shape, _ in lora.adapter_spec(hf, DistillSparseConfig(enabled=True))]
    return base + adapter


@pytest.fixture(scope="module")
def actors(model_dir):
    return actor(model_dir, "vllm"), actor(model_dir, "native")


def greedy():
    return SamplingParams(max_new_tokens=32, temperature=0.0)


def same(v_outs, n_outs) -> None:
    for a, b in zip(v_outs, n_outs):
        assert a.response_ids == b.response_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LOGP_TOL


@pytest.mark.parametrize("seed", [0, 1])   # two broadcasts in turn: the adapter is reloaded
def test_vllm_sampler_is_the_native_merged_one(actors, model_dir, seed):
    v, n = actors
    named = broadcast(model_dir, seed)
    for a in (v, n):
        a.load_weights(list(named), version=seed + 1)
    assert v.state_checksum() == pytest.approx(n.state_checksum(), rel=1e-9)
    sv, sn = v._sampler().generate(PROMPTS, greedy()), n._sampler().generate(PROMPTS, greedy())
    same(sv, sn)
    assert all(o.trace for o in sv), "every sample was compacted"
    assert v.adapter.evictions(sv) == n.adapter.evictions(sn)
    # the dense paths are the base model's, without the adapter
    dv, dn = v._dense_engine().generate(PROMPTS, greedy()), n._dense_engine().generate(PROMPTS,
                                                                                       greedy())
    same(dv, dn)
    assert [o.response_ids for o in dv] != [o.response_ids for o in sv]


def test_vllm_rows_carry_the_kept_sets(actors):
    v, n = actors
    problems = [Problem(0, "1+2=", "3"), Problem(7, "hello", "o")]
    rv, rn = v.rollout(problems, version=v.version), n.rollout(problems, version=n.version)
    assert len(rv) == len(rn) == 4
    for a, b in zip(rv, rn):
        assert set(a) == set(b)
        total = len(a["prompt_ids"]) + len(a["response_ids"])
        assert len(a["kv_evictions"]) == v.adapter.layers * v.adapter.kv_heads * total
