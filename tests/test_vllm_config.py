"""``rollout.vllm`` (actors.config.VLLMConfig): validation, the derived ``max_model_len``, and what
``VLLMEngine.from_config`` hands to vLLM's ``LLM(...)`` on CPU and (simulated) on GPU.

The engine tests record the keyword arguments of a stand-in ``LLM`` constructor, so they run on
CPU; the real GPU run is in tests/test_gpu.py (``make test-gpu``).
"""
from __future__ import annotations

import pytest

from actors.config import KVConfig, RolloutConfig, VLLMConfig
from common.errors import ConfigError
from launch.config import load_config


def _rollout(**vllm) -> RolloutConfig:
    return RolloutConfig(engine="vllm", kv=KVConfig(policy="dense"), max_new_tokens=64,
                         vllm=VLLMConfig(**vllm))


@pytest.mark.parametrize("key,value", [("gpu_memory_utilization", 0.0),
                                       ("gpu_memory_utilization", 1.5),
                                       ("tensor_parallel_size", 0),
                                       ("max_model_len", -1),
                                       ("max_model_len", 64),   # no room for a prompt token
                                       ("kv_cache_bytes", -1)])
def test_bad_values_name_the_key(key, value):
    with pytest.raises(ConfigError, match=f"rollout.vllm.{key}"):
        _rollout(**{key: value}).validate("rollout")


def test_good_values_pass():
    _rollout(gpu_memory_utilization=1.0, tensor_parallel_size=4, max_model_len=65,
             kv_cache_bytes=1 << 20).validate("rollout")


def test_vllm_keys_refused_with_the_native_engine():
    with pytest.raises(ConfigError, match="rollout.vllm.tensor_parallel_size.*vLLM-only"):
        RolloutConfig(engine="native", vllm=VLLMConfig(tensor_parallel_size=2)).validate("rollout")
    RolloutConfig(engine="native").validate("rollout")  # defaults are fine


def test_cluster_gpus_bound_tensor_parallelism_and_memory_share(tmp_path):
    base = ["rollout.engine=vllm", "rollout.kv.policy=dense"]
    with pytest.raises(ConfigError, match="rollout.vllm.tensor_parallel_size.*rollout_gpus"):
        load_config(base + ["rollout.vllm.tensor_parallel_size=2", "cluster.rollout_gpus=1"])
    with pytest.raises(ConfigError, match="rollout.vllm.gpu_memory_utilization"):
        load_config(base + ["cluster.rollout_gpus=0.5"])           # default 0.9 > half a GPU
    cfg = load_config(base + ["rollout.vllm.tensor_parallel_size=2", "cluster.rollout_gpus=2",
                              "rollout.vllm.gpu_memory_utilization=0.8"])
    assert cfg.rollout.vllm.tensor_parallel_size == 2
    assert load_config(base + ["cluster.rollout_gpus=0.5",
                               "rollout.vllm.gpu_memory_utilization=0.4"]).cluster.rollout_gpus == 0.5


def test_derived_max_model_len():
    from types import SimpleNamespace

    from actors.vllm.engine import derive_max_model_len

    model = SimpleNamespace(max_position_embeddings=2048)
    assert derive_max_model_len(_rollout(), model) == 2048          # no prompt limit: the model's
    assert derive_max_model_len(_rollout(max_model_len=300), model) == 300
    limited = _rollout()
    limited.max_prompt_tokens = 100                                   # rollout.max_prompt_tokens
    assert derive_max_model_len(limited, model) == 100 + 64


# ---- what reaches vLLM's LLM(...) -----------------------------------------------------------------

class _Stop(Exception):
    """Raised by the stand-in LLM: the engine must not go on without a real one."""


@pytest.fixture()
def llm_kwargs(monkeypatch):
    vllm = pytest.importorskip("vllm")
    seen: dict = {}

    def fake_llm(**kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    return seen


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("vllm")
    from common.testmodels import VLLM_CPU, build_model

    return str(build_model(tmp_path_factory.mktemp("vllm_cfg"),
                           **{**VLLM_CPU, "max_position_embeddings": 1024}))


def _gpu(monkeypatch, gpu: bool) -> None:
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: not gpu)


