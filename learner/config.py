"""Config of the DeepSpeed learner (``learner`` section of TrainConfig).

An OmegaConf structured-config dataclass: choices are ``enum.Enum``s with string values, so YAML writes
``dtype: bfloat16`` (``common.dtypes``, the names every section uses) and an unknown value is rejected by OmegaConf before ``validate`` runs. The sampling
temperature is deliberately absent: log-probs must use the rollout's (``rollout.temperature``), so the
driver passes it to ``Learner.train_step``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from common.dtypes import Dtype
from common.errors import ConfigError
from common.validate import check_range, check_enum


class LRSchedule(str, enum.Enum):
    CONSTANT = "constant"   # linear warmup to lr, then constant
    COSINE = "cosine"       # linear warmup, then cosine from lr to lr * min_lr_ratio over decay_steps


_enum = check_enum  # shared: coerce a string to the Enum or name the key


@dataclass
class LearnerConfig:
    """DeepSpeed ZeRO learner: optimiser, schedule, batching and data parallelism.

    A train step takes every row the driver hands this learner (whole GRPO groups), cuts them into
    ``mini_batches`` mini-batches (one optimiser step each, PPO-style: from the second one on the
    policy has moved away from the scored old log-probs, so the clip can bind), passes over them
    ``epochs`` times, and splits each mini-batch into micro-batches of at most ``micro_batch_size``
    rows and ``max_tokens_per_micro_batch`` padded tokens, accumulating gradients over them; the
    number of accumulation steps is derived from the batch, not configured.
    """
    num_learners: int = 1            # data-parallel learner processes (DeepSpeed world size)
    zero_stage: int = 1              # ZeRO stage 0-3 (3 partitions parameters; weights are gathered)
    # bfloat16: the model is loaded and run in bf16, DeepSpeed keeps fp32 master weights in the
    # optimiser. Must equal scorer.dtype, or the PPO ratio starts away from 1.
    dtype: Dtype = Dtype.float32
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    lr_schedule: LRSchedule = LRSchedule.CONSTANT
    warmup_steps: int = 0            # optimiser steps (not rollout batches) of linear warmup from 0
    decay_steps: int = 1000          # cosine only: steps from the end of warmup to the floor
    min_lr_ratio: float = 0.1        # cosine only: floor as a fraction of lr
    mini_batches: int = 1            # optimiser steps per rollout batch (paper: 1024 rows / 256 = 4)
    epochs: int = 1                  # passes over the rollout batch's mini-batches
    micro_batch_size: int = 8        # most rows per forward/backward; gradients accumulate
    # most padded tokens (rows x longest row) per forward/backward; 0: rows alone decide. Bounds
    # activation memory for long responses whatever the row count.
    max_tokens_per_micro_batch: int = 16384
    # response tokens whose logits exist at once when log-probs are computed (forward and
    # backward): bounds the [tokens, vocab] fp32 logits, the dominant memory for 150k vocabularies
    logprob_chunk_tokens: int = 1024
    gradient_checkpointing: bool = False   # recompute each decoder layer in backward
    grad_clip: float = 1.0           # global grad-norm clip; 0 disables
    seed: int = 0
    num_threads: int = 1             # torch intra-op threads per learner process (2-core machines)
    # DeepSpeed's shared-memory all-reduce kernel for CPU is compiled on first use (~50 s, cached in
    # TORCH_EXTENSIONS_DIR). The plain gloo all-reduce is as fast for models of a few MB, so it is off.
    cpu_shm_comm: bool = False

    def validate(self, prefix: str = "learner") -> None:
        check_range(f"{prefix}.num_learners", self.num_learners, lo=1, hi=1024)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"{prefix}.zero_stage", self.zero_stage, "one of 0, 1, 2, 3")
        _enum(f"{prefix}.dtype", Dtype, self.dtype)
        _enum(f"{prefix}.lr_schedule", LRSchedule, self.lr_schedule)
        check_range(f"{prefix}.lr", self.lr, lo=0.0, hi=1.0, lo_open=True)
        if len(self.betas) != 2:
            raise ConfigError(f"{prefix}.betas", list(self.betas), "two numbers in [0, 1)")
        for i, b in enumerate(self.betas):
            check_range(f"{prefix}.betas.{i}", b, lo=0.0, hi=1.0, hi_open=True)
        check_range(f"{prefix}.eps", self.eps, lo=0.0, lo_open=True)
        check_range(f"{prefix}.weight_decay", self.weight_decay, lo=0.0)
        check_range(f"{prefix}.warmup_steps", self.warmup_steps, lo=0)
        check_range(f"{prefix}.decay_steps", self.decay_steps, lo=1)
        check_range(f"{prefix}.min_lr_ratio", self.min_lr_ratio, lo=0.0, hi=1.0)
        check_range(f"{prefix}.mini_batches", self.mini_batches, lo=1)
        check_range(f"{prefix}.epochs", self.epochs, lo=1)
        check_range(f"{prefix}.micro_batch_size", self.micro_batch_size, lo=1)
        check_range(f"{prefix}.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, lo=0)
        check_range(f"{prefix}.logprob_chunk_tokens", self.logprob_chunk_tokens, lo=1)
        check_range(f"{prefix}.grad_clip", self.grad_clip, lo=0.0)
        check_range(f"{prefix}.num_threads", self.num_threads, lo=1, hi=256)
