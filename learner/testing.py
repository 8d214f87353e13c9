"""Small fixtures for the learner, weight-sync and scorer tests: a tiny random Qwen2 and a batch.

Kept in the package (not in a conftest) so multi-process tests can import them in spawned children.
"""
from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_model(path: str | Path, seed: int = 0, vocab: int = 128, hidden: int = 64,
                    layers: int = 2) -> str:
    """Save a random-weight Qwen2 causal LM (~0.1M params) as an HF safetensors directory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(str(path))
    return str(path)


def make_batch(num_groups: int = 2, group_size: int = 4, vocab: int = 128, seed: int = 0,
               max_prompt: int = 6, max_response: int = 10, model=None,
               noise: float = 0.05) -> dict[str, torch.Tensor]:
    """A right-padded batch shaped like ``buffer.tensors.to_tensors`` output.

    Rewards vary within each group so GRPO advantages are non-zero. With ``model`` the old
    log-probs are that model's own (so PPO ratios start at 1) and sampler log-probs are a noisy copy
    (a small sparse/dense mismatch); without it both are random negatives.
    """
    g = torch.Generator().manual_seed(seed)
    b = num_groups * group_size
    p_len = torch.randint(2, max_prompt + 1, (b,), generator=g)
    r_len = torch.randint(1, max_response + 1, (b,), generator=g)
    t = int((p_len + r_len).max())
    ids = torch.zeros(b, t, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.long)
    resp = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        n = int(p_len[i] + r_len[i])
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=g)
        attn[i, :n] = 1
        resp[i, int(p_len[i]):n] = True
    if model is not None:
        from common.modeling import token_logprobs
        with torch.no_grad():
            old = token_logprobs(model, ids, attn, 1.0).float()
    else:
        old = -torch.rand(b, t, generator=g) * 3
    old = old * resp
    sampler = (old + noise * torch.randn(b, t, generator=g)) * resp
    return {"input_ids": ids, "attention_mask": attn, "response_mask": resp,
            "sampler_logprobs": sampler, "old_logprobs": old,
            "rewards": torch.randint(0, 2, (b,), generator=g).float(),
            "group_index": torch.arange(num_groups).repeat_interleave(group_size),
            "policy_version": torch.zeros(b, dtype=torch.long)}
