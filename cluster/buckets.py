"""Bucket plan of the weight broadcast (``cluster.weight_sync``): which tensors travel packed
together and which alone, derived identically by the sender and every receiver from the spec."""
from __future__ import annotations

from dataclasses import dataclass

import torch

SpecEntry = tuple[str, tuple[int, ...], torch.dtype]


def numel_of(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    numel: int
    entries: tuple[tuple[int, int, int], ...]  # (spec index, offset, numel)


# A tensor this large (or larger than a bucket) travels alone: the sender broadcasts it in place and
# the receiver can land it straight in its parameter, so neither side copies it. Below this, packing
# is cheaper than one more message (a gloo message costs tens of microseconds, a 1 MiB copy ~0.2 ms).
DIRECT_BYTES = 1 << 20


def plan_buckets(spec: list[SpecEntry], bucket_bytes: int) -> list[Bucket]:
    """Group consecutive same-dtype tensors into flat buckets of at most ``bucket_bytes``; a tensor
    of at least ``min(DIRECT_BYTES, bucket_bytes)`` gets a bucket of its own."""
    buckets: list[Bucket] = []
    cur: list[tuple[int, int, int]] = []
    cur_dtype, cur_numel = None, 0
    alone_bytes = min(DIRECT_BYTES, bucket_bytes)

    def close():
        if cur:
            buckets.append(Bucket(cur_dtype, cur_numel, tuple(cur)))

    for i, (_, shape, dtype) in enumerate(spec):
        numel = numel_of(shape)
        size = itemsize(dtype)
        alone = numel * size >= alone_bytes
        if cur and (alone or dtype != cur_dtype or (cur_numel + numel) * size > bucket_bytes):
            close()
            cur, cur_numel = [], 0
        cur_dtype = dtype
        cur.append((i, cur_numel, numel))
        cur_numel += numel
        if alone:
            close()
            cur, cur_numel = [], 0
    close()
    return buckets


def direct_view(t: torch.Tensor | None, dtype: torch.dtype, device: torch.device, numel: int):
    """``t`` as a flat view the wire can use as is (same dtype, device, size; contiguous), or None."""
    if t is None or t.dtype != dtype or t.device != device or t.numel() != numel \
            or not t.is_contiguous():
        return None
    return t.detach().view(-1)
