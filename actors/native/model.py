"""Run an HF decoder-only model (Qwen2, Qwen3, Llama) module by module with our own attention.

The engine owns the KV cache and the attention computation, so it can (a) store keys and values in a
preallocated, compressible cache and (b) see attention probabilities for score-based eviction. The HF
modules do everything else: embeddings, projections, q/k norms (Qwen3), RoPE tables, MLPs, final
norm and LM head. ``tests/test_engine_model.py`` checks ``Decoder.forward_full`` against HF forward.

RoPE: keys are stored *after* rotation at their original absolute position, and every query is rotated
at its own absolute position. Evicting keys therefore never renumbers positions: the relative distance
between a query and a kept key is the same as in the dense model. (StreamingLLM's paper re-numbers
positions inside the rolling cache; we keep absolute positions for every policy so that the sparse
policy differs from the dense one only in which keys it sees.)
"""
from __future__ import annotations

import torch

SUPPORTED = ("qwen2", "qwen3", "llama")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE (HF "rotate_half" convention). x [B,H,T,D]; cos/sin [B,T,D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float,
           want_probs: bool = False):
    """Grouped-query attention with an explicit boolean mask.

    q [B,Hq,T,D]; k, v [B,Hkv,S,D]; mask broadcastable to [B,Hkv,1,T,S] (True = may attend).
    Returns (out [B,Hq,T,D], probs [B,Hkv,g,T,S] float32 or None). Softmax runs in float32.
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    # Fold the query heads of a group into the query axis: one batched GEMM per KV head that reads
    # the cache in place (a broadcast matmul against k.unsqueeze(2) would copy the cache every step).
    qg = q.reshape(b, hkv, g * t, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).view(b, hkv, g, t, -1).float() * scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(v.dtype).view(b, hkv, g * t, -1), v).view(b, hq, t, d)
    return out, (probs if want_probs else None)


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

    def rope(self, x: torch.Tensor, positions: torch.Tensor):
        """cos, sin [B,T,D] for absolute positions [B,T]."""
        return self.rotary(x, positions)

    def qkv(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer i input [B,T,H] -> rotated q [B,Hq,T,D], rotated k and v [B,Hkv,T,D]."""
        layer = self.layers[i]
        a = layer.self_attn
        h = layer.input_layernorm(x)
        b, t, _ = h.shape
        q = a.q_proj(h).view(b, t, -1, self.head_dim)
        k = a.k_proj(h).view(b, t, -1, self.head_dim)
        v = a.v_proj(h).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, i: int, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj of attention output [B,Hq,T,D], then the MLP block."""
        layer = self.layers[i]
        b, _, t, _ = attn_out.shape
        x = x + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, t, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x)).float()

    @torch.no_grad()
    def forward_full(self, input_ids: torch.Tensor, positions: torch.Tensor, mask_fn) -> torch.Tensor:
        """Whole-sequence forward; ``mask_fn(layer) -> bool [B,Hkv or 1,1,T,T]``. Returns logits."""
        x = self.embed(input_ids)
        cos, sin = self.rope(x, positions)
        for i in range(self.n_layers):
            q, k, v = self.qkv(i, x, cos, sin)
            out, _ = attend(q, k, v, mask_fn(i), self.scaling)
            x = self.finish(i, x, out)
        return self.logits(x)
