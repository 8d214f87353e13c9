"""Run an HF decoder-only model (Qwen2, Qwen3, Llama) module by module with our own attention.

The engine owns the KV cache and the attention computation, so it can (a) store keys and values in a
preallocated, compressible cache and (b) see attention probabilities for score-based eviction. The HF
modules do everything else: embeddings, projections, q/k norms (Qwen3), RoPE tables, MLPs, final
norm and LM head. ``tests/test_engine_dense.py`` checks ``Decoder.forward_full`` against HF forward
for every test-model family (``common/testmodels.py``).

RoPE: keys are stored *after* rotation at their original absolute position, and every query is rotated
at its own absolute position. Evicting keys therefore never renumbers positions: the relative distance
between a query and a kept key is the same as in the dense model. (StreamingLLM's paper re-numbers
positions inside the rolling cache; we keep absolute positions for every policy so that the sparse
policy differs from the dense one only in which keys it sees.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED = ("qwen2", "qwen3", "llama")


def fuse_linears(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of linears sharing an input into one tensor and make
    each parameter a view into it, so one GEMM replaces several and in-place weight updates
    (``param.copy_``, as ``load_weights`` does) land in the fused tensor. Idempotent."""
    ws = [m.weight for m in linears]
    fused = getattr(linears[0], "_fused", None)
    if fused is not None and all(w.data_ptr() == p for w, p in zip(ws, fused[2])):
        return fused[0], fused[1]
    weight = torch.cat([w.data for w in ws])
    bias = None
    if linears[0].bias is not None:
        bias = torch.cat([m.bias.data for m in linears])
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[row:row + n]
        if bias is not None:
            m.bias.data = bias[row:row + n]
        row += n
    linears[0]._fused = (weight, bias, [m.weight.data_ptr() for m in linears])
    return weight, bias