def _start(cfg, model_dir):
    from actors.vllm import VLLMEngine

    with pytest.raises(_Stop):
        VLLMEngine.from_config(cfg, model_dir)


def test_cpu_gets_an_explicit_kv_pool_and_no_tensor_parallelism(llm_kwargs, model_dir,
                                                                 monkeypatch):
    _gpu(monkeypatch, False)
    _start(_rollout(kv_cache_bytes=24 << 20), model_dir)
    assert llm_kwargs["kv_cache_memory_bytes"] == 24 << 20
    assert llm_kwargs["max_model_len"] == 1024                      # derived: the model's limit
    assert llm_kwargs["tensor_parallel_size"] == 1 and llm_kwargs["enforce_eager"] is True
    assert "gpu_memory_utilization" not in llm_kwargs
    llm_kwargs.clear()
    _start(_rollout(max_model_len=200), model_dir)                  # default pool, sized by it
    assert llm_kwargs["max_model_len"] == 200 and llm_kwargs["kv_cache_memory_bytes"] >= 16 << 20
    with pytest.raises(ConfigError, match="rollout.vllm.tensor_parallel_size.*CPU"):
        from actors.vllm import VLLMEngine

        VLLMEngine.from_config(_rollout(tensor_parallel_size=2), model_dir)


def test_gpu_gets_memory_share_tensor_parallelism_and_bf16(llm_kwargs, model_dir, monkeypatch):
    _gpu(monkeypatch, True)
    cfg = _rollout(gpu_memory_utilization=0.7, tensor_parallel_size=2)
    cfg.dtype = "bfloat16"
    _start(cfg, model_dir)
    assert llm_kwargs["gpu_memory_utilization"] == 0.7
    assert llm_kwargs["tensor_parallel_size"] == 2 and llm_kwargs["dtype"] == "bfloat16"
    assert "kv_cache_memory_bytes" not in llm_kwargs                # vLLM sizes it from the share
    assert llm_kwargs["enforce_eager"] is False and llm_kwargs["max_model_len"] == 1024
    llm_kwargs.clear()
    _start(_rollout(kv_cache_bytes=1 << 30), model_dir)             # an exact pool wins
    assert llm_kwargs["kv_cache_memory_bytes"] == 1 << 30


def test_engine_refuses_what_the_model_cannot_do(llm_kwargs, model_dir, monkeypatch):
    from actors.vllm import VLLMEngine

    _gpu(monkeypatch, True)
    with pytest.raises(ConfigError, match="tensor_parallel_size.*2 attention heads"):
        VLLMEngine.from_config(_rollout(tensor_parallel_size=4), model_dir)
    with pytest.raises(ConfigError, match="max_model_len.*max_position_embeddings \\(1024\\)"):
        VLLMEngine.from_config(_rollout(max_model_len=4096), model_dir)
    assert not llm_kwargs                                           # refused before vLLM starts


@pytest.mark.parametrize("gpu", [False, True])
def test_evicting_policies_get_no_prefix_cache_sync_scheduling_and_eager_attention(
        llm_kwargs, model_dir, monkeypatch, gpu):
    """KV eviction (actors/vllm/evict/install.py): prefix caching off, synchronous scheduling, and
    on GPU CUDA graphs only piecewise (the hooked attention must run every step); the default
    CPU pool is sized by the largest budget + N, not by max_model_len."""
    _gpu(monkeypatch, gpu)
    cfg = _rollout(max_model_len=1000)
    cfg.kv = KVConfig(policy="snapkv", budget=64, compress_every=32)
    _start(cfg, model_dir)
    assert llm_kwargs["enable_prefix_caching"] is False and llm_kwargs["async_scheduling"] is False
    if gpu:
        assert llm_kwargs["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    else:
        assert "compilation_config" not in llm_kwargs
        dense = dict(llm_kwargs)
        llm_kwargs.clear()
        cfg.kv = KVConfig(policy="dense")
        _start(cfg, model_dir)
        assert "enable_prefix_caching" not in llm_kwargs
        assert dense["kv_cache_memory_bytes"] <= llm_kwargs["kv_cache_memory_bytes"]
