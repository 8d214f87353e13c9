"""Where a token's key and value live inside one layer's paged KV cache, whatever the backend.

vLLM's attention backends each pack a block their own way: CPU_ATTN's ``vec`` kernels store a
block's keys transposed (``[D, block]`` per head) and its values token-major, its AMX kernels
interleave bf16 pairs, FlashAttention uses ``[2, blocks, block, heads, D]``. Rather than hard-code
each, ``CellMap.probe`` writes marker values through the backend's own cache-update op
(``impl.do_kv_cache_update``, the op the model uses) into a scratch cache of two blocks, and
reads back where every (slot in block, KV head, channel) landed, for keys and for values: the
offset of slot s of a request is ``block_ids[s // B] * stride(block dim) + base[h, s % B, d]``.

Tokens then move a block at a time: every block's keys (and values) occupy one span of the
cache's storage, the same span in every block, so a request's blocks are copied out with one
``index_select`` of whole spans (``read``), rearranged to and from ``[Hkv, slots, D]``
(``unpack``/``pack``) through a strided view fitted to the probed offsets (an index per cell
where no affine fit exists), and written back whole (``write``). A span holding both keys and
values is read and written once; separate spans are checked to hold none of the other's cells,
since writing a span back rewrites every element in it.

Markers are small integers (coordinate + 1, keys positive, values negative), exact in bf16 and
fp16 up to 256: head sizes above 255 and quantised (fp8) caches are refused.
"""
from __future__ import annotations

import torch

MAX_MARK = 255


