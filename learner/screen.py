"""Screening a training batch for non-finite numbers before the learner sees it.

A NaN or inf in any per-token or per-row input of the update (the sampler's, the scorer's, the
reference's log-probs, the rewards) or in what the driver derives from them (advantages, IS
weights) would reach the weights through the loss. ``find_poison`` names the first such input and
the samples that carry it; the driver then skips the whole batch (``launch/faults.py``). Only
positions that enter the update are looked at: response tokens for [B, T] tensors, every row for
[B] ones (padding is 0 by construction, and a NaN there would be harmless anyway).

Pure torch: no Ray, no DeepSpeed (tested on its own).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Screened before ``prepare_batch`` (the correction refuses non-finite inputs with a ValueError;
# here they become a counted skip instead), in this order: the first poisoned one is the cause.
INPUTS = ("sampler_logprobs", "old_logprobs", "ref_logprobs", "dense_sampler_logprobs", "rewards")
# Screened after ``prepare_batch``: what it derives (GRPO advantages, the correction's IS weights).
DERIVED = ("advantages", "is_weights")


@dataclass(frozen=True)
class Poison:
    """The first non-finite input of a batch: its tensor's name and the samples holding it."""
    cause: str
    sample_ids: tuple[str, ...]
    values: int          # how many non-finite numbers that tensor holds at screened positions

    def __str__(self) -> str:
        ids = ", ".join(self.sample_ids[:8]) + (" ..." if len(self.sample_ids) > 8 else "")
        return (f"non-finite {self.cause} ({self.values} values) in {len(self.sample_ids)} "
                f"samples: {ids}")


def bad_rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[B, N] bool: where ``x`` ([B] or [B, T]) holds a NaN or inf (for [B, T] only where
    ``mask`` is set)."""
    bad = ~torch.isfinite(x)
    if x.dim() == 2 and mask is not None:
        bad = bad & mask.bool()
    return bad.reshape(bad.shape[0], -1)


def find_poison(tensors: dict, sample_ids: list[str],
                keys: tuple[str, ...] = INPUTS + DERIVED) -> Poison | None:
    """The first of ``keys`` present in ``tensors`` with a non-finite value at a screened
    position (``response_mask`` for [B, T] tensors), or None when the batch is clean."""
    if len(sample_ids) != tensors["response_mask"].shape[0]:
        raise ValueError(f"find_poison: {len(sample_ids)} sample ids for "
                         f"{tensors['response_mask'].shape[0]} rows")
    mask = tensors["response_mask"]
    for key in keys:
        x = tensors.get(key)
        if x is None or not torch.is_tensor(x) or not x.is_floating_point():
            continue
        bad = bad_rows(x, mask)
        if bool(bad.any()):
            rows = bad.any(1).nonzero().squeeze(1).tolist()
            return Poison(key, tuple(sample_ids[i] for i in rows), int(bad.sum()))
    return None