def rms_norm(module, x: torch.Tensor) -> torch.Tensor:
    """HF RMSNorm (weight * normalize(x in float32), cast back) as one fused op."""
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        return module(x)
    if x.dtype == torch.float32 and module.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), module.weight, eps=eps)   # one kernel, same math
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return module.weight * y


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE (HF "rotate_half" convention). x [B,H,T,D]; cos/sin [B,T,D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def cpu_low_precision(t: torch.Tensor) -> bool:
    """bf16 (or another dtype below float32) on the CPU: attention then computes its scores and
    softmax in float32 (see ``attend``, ``decode_attend``). On CUDA the prefill's bf16 GEMMs
    read the strided cache in place (float32 softmax of bf16 scores); the decode step uses SDPA's
    fused kernel there (``decode_attend``)."""
    return t.dtype != torch.float32 and t.device.type == "cpu"


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float,
           want_probs: bool = False):
    """Grouped-query attention with an explicit boolean mask.

    q [B,Hq,T,D]; k, v [B,Hkv,S,D]; mask broadcastable to [B,Hkv,1,T,S] (True = may attend).
    Returns (out [B,Hq,T,D], probs [B,Hkv,g,T,S] float32 or None). Softmax runs in float32; on the
    CPU the scores too in every dtype (bf16 q and k are upcast for the score GEMM; the
    probabilities meet v in its dtype).
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    # Fold the query heads of a group into the query axis: one batched GEMM per KV head that reads
    # the cache in place (a broadcast matmul against k.unsqueeze(2) would copy the cache every step).
    qg = q.reshape(b, hkv, g * t, d)
    if cpu_low_precision(q):
        # bf16: scores and softmax in float32, as vLLM's kernels keep them (a logit rounded to
        # bf16's 8-bit mantissa before the softmax would move every probability with it)
        qg, k = qg.float(), k.float()
    scores = torch.matmul(qg, k.transpose(-1, -2)).view(b, hkv, g, t, -1).float() * scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(v.dtype).view(b, hkv, g * t, -1), v).view(b, hq, t, d)
    return out, (probs if want_probs else None)


def decode_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: int, bias: torch.Tensor,
                  scaling: float, want_probs: bool = False):
    """One query per row against the first s cache slots (the decode step; same math as ``attend``).

    q [B,Hq,D]; k, v [B,Hkv,cap,D] (the whole cache: the slice is a view, read in place); bias
    [B*Hkv,1,s] additive mask (0 or -inf) built once per step for every layer. Returns (out [B,Hq*D],
    probs [B,Hkv,g,s] float32 or None). Scale and mask go into one ``baddbmm`` and the batch is
    flattened to (row, KV head) so each step runs three kernels per layer instead of a dozen.
    bf16 (or any dtype below float32) on the CPU, and any dtype on CUDA: the fused
    ``scaled_dot_product_attention`` when no probabilities are wanted (H2O wants them); else the
    same GEMMs, on the CPU over float32 copies of q and the cache slice; softmax is float32
    either way.
    """
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    if q.is_cuda and not want_probs:
        # the group's query heads as g queries of their KV head: no GQA expansion of the cache
        # (SDPA's enable_gqa with a mask falls back to its math kernel), one fused kernel with
        # float32 accumulation over the strided cache slice
        out = F.scaled_dot_product_attention(
            q.view(b, hkv, g, d), k[:, :, :s], v[:, :, :s],
            attn_mask=bias.view(b, hkv, 1, s)[:, :1], scale=scaling)
        return out.reshape(b, hq * d), None
    if cpu_low_precision(q) and not want_probs:
        # bf16: the fused kernel reads the strided cache slice in place and keeps scores and
        # softmax in float32; bf16 ``baddbmm``/``bmm`` on CPU copy every row's slice into a
        # contiguous buffer first (the largest cost of a bf16 decode step after the linears) and
        # round the scores to bf16
        out = F.scaled_dot_product_attention(
            q[:, :, None], k[:, :, :s], v[:, :, :s], attn_mask=bias.view(b, hkv, 1, s)[:, :1],
            scale=scaling, enable_gqa=True)
        return out.reshape(b, hq * d), None
    kk = k[:, :, :s].reshape(b * hkv, s, d)            # views: rows are [Hkv*cap*D] apart
    vv = v[:, :, :s].reshape(b * hkv, s, d)
    qq = q.reshape(b * hkv, g, d)
    if cpu_low_precision(q):                           # H2O in bf16: float32 scores (see above)
        qq, kk, bias = qq.float(), kk.float(), bias.float()
    scores = torch.baddbmm(bias, qq, kk.transpose(1, 2), alpha=scaling)
    probs = torch.softmax(scores.float(), dim=-1)
    out = torch.bmm(probs.to(v.dtype), vv).view(b, hq * d)
    return out, (probs.view(b, hkv, g, s) if want_probs else None)


class RopeTable:
    """cos / sin rows of every position a generation call can reach, computed once with the model's
    own rotary module; a decode step then gathers one row per sequence instead of running it.
    ``sin`` is stored with the rotate-half sign folded in (first half negated) so that
    ``rotate(x) = x * cos + roll(x, D/2) * sin``. Rope types whose tables depend on the sequence
    length (dynamic NTK, LongRoPE) are recomputed per step by the module."""

    STATIC = ("default", "linear", "llama3", "yarn")

    def __init__(self, dec: "Decoder", n: int, device):
        params = getattr(dec.hf.config, "rope_parameters", None) or {}
        self.dec, self.table, self.n, self.device = dec, None, n, torch.device(device)
        x = torch.zeros(1, 1, dec.hidden, dtype=dec.dtype, device=device)
        if params.get("rope_type", "default") in self.STATIC:
            cos, sin = dec.rope(x, torch.arange(n, device=device)[None])
            self.table = (cos[0], self._signed(sin[0]))
        self.x = x

    @staticmethod
    def _signed(sin: torch.Tensor) -> torch.Tensor:
        half = sin.shape[-1] // 2
        return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)

    def at(self, pos: torch.Tensor):
        """cos, signed sin [B,D] for positions pos [B]."""
        if self.table is not None:
            return self.table[0][pos], self.table[1][pos]
        cos, sin = self.dec.rope(self.x.expand(pos.shape[0], 1, -1), pos[:, None])
        return cos[:, 0], self._signed(sin[:, 0])


def rotate_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [B,H,D] at one position per row (cos, signed sin [B,D]; see ``RopeTable``)."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, dims=-1) * sin[:, None]


class Decoder:
    """Functional view of an HF causal LM. Holds references to the HF modules (weights are shared,
    so ``load_weights`` on the HF model is seen here)."""

    def __init__(self, hf_model):
        cfg = hf_model.config
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"native engine supports model types {SUPPORTED}, got {cfg.model_type!r}")
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("native engine: models with use_sliding_window=True are not supported")
        self.hf = hf_model
        inner = hf_model.model
        self.embed, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        self.rotary, self.lm_head = inner.rotary_emb, hf_model.lm_head
        attn = self.layers[0].self_attn
        self.n_layers = len(self.layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.qk_norm = hasattr(attn, "q_norm")
        self.dtype = next(hf_model.parameters()).dtype
        self.sizes = (self.n_heads * self.head_dim, self.n_kv * self.head_dim)
        self.hidden = cfg.hidden_size
        self._sig, self.wt = None, None
        self.refresh()

    def invalidate(self) -> None:
        """Weights were written in place by something that may not bump ``_version`` (a gloo
        receive straight into the parameters): rebuild the cached copies at the next refresh."""
        self._sig = None

    def refresh(self) -> None:
        """(Re)build the fused QKV and gate/up weights. Cheap when nothing changed; needed after
        parameters were replaced rather than updated in place (``model.to(...)``,
        ``load_state_dict(..., assign=True)``). The engine calls it before every generation."""
        self.qkv_w, self.gate_up = [], []
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.qkv_w.append(fuse_linears([a.q_proj, a.k_proj, a.v_proj]))
            self.gate_up.append(fuse_linears([mlp.gate_proj, mlp.up_proj]))
        # On CPU, MKL multiplies a few rows by a pre-transposed [in, out] weight 1.3-3x faster than
        # by the [out, in] weight F.linear passes (measured for 16 rows at hidden 128-768), so the
        # decode step keeps transposed copies (twice the weight memory, CPU only). They are rebuilt
        # whenever a parameter moved (data_ptr) or was written in place (_version), e.g. by
        # ``load_weights``, so they never go stale.
        if next(self.hf.parameters()).device.type != "cpu":
            self.wt = None
            return
        sig = tuple((p.data_ptr(), p._version) for p in self.hf.parameters())
        if sig != self._sig:
            self._sig, self.wt = sig, self._transposed()

    def _transposed(self) -> list:
        t = lambda w, b=None: (w.detach().t().contiguous(), None if b is None else b.detach())  # noqa
        out = []
        for i, layer in enumerate(self.layers):
            o, mlp = layer.self_attn.o_proj, layer.mlp
            out.append((t(*self.qkv_w[i]), t(o.weight, o.bias), t(*self.gate_up[i]),
                        t(mlp.down_proj.weight, mlp.down_proj.bias)))
        out.append(t(self.lm_head.weight, getattr(self.lm_head, "bias", None)))
        return out

    def _lin(self, x: torch.Tensor, i: int, j: int, w: torch.Tensor, b=None) -> torch.Tensor:
        """Linear j (0 qkv, 1 o_proj, 2 gate_up, 3 down) of layer i for 2-D x."""
        if self.wt is None:
            return F.linear(x, w, b)
        wt, bias = self.wt[i][j]
        return torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)

    def rope(self, x: torch.Tensor, positions: torch.Tensor):
        """cos, sin [B,T,D] for absolute positions [B,T]."""
        return self.rotary(x, positions)

    def qkv(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer i input [B,T,H] -> rotated q [B,Hq,T,D], rotated k and v [B,Hkv,T,D]."""
        layer = self.layers[i]
        a = layer.self_attn
        h = rms_norm(layer.input_layernorm, x)
        b, t, _ = h.shape
        nq, nkv = self.sizes
        q, k, v = F.linear(h, *self.qkv_w[i]).split((nq, nkv, nkv), dim=-1)
        q = q.view(b, t, -1, self.head_dim)
        k = k.view(b, t, -1, self.head_dim)
        v = v.reshape(b, t, -1, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = rms_norm(a.q_norm, q), rms_norm(a.k_norm, k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, i: int, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj of attention output [B,Hq,T,D], then the MLP block."""
        layer = self.layers[i]
        b, _, t, _ = attn_out.shape
        x = x + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, t, -1))
        mlp = layer.mlp
        gate, up = F.linear(rms_norm(layer.post_attention_layernorm, x),
                            *self.gate_up[i]).chunk(2, dim=-1)
        return x + mlp.down_proj(mlp.act_fn(gate) * up)

    # ---- one decode step: x is [B,H] (one token per row), no sequence axis ------------------------
    def step_qkv(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[B,H] -> rotated q [B,Hq,D], rotated k [B,Hkv,D], v [B,Hkv,D] (cos/sin from RopeTable)."""
        layer = self.layers[i]
        b, d, hq = x.shape[0], self.head_dim, self.n_heads
        nq, nkv = self.sizes
        qkv = self._lin(rms_norm(layer.input_layernorm, x), i, 0, *self.qkv_w[i])
        v = qkv[:, nq + nkv:].view(b, -1, d)
        if self.qk_norm:
            a = layer.self_attn
            q = rotate_rows(rms_norm(a.q_norm, qkv[:, :nq].view(b, hq, d)), cos, sin)
            return q, rotate_rows(rms_norm(a.k_norm, qkv[:, nq:nq + nkv].view(b, -1, d)), cos, sin), v
        qk = rotate_rows(qkv[:, :nq + nkv].view(b, -1, d), cos, sin)   # q and k heads together
        return qk[:, :hq], qk[:, hq:], v

    def step_finish(self, i: int, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """``finish`` for x [B,H] and attention output [B,Hq*D]."""
        layer = self.layers[i]
        o, mlp = layer.self_attn.o_proj, layer.mlp
        x = x + self._lin(attn_out, i, 1, o.weight, o.bias)
        gate, up = self._lin(rms_norm(layer.post_attention_layernorm, x), i, 2,
                             *self.gate_up[i]).chunk(2, dim=-1)
        return x + self._lin(mlp.act_fn(gate) * up, i, 3, mlp.down_proj.weight, mlp.down_proj.bias)

    def step_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``logits`` for x [B,H]."""
        if self.wt is None:
            return self.logits(x)
        wt, b = self.wt[-1]
        h = rms_norm(self.norm, x)
        return (torch.mm(h, wt) if b is None else torch.addmm(b, h, wt)).float()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rms_norm(self.norm, x)).float()

    @torch.no_grad()
    def forward_full(self, input_ids: torch.Tensor, positions: torch.Tensor, mask_fn,
                     head: bool = True) -> torch.Tensor:
        """Whole-sequence forward; ``mask_fn(layer) -> bool [B,Hkv or 1,1,T,T]``. Returns logits,
        or with ``head=False`` the last layer's hidden states (``logits(x)`` maps them)."""
        x = self.embed(input_ids)
        cos, sin = self.rope(x, positions)
        for i in range(self.n_layers):
            q, k, v = self.qkv(i, x, cos, sin)
            out, _ = attend(q, k, v, mask_fn(i), self.scaling)
            x = self.finish(i, x, out)
        return self.logits(x) if head else x
