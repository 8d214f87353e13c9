"""Preallocated, compressible KV cache for a batch of sequences.

Per layer: keys and values ``[B, Hkv, cap, D]`` (keys stored after RoPE), the absolute position of
every slot ``[B, Hkv, cap]`` (per KV head, because score-based policies keep different tokens in
different heads), plus what the policy needs: accumulated attention (H2O) and a ring of the last
``obs_window`` queries (SnapKV, R-KV). ``n[b]`` slots of row b are valid in every layer and head; slots
are kept in increasing position order. Capacity is ``budget + compress_every`` for compressing
policies, so no row ever stores more than that many tokens per layer (not a mask over a full cache).
"""
from __future__ import annotations

import torch


def _blocks(rows: torch.Tensor, heads: int, width: int) -> torch.Tensor:
    """[R, heads] offset of each (row, head) block of ``width`` cells in a layer tensor viewed flat
    as [B*heads*width] (rows index the batch)."""
    return (rows[:, None] * heads + torch.arange(heads, device=rows.device)[None]) * width


class KVStore:
    def __init__(self, n_layers: int, batch: int, n_kv: int, n_heads: int, head_dim: int, cap: int,
                 dtype: torch.dtype, need_acc: bool = False, obs_window: int = 0,
                 device: torch.device | str = "cpu"):
        shape = (batch, n_kv, cap, head_dim)
        self.cap, self.dtype, self.device = cap, dtype, torch.device(device)
        z = lambda *sh, dt=dtype: torch.zeros(sh, dtype=dt, device=device)  # noqa: E731
        self.k = [z(*shape) for _ in range(n_layers)]
        self.v = [z(*shape) for _ in range(n_layers)]
        self.pos = [z(batch, n_kv, cap, dt=torch.long) for _ in range(n_layers)]
        self.acc = ([z(batch, n_kv, cap, dt=torch.float32) for _ in range(n_layers)]
                    if need_acc else None)
        self.obs_window = obs_window
        self.qwin = ([z(batch, n_heads, obs_window, head_dim) for _ in range(n_layers)]
                     if obs_window else None)
        self.n = torch.zeros(batch, dtype=torch.long)       # valid slots per row, kept on the host
        self.bytes_per_token = 2 * n_layers * n_kv * head_dim * torch.finfo(dtype).bits // 8

    def allocated_bytes(self) -> int:
        """Bytes of the preallocated key and value tensors (all rows and layers)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished sequences: keep only the given batch rows (in that order)."""
        rows_d = rows.to(self.device)
        sel = lambda ts: None if ts is None else [t.index_select(0, rows_d) for t in ts]  # noqa
        self.k, self.v, self.pos = sel(self.k), sel(self.v), sel(self.pos)
        self.acc, self.qwin = sel(self.acc), sel(self.qwin)
        self.n = self.n.index_select(0, rows)

    def extend(self, other: "KVStore") -> None:
        """Append other's rows (same capacity and layout) after this store's rows."""
        cat = lambda a, b: None if a is None else [torch.cat([x, y]) for x, y in zip(a, b)]  # noqa
        self.k, self.v, self.pos = cat(self.k, other.k), cat(self.v, other.v), cat(self.pos, other.pos)
        self.acc, self.qwin = cat(self.acc, other.acc), cat(self.qwin, other.qwin)
        self.n = torch.cat([self.n, other.n])

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
              acc: torch.Tensor | None = None) -> None:
        """Write slots [0, S) of layer i for every row (prefill). k, v [B,Hkv,S,D]; pos [B,Hkv,S]."""
        s = k.shape[2]
        self.k[i][:, :, :s] = k
        self.v[i][:, :, :s] = v
        self.pos[i][:, :, :s] = pos
        if self.acc is not None and acc is not None:
            self.acc[i].zero_()
            self.acc[i][:, :, :s] = acc

    def step_index(self, slot: torch.Tensor, pos: torch.Tensor):
        """Flat indices of one decode step, shared by every layer: (row, KV head) -> the cell of
        slot[b] in a layer viewed as [B*Hkv*cap], the positions to write there, and (row, query
        head) -> the ring cell of position pos[b] (SnapKV / R-KV). One ``index_copy_`` per tensor
        and layer then replaces a broadcast advanced-index assignment."""
        b, hkv = slot.shape[0], self.k[0].shape[1]
        rows = torch.arange(b, device=self.device)
        cells = (_blocks(rows, hkv, self.cap) + slot[:, None]).view(-1)
        ring = None
        if self.qwin is not None:
            hq, w = self.qwin[0].shape[1], self.obs_window
            ring = (_blocks(rows, hq, w) + (pos % w)[:, None]).view(-1)
        return cells, pos.repeat_interleave(hkv), ring

    def append_step(self, i: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, index) -> None:
        """Decode step of layer i: k, v [B,Hkv,D] into their slots; q [B,Hq,D] into the ring."""
        cells, pos, ring = index
        d = k.shape[-1]
        self.k[i].view(-1, d).index_copy_(0, cells, k.reshape(-1, d))
        self.v[i].view(-1, d).index_copy_(0, cells, v.reshape(-1, d))
        self.pos[i].view(-1).index_copy_(0, cells, pos)
        if self.acc is not None:
            self.acc[i].view(-1).index_fill_(0, cells, 0.0)
        if ring is not None:
            self.qwin[i].view(-1, d).index_copy_(0, ring, q.reshape(-1, d))

    def fill_window(self, i: int, q: torch.Tensor, lens: torch.Tensor) -> None:
        """After prefill: ring slot p % w of row b holds the query of position p, for the last w
        positions p < lens[b] (q [B,Hq,T,D]; positions before 0 stay zero and are never used)."""
        if self.qwin is None:
            return
        w = self.obs_window
        p = lens.to(self.device)[:, None] - w + torch.arange(w, device=self.device)[None]  # [B,w]
        ok = p >= 0
        src = q.gather(2, p.clamp(min=0)[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
        src = src * ok[:, None, :, None]
        self.qwin[i].scatter_(2, (p % w)[:, None, :, None].expand_as(src), src)

    def gather_rows(self, i: int, rows: torch.Tensor, idx: torch.Tensor) -> None:
        """Compact layer i of the given rows to the slots idx [R,Hkv,K] (sorted); slots [0,K).

        Every tensor of the layer is viewed as one row per (sequence, KV head, slot), so a whole
        compaction is one ``index_select`` of the kept cells (memcpy of D values each) and one
        ``index_copy_`` back into slots [0, K): no copy of the rows' full cache first, and no
        element-wise ``gather`` over D (measured 4-5x slower at batch 64, 2k slots)."""
        _, hkv, kk = idx.shape
        base = _blocks(rows, hkv, self.cap)[..., None]                              # [R,Hkv,1]
        src = (base + idx).view(-1)
        dst = (base + torch.arange(kk, device=self.device)).view(-1)
        d = self.k[i].shape[-1]
        flat = [self.k[i].view(-1, d), self.v[i].view(-1, d), self.pos[i].view(-1)]
        if self.acc is not None:
            flat.append(self.acc[i].view(-1))
        for t in flat:
            t.index_copy_(0, dst, t.index_select(0, src))   # select first: src and dst overlap

    def copy_layer_from(self, i: int, other: "KVStore", j: int, s: int) -> None:
        """Copy slots [0, s) of other's layer j into layer i (after prefill compression)."""
        self.k[i][:, :, :s] = other.k[j][:, :, :s]
        self.v[i][:, :, :s] = other.v[j][:, :, :s]
        self.pos[i][:, :, :s] = other.pos[j][:, :, :s]
        if self.acc is not None:
            self.acc[i].zero_()
            self.acc[i][:, :, :s] = other.acc[j][:, :, :s]
        if self.qwin is not None:
            self.qwin[i].copy_(other.qwin[j])
