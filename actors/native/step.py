"""The native engine's decode step: fixed shapes, no host synchronisation, eager or captured.

``decode_step`` advances rows [0, rows) of a ``KVPool`` by one token: it reads each row's input
token, position and slot count from the pool's row state (device tensors), writes the new keys
and values at slot ``n`` (clamped to the pool: rows past the live ones are inert padding), attends
over the first ``s`` slots under a mask built on the device from ``n``, and advances ``n`` and the
position in place. Nothing in it reads a value back to the host, so the host only mirrors the
counts by arithmetic, and with ``s`` fixed (the pool's capacity) every call has the same shapes.

``StepRunner`` runs it three ways (``mode``):
- ``eager``: ``rows`` = the live rows and ``s`` = the host mirror's longest row + 1, so a CPU step
  reads only the slots some row holds (the CPU path, and the fallback).
- ``compile``: ``torch.compile(fullgraph=True, dynamic=False)`` of the same function at ``s`` =
  capacity and a bucketed row count: one graph per bucket, none re-traced between compressions
  (``tests/test_decode_step.py``).
- ``graphs`` (CUDA): one CUDA graph per row bucket (``BUCKETS``, capped at the pool's rows; the
  live rows padded with inert ones: rows of the pool that are free) and span (``s`` rounded up to ``SPAN`` slots, so a dense cache does not read its whole
  capacity from the first step), captured in one shared memory pool and replayed between
  compressions, so a step costs one launch instead of ~30 kernels per layer.
"""
from __future__ import annotations

import weakref

import torch

from actors.native.model import decode_attend

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MODES = ("auto", "eager", "compile", "graphs")
SPAN = 512


def bucket(rows: int) -> int:
    """Smallest row bucket holding ``rows`` (beyond the table: multiples of 128)."""
    for b in BUCKETS:
        if rows <= b:
            return b
    return -(-rows // 128) * 128


def decode_step(dec, pool, rope, rows: int, s: int, h2o: bool) -> torch.Tensor:
    """One token for rows [0, rows) of ``pool`` through every layer; logits [rows, V] float32.
    Everything the layers share (RoPE rows, the additive mask, the cells to write) is built once;
    each layer then runs a few fused kernels (``Decoder.step_qkv``, ``decode_attend``,
    ``Decoder.step_finish``). ``h2o``: add each step's attention to the slots' totals."""
    n, seen = pool.n[:rows], pool.seen[:rows]
    slot = n.clamp(max=pool.cap - 1)                  # inert padding rows never overflow
    pos = seen.clamp(max=rope.n - 1)
    x = dec.embed(pool.tok[:rows])
    cos, sin = rope.at(pos)
    dev = x.device
    bias = torch.zeros(rows, s, dtype=dec.dtype, device=dev).masked_fill_(
        torch.arange(s, device=dev)[None] > slot[:, None], float("-inf"))
    bias = bias.repeat_interleave(dec.n_kv, dim=0)[:, None]                   # [R*Hkv,1,s]
    index = pool.step_index(rows, slot, pos)
    for i in range(dec.n_layers):
        q, k, v = dec.step_qkv(i, x, cos, sin)
        pool.append_step(i, rows, k, v, q, index)
        out, probs = decode_attend(q, pool.k[i, :rows], pool.v[i, :rows], s, bias, dec.scaling,
                                   h2o)
        if h2o:
            pool.acc[i, :rows, :, :s] += probs.sum(dim=2)
        x = dec.step_finish(i, x, out)
    n.add_(1)
    seen.add_(1)
    return dec.step_logits(x)


class StepRunner:
    """Runs ``decode_step`` eagerly, compiled, or as replayed CUDA graphs (module docstring)."""

    def __init__(self, mode: str = "auto", backend: str = "inductor"):
        if mode not in MODES:
            raise ValueError(f"native engine: step mode must be one of {MODES}, got {mode!r}")
        self.mode, self.backend = mode, backend
        self.compiled = None
        self.graphs: dict = {}
        self.mempool = None
        self.owner = None            # (pool, rope table) weak refs, weight pointers

    def resolve(self, device: torch.device) -> str:
        """The mode used on ``device``: ``auto`` is CUDA graphs on CUDA, eager elsewhere."""
        if self.mode == "auto":
            return "graphs" if device.type == "cuda" else "eager"
        if self.mode == "graphs" and device.type != "cuda":
            raise ValueError("native engine: step mode 'graphs' needs a CUDA device")
        return self.mode


    def __call__(self, dec, pool, rope, live: int, longest: int, h2o: bool) -> torch.Tensor:
        """Logits [live, V] of the next step; ``longest``: the most slots a live row holds (host
        mirror), used by the eager path only."""
        mode = self.resolve(pool.device)
        if mode == "eager":
            return decode_step(dec, pool, rope, live, min(longest + 1, pool.cap), h2o)
        rows = min(bucket(live), pool.rows)
        if mode == "compile":
            if self.compiled is None:
                self.compiled = torch.compile(decode_step, fullgraph=True, dynamic=False,
                                              backend=self.backend)
            return self.compiled(dec, pool, rope, rows, pool.cap, h2o)[:live]
        span = min(pool.cap, -(-(longest + 1) // SPAN) * SPAN)
        return self._replay(dec, pool, rope, rows, span, h2o)[:live]

    def _replay(self, dec, pool, rope, rows: int, span: int, h2o: bool) -> torch.Tensor:
        if not self._captured_for(dec, pool, rope):
            # a new pool, table or weights: the old graphs hold dead addresses. Their memory pool
            # goes with them: once its last graph is freed, the allocator keeps it (use count 0)
            # until its blocks are released, and capturing into it again is an internal assert
            self.graphs.clear()
            self.mempool = None
            self.owner = (weakref.ref(pool), weakref.ref(rope), self._weight_ptrs(dec))
        key = (rows, span, h2o)
        if key not in self.graphs:
            self.graphs[key] = self._capture(dec, pool, rope, rows, span, h2o)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    @staticmethod
    def _weight_ptrs(dec) -> tuple[int, int]:
        return dec.qkv_w[0][0].data_ptr(), dec.lm_head.weight.data_ptr()

    def _captured_for(self, dec, pool, rope) -> bool:
        """Whether the graphs were captured on this pool, table and weights. Weak references, not
        ``id``: a new pool allocated right after the old one is freed often gets its ``id``."""
        if self.owner is None:
            return False
        pool_ref, rope_ref, ptrs = self.owner
        return pool_ref() is pool and rope_ref() is rope and ptrs == self._weight_ptrs(dec)

    def _capture(self, dec, pool, rope, rows: int, span: int, h2o: bool):
        """Capture one step for ``rows`` rows. The warm-up runs the step for real, so the row
        state it advances (and H2O's totals) is restored after it; the keys, values and window it
        writes are the ones the next step writes again."""
        saved = [t[:rows].clone() for t in (pool.n, pool.seen)]
        acc = pool.acc[:, :rows].clone() if pool.acc is not None else None
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            decode_step(dec, pool, rope, rows, span, h2o)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = decode_step(dec, pool, rope, rows, span, h2o)
        pool.n[:rows].copy_(saved[0])
        pool.seen[:rows].copy_(saved[1])
        if acc is not None:
            pool.acc[:, :rows].copy_(acc)
        return graph, out
