"""Preallocated slot pool of a generation: the KV cache of every row, allocated once per shape.

One tensor per kind for all layers: keys and values ``[L, R, Hkv, cap, D]`` (keys stored after
RoPE), the absolute position of every slot ``[L, R, Hkv, cap]`` (per KV head, because score-based
policies keep different tokens in different heads), plus what the policy needs: accumulated
attention ``[L, R, Hkv, cap]`` (H2O) and a ring of the last ``obs_window`` queries ``[L, R, Hq, w,
D]`` (SnapKV, R-KV). Row r holds ``n[r]`` valid slots in every layer and head, kept in increasing
position order; the engine keeps ``n`` on the device and mirrors it on the host by arithmetic.

The shapes never change while a generation runs, so a decode step has fixed shapes (CUDA graphs,
``torch.compile``) and no allocation: live rows are ``[0, live)``; a finished row is overwritten by
the last live row (``move_rows``: one ``index_copy_`` per tensor, not a whole-cache
``index_select``/``cat``), and admitted prompts are written into the free rows after them.
Capacity is ``budget + compress_every`` for compressing policies (no row ever stores more) and
``longest prompt + max_new_tokens`` for dense.
"""
from __future__ import annotations

import torch


def blocks(rows: torch.Tensor, heads: int, width: int) -> torch.Tensor:
    """[R, heads] offset of each (row, head) block of ``width`` cells in a [*, heads, width]
    tensor viewed flat (``rows`` index its leading axis)."""
    return (rows[:, None] * heads + torch.arange(heads, device=rows.device)[None]) * width


