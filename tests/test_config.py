"""The composed config: presets load, bad input names its key, shipped YAMLs all parse."""
from __future__ import annotations


import pytest

from common.errors import ConfigError
from launch.config import CONFIG_DIR, TrainConfig, load_config, parse_args

PRESETS = sorted(CONFIG_DIR.glob("*.yaml"))


def test_there_are_presets():
    assert (CONFIG_DIR / "default.yaml") in PRESETS


@pytest.mark.parametrize("path", PRESETS, ids=[p.name for p in PRESETS])
def test_every_preset_loads_and_validates(path):
    cfg = load_config(["--config", str(path)])
    assert isinstance(cfg, TrainConfig)
    assert cfg.run.steps >= 0


def test_defaults_without_args_use_default_yaml():
    a = load_config([])
    b = load_config(["--config", str(CONFIG_DIR / "default.yaml")])
    assert a == b


def test_override_changes_value():
    cfg = load_config(["run.steps=3", "rollout.temperature=0.7"])
    assert cfg.run.steps == 3 and cfg.rollout.temperature == pytest.approx(0.7)


def test_unknown_key_names_key_and_allowed():
    with pytest.raises(ConfigError) as e:
        load_config(["rollout.temprature=0.7"])
    assert "rollout.temprature" in str(e.value)
    assert "temperature" in str(e.value)  # the allowed keys are listed


def test_unknown_section_names_key():
    with pytest.raises(ConfigError, match="nosuch"):
        load_config(["nosuch.key=1"])


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match="run.steps"):
        load_config(["run.steps=many"])


def test_bad_enum_lists_choices():
    with pytest.raises(ConfigError) as e:
        load_config(["rollout.kv.policy=magic"])
    msg = str(e.value)
    assert "rollout.kv.policy" in msg and "streaming" in msg


def test_out_of_range_names_key():
    with pytest.raises(ConfigError, match="rollout.temperature"):
        load_config(["rollout.temperature=-1"])
    with pytest.raises(ConfigError, match="run.prompts_per_step"):
        load_config(["run.prompts_per_step=0"])


def test_bad_yaml_key_names_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  stepz: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(["--config", str(bad)])
    assert "run.stepz" in str(e.value) and "bad.yaml" in str(e.value)


def test_missing_file_and_bad_arg():
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(["--config", "nope.yaml"])
    with pytest.raises(ConfigError):
        parse_args(["--steps"])


def test_vllm_engine_policies_at_load():
    """Every policy loads with the vLLM engine; what it cannot do is refused naming the key:
    per-bin budgets on its sliding window, eviction across tensor-parallel workers, probes."""
    for policy in ("streaming", "h2o", "snapkv", "rkv"):
        cfg = load_config(["rollout.engine=vllm", f"rollout.kv.policy={policy}"])
        assert cfg.rollout.engine.value == "vllm"
    cfg = load_config(["rollout.engine=vllm", "rollout.kv.policy=rkv", "rollout.kv.budgets=[64,32]",
                       "rollout.kv.protect_prompt=true", "rollout.dense_logprobs=true",
                       "correction.staleness.enabled=true"])
    assert cfg.rollout.kv.budgets == [64, 32]
    with pytest.raises(ConfigError, match="rollout.kv.budgets"):
        load_config(["rollout.engine=vllm", "rollout.kv.policy=streaming",
                     "rollout.kv.budgets=[64,32]"])
    with pytest.raises(ConfigError, match="rollout.vllm.tensor_parallel_size"):
        load_config(["rollout.engine=vllm", "rollout.kv.policy=snapkv",
                     "rollout.vllm.tensor_parallel_size=2", "cluster.rollout_gpus=2"])
    with pytest.raises(ConfigError, match="rollout.kv.probe_share"):
        load_config(["rollout.engine=vllm", "rollout.kv.policy=snapkv", "rollout.kv.probe_share=0.1"])


def test_async_needs_a_buffer_that_keeps_one_version_old_samples():
    with pytest.raises(ConfigError, match="buffer.max_staleness"):
        load_config(["run.mode=async", "buffer.max_staleness=0"])
    assert load_config(["run.mode=async"]).buffer.max_staleness >= 1
    assert load_config(["buffer.max_staleness=0"]).run.mode.value == "sync"


def test_rollouts_ahead_is_async_only_and_bounded_by_max_staleness():
    assert load_config([]).run.rollouts_ahead == 1
    cfg = load_config(["run.mode=async", "buffer.max_staleness=2", "run.rollouts_ahead=2"])
    assert cfg.run.rollouts_ahead == 2
    for bad in (["run.mode=async", "run.rollouts_ahead=0"],
                ["run.mode=async", "buffer.max_staleness=2", "run.rollouts_ahead=3"],
                ["run.mode=sync", "buffer.max_staleness=2", "run.rollouts_ahead=2"]):
        with pytest.raises(ConfigError, match="run.rollouts_ahead"):
            load_config(bad)


def test_scorer_and_learner_dtypes_must_match():
    cfg = load_config(["scorer.dtype=bfloat16", "learner.dtype=bfloat16"])
    assert cfg.learner.dtype.value == cfg.scorer.dtype.value == "bfloat16"
    with pytest.raises(ConfigError) as e:
        load_config(["learner.dtype=bfloat16"])
    assert e.value.key == "scorer.dtype" and "learner.dtype (bfloat16)" in str(e.value)
    with pytest.raises(ConfigError) as e:  # one vocabulary: torch's names, in every section
        load_config(["learner.dtype=bf16"])
    assert e.value.key == "learner.dtype" and "'bfloat16'" in str(e.value)


def test_ppo_keys_reach_the_learner_config():
    cfg = load_config(["learner.mini_batches=4", "learner.epochs=2",
                       "learner.max_tokens_per_micro_batch=4096", "learner.gradient_checkpointing=true",
                       "learner.logprob_chunk_tokens=512"])
    assert (cfg.learner.mini_batches, cfg.learner.epochs, cfg.learner.max_tokens_per_micro_batch,
            cfg.learner.gradient_checkpointing, cfg.learner.logprob_chunk_tokens) == \
        (4, 2, 4096, True, 512)
    with pytest.raises(ConfigError) as e:
        load_config(["learner.mini_batches=0"])
    assert e.value.key == "learner.mini_batches"
    with pytest.raises(ConfigError) as e:  # whole groups per mini-batch
        load_config(["learner.mini_batches=5", "run.prompts_per_step=4"])
    assert e.value.key == "learner.mini_batches" and "run.prompts_per_step (4)" in str(e.value)
