"""Model helpers shared by the rollout, scorer and learner: loading, token log-probs, checksums.

All log-probs in the project are of ``log_softmax(logits / temperature)``: the scorer's dense
"old" log-probs, the learner's new log-probs and the rollout's sampler log-probs must describe the same
distribution, or the importance ratio rho_t = pi_old / pi_sampler is biased (Sparse-RL, Sec. 3).
"""
from __future__ import annotations

from pathlib import Path

import torch

# How every HF config, tokenizer and model is read: from the local directory only, running no code
# from it (a directory whose config or tokenizer names its own Python classes, ``auto_map``, is
# refused, not executed, and a terminal is never asked), weights from safetensors only (a
# ``pytorch_model.bin`` is a pickle, which can run code as it loads). The one place that says so.
HF_LOAD = {"local_files_only": True, "trust_remote_code": False}
HF_WEIGHTS = {**HF_LOAD, "use_safetensors": True}


def load_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """Load an HF causal LM from a local directory (nothing is ever fetched from a hub)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json (build it with "
                                f"`make model` or point rollout.model_path at an HF model directory)")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **HF_WEIGHTS)
    model.eval()
    return model


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V bytes of one token over ``layers`` layers of ``kv_heads`` heads of ``head_dim``
    cached in ``dtype``: a dense cache of n tokens holds n times this
    (``Engine.kv_bytes_per_token``; every engine and bench computes it here)."""
    return 2 * layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def hf_kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """``kv_bytes_per_token`` of an HF decoder ``config`` (``head_dim``, else hidden / heads)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return kv_bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, head_dim, dtype)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), **HF_LOAD)


LOGPROB_CHUNK_TOKENS = 1024  # response tokens whose [tokens, vocab] logits exist at once


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, *, response_mask: torch.Tensor | None = None,
                   with_entropy: bool = False, chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
                   min_chunks: int = 0, decoder_kwargs: dict | None = None,
                   hidden: torch.Tensor | None = None):
    """Per-position log p(input_ids[:, t] | input_ids[:, :t]) under softmax(logits / temperature).

    Returns a [B, T] float32 tensor aligned with ``input_ids``; position 0 (no context) is 0. With
    ``response_mask`` [B, T] only those positions are computed (0 elsewhere), otherwise every
    attended position. ``with_entropy``: also the [B, T] entropy of each of those positions'
    distributions (for an entropy bonus). Sequences are right-padded. Gradients flow when enabled.

    Memory: the decoder runs once ([B, T, hidden] states); the LM head and log-softmax then run over
    the selected positions only, ``chunk_tokens`` at a time, each chunk under activation
    checkpointing when gradients are on, so at most one chunk's [chunk, vocab] fp32 logits exist
    in the forward and in the backward (never [B, T, vocab]: 12 GB for 152k x 8 x 2.5k).
    ``min_chunks``: run at least that many LM-head calls (the extra ones on no rows), so
    data-parallel ranks whose every head call is a collective (ZeRO-3) call it equally often.
    log p = z_y - logsumexp(z), z = logits / temperature: the same numbers as ``log_softmax``.
    ``decoder_kwargs`` go to the decoder's forward (transformers hands them to the attention
    function: the sparse sampler's kept sets, ``learner/distill.py``). ``hidden``: the decoder's
    states when the caller already has them (``decoder_states``), so the decoder runs once.
    """
    if hidden is None:
        hidden = decoder_states(model, input_ids, attention_mask, decoder_kwargs)
    want = attention_mask if response_mask is None else response_mask
    sel = want[:, 1:] > 0                                  # token t is predicted at t - 1
    h, targets = hidden[:, :-1][sel], input_ids[:, 1:][sel]
    head = model.get_output_embeddings()
    grad = torch.is_grad_enabled() and h.requires_grad
    lps, ents = [], []
    # with gradients, at least one (possibly empty) chunk: a micro-batch whose every token was
    # rejected still needs a loss connected to the graph (DeepSpeed backpropagates every one)
    n_chunks = max(-(-h.shape[0] // chunk_tokens), int(min_chunks), int(grad))
    for a in range(0, n_chunks * chunk_tokens, chunk_tokens):
        args = (head, h[a:a + chunk_tokens], targets[a:a + chunk_tokens], float(temperature),
                with_entropy)
        if grad:
            from torch.utils.checkpoint import checkpoint

            lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*args)
        lps.append(lp)
        ents.append(ent)

    def place(parts: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.float32)
        body = torch.zeros(sel.shape, dtype=torch.float32, device=sel.device).masked_scatter(sel, flat)
        return torch.cat([body.new_zeros(body.shape[0], 1), body], dim=1)

    logp = place(lps)
    return (logp, place(ents)) if with_entropy else logp


def decoder_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   decoder_kwargs: dict | None = None) -> torch.Tensor:
    """The decoder's last hidden states [B, T, hidden] (before the LM head), ``token_logprobs``'s
    first step; ``decoder_kwargs`` go to the decoder's forward."""
    # position_ids from the mask so left or right padding gives the same positions as generation.
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids,
                               **(decoder_kwargs or {})).last_hidden_state


