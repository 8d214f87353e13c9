"""The GPU presets mirror the paper's runs (Sparse-RL, Luo et al. 2026) and their data resolve.

They cannot train here (no GPU, no Qwen/Llama weights): what is checked is what a typo would break,
the recipe's numbers, the stated GPU split, and that the evaluation sets load from ../shared/data
with the same prompt format as the training file."""
from __future__ import annotations

import pytest

from launch.config import CONFIG_DIR, load_config

PRESETS = ["qwen2.5-1.5b-math", "qwen2.5-3b-math", "qwen2.5-7b-math", "llama3.2-1b-instruct-math"]


@pytest.mark.parametrize("name", PRESETS)
def test_gpu_preset_is_the_paper_recipe(name):
    cfg = load_config(["--config", str(CONFIG_DIR / f"{name}.yaml")])
    r, lrn, loss = cfg.rollout, cfg.learner, cfg.correction.loss
    assert (r.kv.policy.value, r.kv.budget, r.kv.compress_every) == ("rkv", 512, 128)
    assert r.max_new_tokens == 4096 and r.samples_per_prompt == 8
    assert cfg.run.prompts_per_step * r.samples_per_prompt == 1024
    assert 1024 // lrn.mini_batches == 256                       # mini-batches of 256 samples
    assert (lrn.lr, loss.kl_coef, loss.kl_estimator.value) == (1e-6, 1e-4, "k3")
    assert (lrn.weight_decay, tuple(lrn.betas)) == (0.1, (0.9, 0.98))   # the reference's Adam
    assert loss.clip_eps_low == loss.clip_eps_high == 0.2
    assert {r.dtype.value, cfg.scorer.dtype.value, lrn.dtype.value} == {"bfloat16"}
    assert cfg.correction.is_.normalize_over.value == "valid"   # the reference code's choice
    c = cfg.cluster
    assert c.weight_sync_backend.value == "nccl" and c.rollout_gpus == c.scorer_gpus == \
        c.learner_gpus == 1                                    # one NCCL rank per GPU
    assert lrn.gradient_checkpointing and lrn.zero_stage in (2, 3)
    text = (CONFIG_DIR / f"{name}.yaml").read_text()
    split = f"rollout {r.num_actors} x 1 GPU"
    assert split in text and f"learner {lrn.num_learners} x 1 GPU" in text


def test_gpu_preset_eval_sets_load_in_the_training_format(preset_task):
    _, task = preset_task("qwen2.5-1.5b-math")
    math500, gsm8k = task.eval_set("math500"), task.eval_set("gsm8k")
    assert len(math500) == 500 and len(gsm8k) == 1319
    train = task.problems("train")[0].prompt
    head, tail = train[:train.index("user\n") + 5], train[train.index("\nPlease reason"):]
    for p in (math500[0].prompt, gsm8k[0].prompt):   # same system turn and instruction
        assert p.startswith(head) and p.endswith(tail)
    assert gsm8k[0].answer == "18"                    # "#### 18" extracted
    assert task.reward(f"\\boxed{{{math500[0].answer}}}", math500[0].answer) == 1.0
