"""Tiny random-weight models that vLLM's CPU kernels accept, for tests and the benchmark."""
from __future__ import annotations

from pathlib import Path

import torch


def build_model(out: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 2,
                kv_heads: int = 1, vocab: int = 128, init_std: float = 0.2,
                max_pos: int = 2048) -> Path:
    """Random Qwen2 + char tokenizer saved to ``out`` (default: hidden 64, 2 layers, 2 heads of 32,
    1 KV head, vocab 128). vLLM's CPU attention needs ``head_dim = hidden / heads >= 32``. The init
    std is larger than HF's default so greedy continuations vary instead of repeating one token."""
    from transformers import AutoModelForCausalLM

    from actors.native.tiny import char_tokenizer, tiny_config

    if hidden // heads < 32:
        raise ValueError(f"vLLM CPU attention needs head_dim >= 32, got {hidden // heads}")
    cfg = tiny_config("qwen2", hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                      vocab=vocab, max_pos=max_pos)
    cfg.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    out = Path(out)
    model.save_pretrained(str(out))
    char_tokenizer().save_pretrained(str(out))
    return out