def _chunk_logprobs(head, h: torch.Tensor, targets: torch.Tensor, temperature: float,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """log-prob of ``targets`` (and the entropy) for hidden states h [N, H] (see token_logprobs)."""
    z = head(h).float()
    if temperature != 1.0:  # in place: the head's output is not saved for its backward
        z = z.div_(temperature)
    return _PickedLogprob.apply(z, targets, with_entropy)


class _PickedLogprob(torch.autograd.Function):
    """lp = z_y - logsumexp(z) and H = logsumexp(z) - E_p[z] for logits z [N, V] (fp32).

    Autograd's own graph of these keeps several [N, V] tensors for the backward (exp, softmax,
    a scatter of the gathered gradient); here the backward builds dz from one softmax, in place:
    dlp/dz = onehot(y) - p, dH/dz = -p (z - E_p[z]). With ``token_logprobs``' checkpointing z
    itself is recomputed in the backward, so at most z, p (and one temporary with the entropy)
    exist for one chunk.
    """

    @staticmethod
    def forward(ctx, z, targets, with_entropy):
        lse = torch.logsumexp(z, dim=-1)
        lp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
        ez = lp.new_zeros(0)
        if with_entropy:  # E_p[z] as a batched dot product: no [N, V] product tensor
            p = torch.exp(z - lse[:, None])
            ez = torch.bmm(p[:, None, :], z[:, :, None]).view(-1)
            del p
        ctx.save_for_backward(z, targets, lse, ez)
        ctx.with_entropy = with_entropy
        return lp, (lse - ez if with_entropy else ez)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        z, targets, lse, ez = ctx.saved_tensors
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp
        dz = (z - lse[:, None]).exp_()                       # p
        if ctx.with_entropy and g_ent is not None:
            w = (z - ez[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None])
            dz.mul_(w).neg_()                                # -p (g_lp + g_H (z - E_p[z]))
            del w
        else:
            dz.mul_(-g_lp[:, None])                          # -p g_lp
        dz.scatter_add_(1, targets[:, None], g_lp[:, None])  # + onehot(y) g_lp
        return dz, None, None


@torch.no_grad()
def checksum(named_tensors) -> float:
    """Order-independent-enough fingerprint of weights: sum over tensors of sum(|w| * (1 + i % 7)).

    Used by tests and logs to check that rollout/scorer weights equal the learner's after a broadcast.
    Names are sorted so the same weights always give the same number.
    """
    return checksum_of_sums({n: abs_sum(t) for n, t in named_tensors})


@torch.no_grad()
def abs_sum(t: torch.Tensor) -> float:
    """sum(|t|), computed where ``t`` lives (on its GPU for CUDA tensors: no copy to the host),
    accumulated in float64 so the CPU's and a GPU's reduction orders agree far below any real
    difference of weights, and a bf16 tensor sums to exactly what its float32 copy does."""
    return float(t.detach().abs().sum(dtype=torch.float64))


def checksum_of_sums(abs_sums: dict[str, float]) -> float:
    """``checksum`` from each tensor's sum(|w|) by name (for weights seen one at a time)."""
    return sum(v * (1 + i % 7) for i, (_, v) in enumerate(sorted(abs_sums.items())))
