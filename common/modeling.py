"""Model helpers shared by the rollout, scorer and learner: loading, token log-probs, checksums.

All log-probs in the project are of ``log_softmax(logits / temperature)``: the scorer's dense
"old" log-probs, the learner's new log-probs and the rollout's sampler log-probs must describe the same
distribution, or the importance ratio rho_t = pi_old / pi_sampler is biased (Sparse-RL, Sec. 3).
"""
from __future__ import annotations

from pathlib import Path

import torch


def load_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """Load an HF causal LM from a local directory (nothing is ever fetched from a hub)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json (build it with "
                                f"`make model` or point rollout.model_path at an HF model directory)")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    model.eval()
    return model


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """Per-position log p(input_ids[:, t] | input_ids[:, :t]) under softmax(logits / temperature).

    Returns a [B, T] tensor aligned with ``input_ids``; position 0 (no context) is 0. Sequences are
    right-padded; padded positions hold garbage the caller masks out. Gradients flow when enabled.
    """
    # position_ids from the mask so left or right padding gives the same positions as generation.
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([picked.new_zeros(picked.shape[0], 1), picked], dim=1)


@torch.no_grad()
def checksum(named_tensors) -> float:
    """Order-independent-enough fingerprint of weights: sum over tensors of sum(|w| * (1 + i % 7)).

    Used by tests and logs to check that rollout/scorer weights equal the learner's after a broadcast.
    Names are sorted so the same weights always give the same number.
    """
    total = 0.0
    for i, (_, t) in enumerate(sorted(named_tensors, key=lambda kv: kv[0])):
        total += float(t.detach().float().abs().sum()) * (1 + i % 7)
    return total
