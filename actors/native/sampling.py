"""Token sampling with the log-prob of the distribution actually sampled from.

``processed`` log-probs are of ``log_softmax(filter(logits / T))`` where filter applies top-k and then
top-p (nucleus) truncation, i.e. exactly the distribution the token is drawn from; ``raw``
log-probs are of ``log_softmax(logits / T)`` (docs/INTERFACES.md, "Log-probs"). Greedy decoding
(temperature 0) records ``log_softmax(logits)``.
"""
from __future__ import annotations

import torch


def truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside the top-k, then outside the smallest nucleus with mass >= top_p."""
    if top_k and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p        # the first token always stays (mass_before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int,
                       top_p: float) -> torch.Tensor:
    """log_softmax over the last axis of the distribution sampling draws from (``processed``):
    logits / T, top-k then top-p truncated; greedy (T = 0) ``log_softmax(logits)``. ``sample``,
    teacher-forced replays, their reference and the probes' dense reference read it."""
    if temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    return torch.log_softmax(truncate(logits / temperature, top_k, top_p), dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [B,V] by inverting the CDF: the first index whose cumulative mass
    exceeds u * total, u ~ U[0,1). A zero-probability token is never drawn (its cumulative mass
    equals its predecessor's, which already exceeds the threshold), including at u = 0 and when the
    float sum falls short of 1. Same distribution as ``torch.multinomial(probs, 1)``, but one uniform
    per row instead of one exponential per vocabulary entry: at vocab 260 and batch 64 that was 8%
    of a CPU decode step."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    # u * total can round up to total; stay strictly below it so some entry exceeds u
    u = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))
    return (cdf <= u).sum(dim=-1)


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, mode: str,
           generator: torch.Generator | None):
    """logits [B,V] float32 -> (tokens [B] long, logprobs [B] float32)."""
    processed = processed_logprobs(logits, temperature, top_k, top_p)
    if temperature == 0:
        tok = processed.argmax(dim=-1)
        return tok, processed.gather(-1, tok[:, None]).squeeze(-1)
    tok = draw(processed.exp(), generator)
    # top_k = 0 and top_p = 1 (the RL default): truncate is a no-op, and the raw and processed
    # distributions are the same one, so one log-softmax serves both
    plain = not (top_k and top_k < logits.shape[-1]) and top_p >= 1.0
    logp = processed if mode == "processed" or plain else torch.log_softmax(logits / temperature,
                                                                            dim=-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