class CellMap:
    def __init__(self, block_dim: int, block_stride: int, num_blocks: int, kbase: torch.Tensor,
                 vbase: torch.Tensor):
        self.block_dim, self.block_stride, self.num_blocks = block_dim, block_stride, num_blocks
        self.kbase, self.vbase = kbase, vbase          # int64 [Hkv, B, D]: offsets in block 0
        self.heads, self.block_size, self.head_dim = kbase.shape
        self.spans, which = _spans(kbase, vbase, block_stride, num_blocks)
        # per tensor: (span index, cell offsets within that span in (head, slot, channel) order)
        self.index = {name: (s, (base - self.spans[s][0]).reshape(-1))
                      for name, base, s in (("k", kbase, which[0]), ("v", vbase, which[1]))}
        # Every layout seen so far is affine once the slot and channel axes are split in two
        # (fp32 keys: [D, B] per block; bf16 AMX: channel pairs): a strided view of the read
        # blocks then rearranges them with one copy, several times faster than an index per
        # cell (kept as the fallback)
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
        return cls(block_dim, int(kv.stride(block_dim)), num_blocks, bases[0], bases[1])

    @staticmethod
    def flat(kv: torch.Tensor) -> torch.Tensor:
        """A 1-D view of the storage under ``kv`` starting at its first element (writes go
        through to the cache)."""
        span = 1 + sum((s - 1) * st for s, st in zip(kv.shape, kv.stride()))
        return kv.as_strided((span,), (1,), kv.storage_offset())

    def _rows(self, kv: torch.Tensor, span: int) -> torch.Tensor:
        """[num_blocks, size] view of span ``span`` of every block."""
        lo, size = self.spans[span]
        flat = CellMap.flat(kv)
        return flat.as_strided((self.num_blocks, size), (self.block_stride, 1),
                               flat.storage_offset() + lo)

    def read(self, kv: torch.Tensor, blocks: torch.Tensor) -> list[torch.Tensor]:
        """Copies of the spans of ``blocks`` [R, NB] (each row a request's blocks, in order):
        one [R, NB, size] tensor per span."""
        flat = blocks.reshape(-1).to(kv.device)
        return [self._rows(kv, s).index_select(0, flat).view(*blocks.shape, -1)
                for s in range(len(self.spans))]

    def _cells(self, chunks: list[torch.Tensor], which: str) -> torch.Tensor | None:
        """[R, NB, Hkv, B/j, j, D/k, k] strided view of the keys or values in read ``chunks``
        (writes go through), or None where the layout has no affine fit."""
        s, _ = self.index[which]
        fit, c = self.strides[which], chunks[s]
        if fit is None:
            return None
        (j, k), (b0, sh, so_hi, so_lo, sd_hi, sd_lo) = fit
        r, nb, size = c.shape
        h, b, d = self.heads, self.block_size, self.head_dim
        return c.as_strided((r, nb, h, b // j, j, d // k, k),
                            (nb * size, size, sh, so_hi, so_lo, sd_hi, sd_lo),
                            c.storage_offset() + b0 - self.spans[s][0])

    def unpack(self, chunks: list[torch.Tensor], which: str) -> torch.Tensor:
        """Keys (``which="k"``) or values of every slot of read blocks: [R, Hkv, NB * B, D]."""
        s, idx = self.index[which]
        r, nb = chunks[s].shape[:2]
        h, b, d = self.heads, self.block_size, self.head_dim
        view = self._cells(chunks, which)
        if view is None:
            view = chunks[s].index_select(2, idx.to(chunks[s].device)).view(r, nb, h, b, d)
        dims = (0, 2, 1) + tuple(range(3, view.dim()))
        # always a copy (a reshape may return a view of the chunk, which ``pack`` writes)
        return view.permute(*dims).clone(memory_format=torch.contiguous_format).view(
            r, h, nb * b, d)

    def pack(self, chunks: list[torch.Tensor], which: str, values: torch.Tensor) -> None:
        """Put ``values`` [R, Hkv, nb * B, D] into the first nb blocks of read ``chunks``."""
        s, idx = self.index[which]
        r, h, slots, d = values.shape
        nb = slots // self.block_size
        cells = values.view(r, h, nb, self.block_size, d).permute(0, 2, 1, 3, 4)
        view = self._cells(chunks, which)
        if view is None:
            chunks[s][:, :nb].index_copy_(2, idx.to(values.device),
                                          cells.reshape(r, nb, -1).to(chunks[s].dtype))
            return
        view[:, :nb] = cells.reshape(view[:, :nb].shape)

    def write(self, kv: torch.Tensor, blocks: torch.Tensor, chunks: list[torch.Tensor]) -> None:
        """Write the first ``blocks.shape[1]`` blocks of ``chunks`` back to ``blocks`` [R, nb]."""
        flat, nb = blocks.reshape(-1).to(kv.device), blocks.shape[1]
        for s, c in enumerate(chunks):
            self._rows(kv, s).index_copy_(0, flat, c[:, :nb].reshape(flat.numel(), -1))


def _spans(kbase: torch.Tensor, vbase: torch.Tensor, stride: int, num_blocks: int):
    """The storage spans a block's keys and values occupy: ``([(lo, size), ...], (span of the
    keys, span of the values))``. One span when both fit within a block's stride, else one each,
    provided neither span of any block holds a cell of the other tensor in any block (writing a
    span back rewrites all of it)."""
    lo = int(min(kbase.min(), vbase.min()))
    hi = int(max(kbase.max(), vbase.max()))
    if hi - lo < stride:
        return [(lo, hi - lo + 1)], (0, 0)
    spans = []
    for base, other in ((kbase, vbase), (vbase, kbase)):
        a, b = int(base.min()), int(base.max())
        if b - a >= stride:
            raise ValueError(f"KV layout: a block's cells span {b - a + 1} elements, more than "
                             f"the block stride {stride}")
        # block shift m that would bring another block's cell x into [a, b]: x + m * stride
        x = other.reshape(-1).cpu()
        m = torch.div(a - x + stride - 1, stride, rounding_mode="floor")
        inside = (x + m * stride <= b) & (m.abs() < num_blocks)
        if bool(inside.any()):
            raise ValueError("KV layout: keys and values of different blocks interleave in "
                             "storage; block-wise moves are not supported for this backend")
        spans.append((a, b - a + 1))
    return spans, (0, 1)


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
