"""Where a token's key and value live inside one layer's paged KV cache, whatever the backend.

vLLM's attention backends each pack a block their own way: CPU_ATTN's ``vec`` kernels store a
block's keys transposed (``[D, block]`` per head) and its values token-major, its AMX kernels
interleave bf16 pairs, FlashAttention uses ``[2, blocks, block, heads, D]``. Rather than hard-code
each, ``CellMap.probe`` writes marker values through the backend's own cache-update op
(``impl.do_kv_cache_update``, the op the model uses) into a scratch cache of two blocks, and
reads back where every (slot in block, KV head, channel) landed, for keys and for values. The
map is then applied to the real cache with its own strides: the offset of slot s of a request is
``block_ids[s // B] * stride(block dim) + base[h, s % B, d]``.

Markers are small integers (coordinate + 1, keys positive, values negative), exact in bf16 and
fp16 up to 256: head sizes above 255 and quantised (fp8) caches are refused.
"""
from __future__ import annotations

import torch

MAX_MARK = 255


class CellMap:
    def __init__(self, block_dim: int, block_stride: int, kbase: torch.Tensor,
                 vbase: torch.Tensor):
        self.block_dim, self.block_stride = block_dim, block_stride
        self.kbase, self.vbase = kbase, vbase          # int64 [Hkv, B, D]: offsets in block 0
        self.block_size = kbase.shape[1]
        # Every layout seen so far is affine once the slot and channel axes are split in two
        # (fp32 keys: [D, B] per block; bf16 AMX: channel pairs): then tokens move through a
        # strided view, without an int64 offset per channel
        self.strides = {"k": _fit_strides(kbase), "v": _fit_strides(vbase)}

    @classmethod
    def probe(cls, write, kv: torch.Tensor, num_blocks: int, block_size: int, num_kv_heads: int,
              head_size: int) -> "CellMap":
        """``write(key, value, cache, slot_mapping)`` stores key/value [T, Hkv, D] at the slots
        like the backend does; ``kv`` is one layer's real cache (``num_blocks`` blocks)."""
        if head_size > MAX_MARK or num_kv_heads > MAX_MARK or block_size > MAX_MARK:
            raise ValueError(f"KV layout probe: head size {head_size}, {num_kv_heads} KV heads "
                             f"and block size {block_size} must each be <= {MAX_MARK}")
        dims = [d for d, s in enumerate(kv.shape) if s == num_blocks]
        if not dims:
            raise ValueError(f"KV layout probe: no dimension of the cache {tuple(kv.shape)} has "
                             f"the pool's {num_blocks} blocks")
        block_dim = dims[0]
        shape = list(kv.shape)
        shape[block_dim] = 2
        slots = torch.arange(2 * block_size, device=kv.device)
        coord = {"slot": torch.arange(2 * block_size) % block_size,
                 "block": torch.arange(2 * block_size) // block_size}
        grids = {
            "slot": coord["slot"][:, None, None].expand(-1, num_kv_heads, head_size),
            "head": torch.arange(num_kv_heads)[None, :, None].expand(2 * block_size, -1, head_size),
            "chan": torch.arange(head_size)[None, None, :].expand(2 * block_size, num_kv_heads, -1),
            "block": coord["block"][:, None, None].expand(-1, num_kv_heads, head_size)}
        seen = {}
        for name, grid in grids.items():
            scratch = torch.zeros(shape, dtype=kv.dtype, device=kv.device)
            mark = (grid + 1).to(kv.dtype).to(kv.device)
            write(mark.contiguous(), (-mark).contiguous(), scratch, slots)
            seen[name] = scratch.reshape(-1).float().cpu()
        written = seen["slot"] != 0
        if int(written.sum()) != 2 * (2 * block_size) * num_kv_heads * head_size:   # K and V
            raise ValueError("KV layout probe: the backend's cache update did not write every "
                             "key and value channel exactly once")
        idx = written.nonzero().squeeze(-1)
        is_key = seen["slot"][idx] > 0
        coords = {k: v[idx].abs().long() - 1 for k, v in seen.items()}
        # scratch offsets -> multi-indices -> offsets in the real cache (its own strides)
        multi = torch.stack(torch.unravel_index(idx, tuple(shape)), dim=-1)      # [M, ndim]
        if not torch.equal(multi[:, block_dim], coords["block"]):
            raise ValueError(f"KV layout probe: blocks are not laid out along dimension "
                             f"{block_dim} of the cache {tuple(kv.shape)}")
        strides = torch.tensor(kv.stride())
        strides[block_dim] = 0
        real = (multi * strides).sum(dim=-1)
        bases = []
        for want in (True, False):
            sel = (is_key == want) & (coords["block"] == 0)
            base = torch.full((num_kv_heads, block_size, head_size), -1, dtype=torch.long)
            base[coords["head"][sel], coords["slot"][sel], coords["chan"][sel]] = real[sel]
            if bool((base < 0).any()):
                raise ValueError("KV layout probe: some cells of block 0 were never written")
            bases.append(base.to(kv.device))
        return cls(block_dim, int(kv.stride(block_dim)), bases[0], bases[1])

    @staticmethod
    def flat(kv: torch.Tensor) -> torch.Tensor:
        """A 1-D view of the storage under ``kv`` starting at its first element (writes go
        through to the cache)."""
        span = 1 + sum((s - 1) * st for s, st in zip(kv.shape, kv.stride()))
        return kv.as_strided((span,), (1,), kv.storage_offset())

    def _view(self, kv: torch.Tensor, which: str) -> torch.Tensor | None:
        """[blocks, Hkv, B/j, j, D/k, k] strided view of the keys or values, or None."""
        fit = self.strides[which]
        if fit is None:
            return None
        (j, k), (b0, sh, so_hi, so_lo, sd_hi, sd_lo) = fit
        h, b, d = self.kbase.shape
        nb = kv.shape[self.block_dim]
        return kv.as_strided((nb, h, b // j, j, d // k, k),
                             (self.block_stride, sh, so_hi, so_lo, sd_hi, sd_lo),
                             kv.storage_offset() + b0)

    def _index(self, blocks: torch.Tensor, slots: torch.Tensor, which: str):
        (j, _), _ = self.strides[which]
        heads = torch.arange(slots.shape[0], device=slots.device)[:, None].expand_as(slots)
        blk = blocks.to(slots.device).long()[slots // self.block_size]
        o = slots % self.block_size
        return blk, heads, o // j, o % j

    def take(self, kv: torch.Tensor, which: str, blocks: torch.Tensor,
             slots: torch.Tensor) -> torch.Tensor:
        """Keys (``which="k"``) or values of ``slots`` [Hkv, S] (per head) of a request whose
        block table is ``blocks``: [Hkv, S, D] (a copy)."""
        view = self._view(kv, which)
        if view is None:
            k_off, v_off = self.cells(blocks, slots)
            return CellMap.flat(kv)[k_off if which == "k" else v_off]
        h, s = slots.shape
        return view[self._index(blocks, slots, which)].reshape(h, s, -1)

    def put(self, kv: torch.Tensor, which: str, blocks: torch.Tensor, slots: torch.Tensor,
            values: torch.Tensor) -> None:
        """Write ``values`` [Hkv, S, D] into ``slots`` [Hkv, S] (per head)."""
        view = self._view(kv, which)
        if view is None:
            k_off, v_off = self.cells(blocks, slots)
            CellMap.flat(kv)[k_off if which == "k" else v_off] = values
            return
        h, s = slots.shape
        view[self._index(blocks, slots, which)] = values.reshape(h, s, view.shape[-2],
                                                                 view.shape[-1])

    def cells(self, blocks: torch.Tensor, slots: torch.Tensor):
        """Offsets (in ``flat(kv)``) of the keys and of the values of ``slots`` [Hkv, S] (each
        head its own slots) of a request whose block table is ``blocks``: [Hkv, S, D] each."""
        slots = slots.to(self.kbase.device)
        b = blocks.to(self.kbase.device).long()[slots // self.block_size] * self.block_stride
        o = slots % self.block_size
        heads = torch.arange(slots.shape[0], device=slots.device)[:, None]
        return (b[..., None] + self.kbase[heads, o, :], b[..., None] + self.vbase[heads, o, :])


def _fit_strides(base: torch.Tensor):
    """((j, k), (offset, stride_head, stride_slot_hi, stride_slot_lo, stride_chan_hi,
    stride_chan_lo)) such that base[h, o, d] = offset + h*sh + (o//j)*so_hi + (o%j)*so_lo
    + (d//k)*sd_hi + (d%k)*sd_lo for every cell, trying the smallest splits first; None if no
    split makes the layout affine."""
    h, b, d = base.shape
    hh = torch.arange(h)[:, None, None]
    oo = torch.arange(b)[None, :, None]
    dd = torch.arange(d)[None, None, :]
    b0 = int(base[0, 0, 0])
    at = lambda i, o, c: int(base[i, o, c]) - b0  # noqa: E731
    for j in [x for x in (1, 2, 4, 8, 16, 32, 64, 128) if b % x == 0]:
        for k in [x for x in (1, 2, 4, 8, 16, 32) if d % x == 0]:
            st = (at(1, 0, 0) if h > 1 else 0, at(0, j, 0) if b > j else 0,
                  at(0, 1, 0) if j > 1 else 0, at(0, 0, k) if d > k else 0,
                  at(0, 0, 1) if k > 1 else 0)
            pred = (b0 + hh * st[0] + (oo // j) * st[1] + (oo % j) * st[2] + (dd // k) * st[3]
                    + (dd % k) * st[4])
            if torch.equal(pred, base.cpu()):
                return (j, k), (b0, *st)
    return None
