"""Every config key is used: a walk over the TrainConfig dataclasses (nested sections, list
entries) must match USED, which names for each dotted key the module outside the config modules
that reads it (checked on the module's syntax tree: an attribute of that name is read there). A
new key without an entry, or an entry whose module no longer reads it, fails here. Behaviour tests
for the keys that were once validated but unused: buffer.stale_policy (tests/test_requeue.py),
cluster.placement_timeout_s (tests/test_resources.py, tests/test_bad_input_e2e.py)."""
from __future__ import annotations

import ast
import dataclasses
import typing
from functools import lru_cache
from pathlib import Path

import pytest

from launch.config import TrainConfig

REPO = Path(__file__).resolve().parent.parent

USED = {
    "run.name": "launch/train.py",
    "run.seed": "launch/train.py",
    "run.steps": "launch/train.py",
    "run.prompts_per_step": "launch/train.py",
    "run.out_dir": "launch/train.py",
    "run.eval_problems": "launch/train.py",
    "run.eval_greedy": "launch/train.py",
    "run.eval_every": "launch/train.py",
    "run.log_every": "launch/train.py",
    "run.mode": "launch/train.py",
    "run.checkpoint_every": "launch/checkpoint.py",
    "run.checkpoint_keep": "launch/checkpoint.py",
    "run.rollouts_ahead": "launch/rollouts.py",
    "run.tensorboard": "launch/metrics.py",
    "run.wandb": "launch/metrics.py",
    "run.progress": "launch/metrics.py",
    "run.max_consecutive_skips": "launch/train.py",
    "task.name": "tasks/dataset.py",
    "task.seed": "tasks/dataset.py",
    "task.n_train": "tasks/dataset.py",
    "task.n_heldout": "tasks/dataset.py",
    "task.min_terms": "tasks/__init__.py",
    "task.max_terms": "tasks/__init__.py",
    "task.max_digit": "tasks/__init__.py",
    "task.reasoning.facts": "tasks/__init__.py",
    "task.reasoning.response_tokens": "tasks/__init__.py",
    "task.reasoning.far_facts": "tasks/__init__.py",
    "task.path": "tasks/dataset.py",
    "task.heldout_path": "tasks/dataset.py",
    "task.format": "tasks/dataset.py",
    "task.prompt_field": "tasks/dataset.py",
    "task.answer_field": "tasks/dataset.py",
    "task.answer_format": "tasks/dataset.py",
    "task.prompt_template": "tasks/dataset.py",
    "task.skip_malformed": "tasks/dataset.py",
    "task.eval_sets.*.name": "tasks/dataset.py",
    "task.eval_sets.*.path": "tasks/dataset.py",
    "task.eval_sets.*.prompt_field": "tasks/dataset.py",
    "task.eval_sets.*.answer_field": "tasks/dataset.py",
    "task.eval_sets.*.answer_format": "tasks/dataset.py",
    "task.eval_sets.*.prompt_template": "tasks/dataset.py",
    "task.eval_sets.*.n": "tasks/dataset.py",
    "task.reward_timeout_s": "actors/rollout.py",
    "task.reward_fn": "tasks/__init__.py",
    "rollout.engine": "actors/rollout.py",
    "rollout.model_path": "actors/rollout.py",
    "rollout.samples_per_prompt": "actors/rollout.py",
    "rollout.max_new_tokens": "actors/rollout.py",
    "rollout.temperature": "actors/rollout.py",
    "rollout.top_p": "actors/rollout.py",
    "rollout.top_k": "actors/rollout.py",
    "rollout.stop": "actors/rollout.py",
    "rollout.logprob_mode": "actors/rollout.py",
    "rollout.seed": "actors/rollout.py",
    "rollout.num_actors": "cluster/pools.py",
    "rollout.batch_size": "actors/rollout.py",
    "rollout.dtype": "actors/native/engine.py",
    "rollout.kv.policy": "actors/rollout.py",
    "rollout.kv.budget": "actors/rollout.py",
    "rollout.kv.compress_every": "actors/native/engine.py",
    "rollout.kv.sink_tokens": "actors/native/policies.py",
    "rollout.kv.recent_ratio": "actors/native/policies.py",
    "rollout.kv.obs_window": "actors/native/engine.py",
    "rollout.kv.pool_kernel": "actors/native/policies.py",
    "rollout.distill_sparse.enabled": "actors/rollout.py",
    "rollout.distill_sparse.rank": "common/lora.py",
    "rollout.distill_sparse.alpha": "common/lora.py",
    "rollout.distill_sparse.target_modules": "common/lora.py",
    "rollout.distill_sparse.lr": "learner/distill.py",
    "rollout.distill_sparse.kl_coef": "learner/distill.py",
    "rollout.distill_sparse.divergence": "learner/distill.py",
    "rollout.kv.rkv_lambda": "actors/native/policies.py",
    "rollout.kv.schedule": "schedule/replan.py",
    "rollout.kv.bin_tokens": "actors/native/engine.py",
    "rollout.kv.budgets": "schedule/replan.py",
    "rollout.kv.probe_share": "actors/rollout.py",
    "rollout.kv.probe_budgets": "actors/probes.py",
    "rollout.kv.threshold": "schedule/replan.py",
    "rollout.kv.margin": "schedule/replan.py",
    "rollout.kv.replan_every": "schedule/replan.py",
    "rollout.kv.protect_prompt": "actors/native/engine.py",
    "rollout.kv.keep_mass": "actors/native/engine.py",
    "rollout.kv.min_budget": "actors/native/engine.py",
    "rollout.kv.objective": "schedule/replan.py",
    "rollout.kv.planner": "schedule/replan.py",
    "rollout.kv.min_budgets": "schedule/replan.py",
    "rollout.kv.verify_samples": "schedule/replan.py",
    "rollout.kv.quantile": "schedule/replan.py",
    "rollout.dense_logprobs": "actors/rollout.py",
    "rollout.dense_micro_batch": "actors/rollout.py",
    "rollout.vllm.gpu_memory_utilization": "actors/vllm/engine.py",
    "rollout.vllm.tensor_parallel_size": "actors/vllm/engine.py",
    "rollout.vllm.max_model_len": "actors/vllm/engine.py",
    "rollout.vllm.kv_cache_bytes": "actors/vllm/engine.py",
    "rollout.chat_template": "common/tokens.py",
    "rollout.max_prompt_tokens": "common/tokens.py",
    "rollout.overlong_prompt": "common/tokens.py",
    "scorer.num_actors": "cluster/pools.py",
    "scorer.micro_batch": "actors/scorer.py",
    "scorer.dtype": "actors/scorer.py",
    "buffer.capacity": "buffer/replay.py",
    "buffer.max_staleness": "buffer/replay.py",
    "buffer.stale_policy": "buffer/replay.py",
    "buffer.group_size": "buffer/replay.py",
    "buffer.root": "buffer/replay.py",
    "buffer.fsync": "buffer/replay.py",
    "buffer.segment_rows": "buffer/replay.py",
    "buffer.scoring_lease_s": "buffer/replay.py",
    "buffer.pods.enabled": "buffer/replay.py",
    "buffer.pods.keep": "buffer/replay.py",
    "correction.method": "correction/weights.py",
    "correction.log_ratio_clamp": "correction/weights.py",
    "correction.is_.enabled": "correction/weights.py",
    "correction.is_.level": "correction/weights.py",
    "correction.is_.mode": "correction/weights.py",
    "correction.is_.lower": "correction/weights.py",
    "correction.is_.upper": "correction/weights.py",
    "correction.is_.normalize": "correction/weights.py",
    "correction.is_.normalize_over": "correction/weights.py",
    "correction.rejection.enabled": "correction/weights.py",
    "correction.rejection.min_kept_share": "correction/weights.py",
    "correction.rejection.level": "correction/weights.py",
    "correction.rejection.lower": "correction/weights.py",
    "correction.rejection.upper": "correction/weights.py",
    "correction.rejection.veto_threshold": "correction/weights.py",
    "correction.tis.cap": "correction/weights.py",
    "correction.icepop.lower": "correction/weights.py",
    "correction.icepop.upper": "correction/weights.py",
    "correction.seq_mask_tis.cap": "correction/weights.py",
    "correction.seq_mask_tis.lower": "correction/weights.py",
    "correction.seq_mask_tis.upper": "correction/weights.py",
    "correction.staleness.enabled": "correction/weights.py",
    "correction.staleness.max_lag": "correction/staleness.py",
    "correction.staleness.mode": "correction/weights.py",
    "correction.staleness.lower": "correction/weights.py",
    "correction.staleness.upper": "correction/weights.py",
    "correction.staleness.lag_scaling": "correction/staleness.py",
    "correction.loss.clip_eps_low": "correction/loss.py",
    "correction.loss.clip_eps_high": "correction/loss.py",
    "correction.loss.dual_clip_c": "correction/loss.py",
    "correction.loss.kl_coef": "correction/loss.py",
    "correction.loss.kl_estimator": "correction/loss.py",
    "correction.loss.entropy_coef": "correction/loss.py",
    "correction.loss.aggregation": "correction/loss.py",
    "correction.advantage.normalize_std": "correction/loss.py",
    "correction.advantage.eps": "correction/loss.py",
    "learner.num_learners": "learner/learner.py",
    "learner.zero_stage": "learner/learner.py",
    "learner.dtype": "learner/learner.py",
    "learner.lr": "learner/learner.py",
    "learner.betas": "learner/learner.py",
    "learner.eps": "learner/learner.py",
    "learner.weight_decay": "learner/learner.py",
    "learner.lr_schedule": "learner/engine_setup.py",
    "learner.warmup_steps": "learner/engine_setup.py",
    "learner.decay_steps": "learner/engine_setup.py",
    "learner.min_lr_ratio": "learner/engine_setup.py",
    "learner.mini_batches": "learner/learner.py",
    "learner.epochs": "learner/learner.py",
    "learner.micro_batch_size": "learner/learner.py",
    "learner.max_tokens_per_micro_batch": "learner/learner.py",
    "learner.logprob_chunk_tokens": "learner/learner.py",
    "learner.gradient_checkpointing": "learner/learner.py",
    "learner.grad_clip": "learner/engine_setup.py",
    "learner.seed": "learner/learner.py",
    "learner.num_threads": "learner/learner.py",
    "learner.cpu_shm_comm": "learner/learner.py",
    "cluster.address": "cluster/ray_setup.py",
    "cluster.num_cpus": "cluster/ray_setup.py",
    "cluster.weight_sync_port": "cluster/pools.py",
    "cluster.weight_sync_backend": "cluster/pools.py",
    "cluster.weight_sync_bucket_mb": "cluster/pools.py",
    "cluster.weight_sync_timeout_s": "cluster/pools.py",
    "cluster.actor_max_restarts": "cluster/pools.py",
    "cluster.rollout_cpus": "cluster/pools.py",
    "cluster.scorer_cpus": "cluster/pools.py",
    "cluster.learner_cpus": "cluster/pools.py",
    "cluster.buffer_cpus": "cluster/pools.py",
    "cluster.rollout_gpus": "cluster/pools.py",
    "cluster.scorer_gpus": "cluster/pools.py",
    "cluster.learner_gpus": "cluster/pools.py",
    "cluster.rollout_resources": "cluster/pools.py",
    "cluster.scorer_resources": "cluster/pools.py",
    "cluster.learner_resources": "cluster/pools.py",
    "cluster.buffer_resources": "cluster/pools.py",
    "cluster.placement": "cluster/placement.py",
    "cluster.rollout_cores": "cluster/pools.py",
    "cluster.scorer_cores": "cluster/pools.py",
    "cluster.learner_cores": "cluster/pools.py",
    "cluster.placement_timeout_s": "cluster/pools.py",
    "cluster.temp_dir": "cluster/ray_setup.py",
}
def walk(cls=TrainConfig, prefix: str = "") -> list[str]:
    """Dotted keys of every leaf field; list entries of a dataclass as ``key.*.field``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        t, key = hints[f.name], f"{prefix}{f.name}"
        args = typing.get_args(t)
        if dataclasses.is_dataclass(t):
            out += walk(t, key + ".")
        elif typing.get_origin(t) is list and args and dataclasses.is_dataclass(args[0]):
            out += walk(args[0], key + ".*.")
        else:
            out.append(key)
    return out


@lru_cache(maxsize=None)
def _names_read(path: str) -> set[str]:
    tree = ast.parse((REPO / path).read_text())
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


def test_every_key_has_an_entry():
    keys = walk()
    assert len(keys) == len(set(keys)) > 100
    assert sorted(set(keys) - set(USED)) == [], "new config keys: say where each is read"
    assert sorted(set(USED) - set(keys)) == [], "entries for keys that no longer exist"


@pytest.mark.parametrize("key", sorted(USED))
def test_each_key_is_read_where_the_table_says(key):
    path = USED[key]
    assert path and not path.endswith("config.py") and not path.startswith("tests/")
    leaf = key.rsplit(".", 1)[1]
    assert leaf in _names_read(path), f"{path} never reads {key}"
