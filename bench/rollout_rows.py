"""What the CPU and GPU rollout benches share (``bench/rollout.py``, ``bench/rollout_gpu.py``): the
policies a row runs, its random prompts, and the KV bytes a model holds per token."""
from __future__ import annotations

import torch

POLICIES = ("streaming", "h2o", "snapkv", "rkv")


def prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``batch`` random prompts of ``prompt_len`` token ids in [3, vocab) (ids 0-2: specials)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, prompt_len), generator=g).tolist()


def kv_bytes_per_token(model) -> int:
    """K and V bytes of one token in every layer of an HF model, in its parameters' dtype."""
    from common.modeling import hf_kv_bytes_per_token

    return hf_kv_bytes_per_token(model.config, next(model.parameters()).dtype)