class KVPool:
    def __init__(self, n_layers: int, rows: int, n_kv: int, n_heads: int, head_dim: int, cap: int,
                 dtype: torch.dtype, need_acc: bool = False, obs_window: int = 0,
                 device: torch.device | str = "cpu"):
        self.layers, self.rows, self.cap, self.dtype = n_layers, rows, cap, dtype
        self.device, self.obs_window = torch.device(device), obs_window
        shape = (n_layers, rows, n_kv, cap)
        z = lambda *sh, dt=dtype: torch.zeros(sh, dtype=dt, device=device)  # noqa: E731
        self.k, self.v = z(*shape, head_dim), z(*shape, head_dim)
        self.pos = z(*shape, dt=torch.long)
        self.acc = z(*shape, dt=torch.float32) if need_acc else None
        self.qwin = z(n_layers, rows, n_heads, obs_window, head_dim) if obs_window else None
        # row state, read and advanced by the decode step on the device: valid slots, position
        # about to be written (tokens processed), input token; and where sampled tokens are
        # recorded (prompt index, response length so far)
        self.n, self.seen, self.tok, self.rowid, self.count = (z(rows, dt=torch.long)
                                                               for _ in range(5))

    def shape_key(self) -> tuple:
        """What a pool must match to be reused by another call (and its captured graphs)."""
        return (self.layers, self.rows, self.k.shape[2], self.qwin is not None and
                self.qwin.shape[2], self.cap, self.dtype, self.acc is not None, self.obs_window,
                self.device, self.k.shape[-1])

    def allocated_bytes(self, rows: int | None = None) -> int:
        """Bytes of the key and value tensors of ``rows`` rows (default: all, as allocated)."""
        per_row = 2 * self.k[0, 0].numel() * self.k.element_size() * self.layers
        return per_row * (self.rows if rows is None else rows)

    def tensors(self) -> list[torch.Tensor]:
        """Every per-row tensor, row axis 1."""
        return [t for t in (self.k, self.v, self.pos, self.acc, self.qwin) if t is not None]

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Row dst[j] <- row src[j] in every layer and the row state (device indices; disjoint
        sets)."""
        for t in self.tensors():
            t.index_copy_(1, dst, t.index_select(1, src))
        for t in (self.n, self.seen, self.tok, self.rowid, self.count):
            t.index_copy_(0, dst, t.index_select(0, src))

    # ---- prefill ---------------------------------------------------------------------------------
    def write(self, i: int, r0: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
              acc: torch.Tensor | None = None) -> None:
        """Slots [0, S) of layer i, rows [r0, r0 + B) (prefill). k, v [B,Hkv,S,D]; pos [B,Hkv,S];
        the rows' accumulated attention is reset (a freed row keeps its last occupant's)."""
        b, s = k.shape[0], k.shape[2]
        rows = slice(r0, r0 + b)
        self.k[i, rows, :, :s] = k
        self.v[i, rows, :, :s] = v
        self.pos[i, rows, :, :s] = pos
        if self.acc is not None:
            self.acc[i, rows].zero_()
            if acc is not None:
                self.acc[i, rows, :, :s] = acc

    def fill_window(self, i: int, r0: int, q: torch.Tensor, lens: torch.Tensor) -> None:
        """After prefill: ring slot p % w of row r0 + b holds the query of position p, for the last
        w positions p < lens[b] (q [B,Hq,T,D]; positions before 0 hold zeros, never used)."""
        if self.qwin is None:
            return
        w = self.obs_window
        p = lens[:, None] - w + torch.arange(w, device=self.device)[None]          # [B,w]
        src = q.gather(2, p.clamp(min=0)[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
        src = src * (p >= 0)[:, None, :, None]
        ring = self.qwin[i, r0:r0 + q.shape[0]]
        ring.scatter_(2, (p % w)[:, None, :, None].expand_as(src), src)

    def copy_rows_from(self, i: int, r0: int, other: "KVPool", s: int) -> None:
        """Rows [r0, r0 + B) of layer i <- slots [0, s) of other's layer 0 (a prefill scratch of
        B rows), window ring included."""
        b = other.rows
        rows = slice(r0, r0 + b)
        self.k[i, rows, :, :s] = other.k[0, :, :, :s]
        self.v[i, rows, :, :s] = other.v[0, :, :, :s]
        self.pos[i, rows, :, :s] = other.pos[0, :, :, :s]
        if self.acc is not None:
            self.acc[i, rows].zero_()
            self.acc[i, rows, :, :s] = other.acc[0, :, :, :s]
        if self.qwin is not None:
            self.qwin[i, rows] = other.qwin[0]

    # ---- decode ----------------------------------------------------------------------------------
    def step_index(self, rows: int, slot: torch.Tensor, pos: torch.Tensor):
        """Flat indices of one decode step over rows [0, rows), shared by every layer: (row, KV
        head) -> the cell of slot[r] in a layer's first ``rows`` rows viewed as [rows*Hkv*cap],
        the positions written there, and (row, query head) -> the ring cell of position pos[r].
        One ``index_copy_`` per tensor and layer then writes the step (no advanced indexing)."""
        hkv = self.k.shape[2]
        ar = torch.arange(rows, device=self.device)
        cells = (blocks(ar, hkv, self.cap) + slot[:, None]).view(-1)
        ring = None
        if self.qwin is not None:
            hq, w = self.qwin.shape[2], self.obs_window
            ring = (blocks(ar, hq, w) + (pos % w)[:, None]).view(-1)
        return cells, pos.repeat_interleave(hkv, output_size=rows * hkv), ring

    def append_step(self, i: int, rows: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                    index) -> None:
        """Decode step of layer i, rows [0, rows): k, v [rows,Hkv,D] into their slots; q
        [rows,Hq,D] into the ring; the slot's accumulated attention starts at 0. A chunk of T
        steps (``chunk_index``): k, v [rows,Hkv,T,D], q its last min(T, w) queries."""
        cells, pos, ring = index
        d = k.shape[-1]
        self.k[i, :rows].view(-1, d).index_copy_(0, cells, k.reshape(-1, d))
        self.v[i, :rows].view(-1, d).index_copy_(0, cells, v.reshape(-1, d))
        self.pos[i, :rows].view(-1).index_copy_(0, cells, pos)
        if self.acc is not None:
            self.acc[i, :rows].view(-1).index_fill_(0, cells, 0.0)
        if ring is not None:
            self.qwin[i, :rows].view(-1, d).index_copy_(0, ring, q.reshape(-1, d))

    def chunk_index(self, rows: int, n: torch.Tensor, seen: torch.Tensor, k: int):
        """``step_index`` of k steps at once (``forced.chunk_step``): the cells of slots
        n..n+k-1 of rows [0, rows) [rows*Hkv*k], their positions seen..seen+k-1, and the ring
        cells of the chunk's last min(k, w) queries (earlier ones would be overwritten)."""
        hkv = self.k.shape[2]
        ar, t = torch.arange(rows, device=self.device), torch.arange(k, device=self.device)
        cells = (blocks(ar, hkv, self.cap)[..., None] + (n[:, None] + t)[:, None]).view(-1)
        pos = (seen[:, None] + t)[:, None].expand(-1, hkv, -1).reshape(-1)
        ring = None
        if self.qwin is not None:
            hq, w = self.qwin.shape[2], self.obs_window
            last = seen[:, None] + t[k - min(k, w):]                                  # [R,m]
            ring = (blocks(ar, hq, w)[..., None] + (last % w)[:, None]).view(-1)
        return cells, pos, ring

    # ---- compression -----------------------------------------------------------------------------
    def gather_rows(self, i: int, rows: torch.Tensor, idx: torch.Tensor) -> None:
        """Compact layer i of the given rows (device indices) to the slots idx [R,Hkv,K] (sorted):
        slots [0, K) afterwards.

        Every tensor of the layer is viewed as one row per (sequence, KV head, slot), so a whole
        compaction is one ``index_select`` of the kept cells (memcpy of D values each) and one
        ``index_copy_`` back into slots [0, K): no copy of the rows' full cache first, and no
        element-wise ``gather`` over D, and the op count does not depend on how many rows."""
        _, hkv, kk = idx.shape
        base = blocks(rows, hkv, self.cap)[..., None]                               # [R,Hkv,1]
        src = (base + idx).view(-1)
        dst = (base + torch.arange(kk, device=self.device)).view(-1)
        d = self.k.shape[-1]
        flat = [self.k[i].view(-1, d), self.v[i].view(-1, d), self.pos[i].view(-1)]
        if self.acc is not None:
            flat.append(self.acc[i].view(-1))
        for t in flat:
            t.index_copy_(0, dst, t.index_select(0, src))   # select first: src and dst overlap
