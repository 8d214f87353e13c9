"""DistillSparse on the learner side: the sparse sampler's LoRA adapter and its training step.

Sparrow (Zhou et al. 2026, ``verl/workers/actor/dp_sparseloraactor.py``) trains a LoRA adapter that
only the sparse rollout engine uses: per mini-batch the base weights first take the normal step
with the adapter disabled, then the adapter alone takes a step on the *sparse* log-probs of the
same rollouts (its training forward runs the same sparse attention as its rollouts) with

    loss = PPO(sparse log-probs vs the sampler's, the batch's advantages)
           + lambda * k3 KL(sparse || dense)   (lambda = 0.001, "low_var_kl", dense = the old,
                                                pre-step dense log-probs)

Our sampler's sparsity comes from KV eviction, which a teacher-forced forward cannot re-decide, so
the rollout records where each key was evicted (``common.kept.evictions``, row column
``kv_evictions``) and the adapter's forward attends only to what the sampler saw at each step,
per layer and KV head (the ``sparse_kept_sets`` attention function below). In float32 with a zero
adapter this reproduces the sampler's log-probs exactly (tests/test_distill_sparse.py), so the
PPO ratio is a true sparse-policy ratio. ``divergence=tv`` swaps the k3 term for the exact total
variation to the current dense base over the vocabulary, 1 - alpha_t (``SparseAdapter.tv_sum``).

The adapter lives in a second HF model wrapped by peft whose base parameters *share storage* with
the DeepSpeed engine's (re-tied before every use: no copy, always the current base weights, frozen
here). So the adapter gets gradients only from this loss and the base weights only from the main
loss, by construction. Under ZeRO-3 the engine's parameters are partitioned: the adapter's step
gathers the whole base for its duration (``deepspeed.zero.GatheredParameters``, read-only, every
rank) and drops its references afterwards, so for that step each rank holds one full copy of the
base weights (the model must fit one device unsharded; ZeRO-3 still shards the optimiser states,
gradients and, between steps, the weights).
"""
from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from common import lora
from common.modeling import abs_sum, decoder_states, load_model, token_logprobs

ATTN = "sparse_kept_sets"
ADAPTER_DIR = "distill_sparse"   # the adapter's peft folder beside an HF export / in a checkpoint


def kept_sets_attention(module, query, key, value, attention_mask, scaling, dropout=0.0,
                        kv_evictions=None, **kwargs):
    """transformers attention function: causal attention restricted per layer and KV head to the
    keys the sparse sampler still held (``kv_evictions`` [B, L * Hkv, T], see module doc). HF
    builds no mask for an unregistered mask type, so rows are right-padded: a padded key comes
    after every real query and the causal rule already hides it."""
    from common.kept import kept_visibility

    if kv_evictions is None:
        raise ValueError(f"attention '{ATTN}' needs kv_evictions (the sampler's kept sets)")
    b, hq, t, _ = query.shape
    hkv = key.shape[1]
    ev = kv_evictions.view(b, -1, hkv, kv_evictions.shape[-1])[:, module.layer_idx, :, :t]
    g = hq // hkv
    vis = kept_visibility(ev.to(query.device)).repeat_interleave(g, dim=1)      # [B, Hq, T, T]
    out = F.scaled_dot_product_attention(query, key.repeat_interleave(g, dim=1),
                                         value.repeat_interleave(g, dim=1), attn_mask=vis,
                                         scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _tv_chunk(head, h_sparse: torch.Tensor, h_dense: torch.Tensor, temperature: float):
    """sum of 1 - alpha over one chunk of positions (``SparseAdapter.tv_sum``)."""
    from correction.metrics import tv_agreement

    z_s = head(h_sparse).float() / temperature
    with torch.no_grad():
        z_d = head(h_dense).float() / temperature
    return (1.0 - tv_agreement(F.log_softmax(z_s, -1), F.log_softmax(z_d, -1))).sum()


def _divergence(cfg) -> str:
    """``rollout.distill_sparse.divergence`` as its value (``actors.config.DistillDivergence``:
    the learner reads the config it is handed, it does not import the rollout's)."""
    return getattr(cfg.divergence, "value", cfg.divergence)


def register_attention() -> None:
    """Make ``ATTN`` an attention implementation transformers models can be set to."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN, kept_sets_attention)


def lora_config(cfg):
    from peft import LoraConfig

    # lora_dropout 0: dropout would make the PPO ratio start away from 1; B starts at zero
    # (peft's default init), so the sampler equals the base policy until the adapter trains
    return LoraConfig(r=int(cfg.rank), lora_alpha=float(cfg.alpha),
                      target_modules=list(cfg.target_modules), lora_dropout=0.0, bias="none")


def _chunk_means(lm: dict, total: float, n: float) -> dict[str, float]:
    """``policy_loss`` metrics of one chunk as distill/* means over its own tokens (the loss
    terms come as shares of the mini-batch's mean: share * total / n)."""
    share = {"loss/pg": "pg", "loss/kl_ref": "kl_dense", "loss/total": "total"}
    own = {"loss/clipfrac": "clipfrac", "loss/ratio_mean": "ratio_mean",
           "loss/ratio_max": "ratio_max", "loss/approx_kl_old": "approx_kl_sampler"}
    out = {f"distill/{v}": float(lm[k]) * total / max(n, 1.0) for k, v in share.items() if k in lm}
    out.update({f"distill/{v}": float(lm[k]) for k, v in own.items() if k in lm})
    out["distill/num_tokens"] = n
    return out


def make_adapter(cfg, model_path: str, params: dict, learner_cfg, world_size: int):
    """The learner's adapter for the ``rollout.distill_sparse`` section ``cfg`` (None: off)."""
    from common.dtypes import torch_dtype

    if cfg is None or not cfg.enabled:
        return None
    return SparseAdapter(cfg, model_path, params, torch_dtype(learner_cfg.dtype),
                         learner_cfg.grad_clip, world_size, learner_cfg.seed,
                         zero3=int(learner_cfg.zero_stage) == 3)


class SparseAdapter:
    """The adapter (``DistillSparseConfig`` ``cfg``) over the base parameters ``base`` (HF name
    -> the training engine's parameter, same architecture as ``model_path``)."""

    def __init__(self, cfg, model_path: str, base: dict[str, torch.nn.Parameter],
                 dtype: torch.dtype, grad_clip: float = 1.0, world_size: int = 1, seed: int = 0,
                 zero3: bool = False):
        from peft import get_peft_model

        register_attention()
        self.cfg, self.grad_clip, self.world_size = cfg, float(grad_clip), int(world_size)
        self.zero3 = bool(zero3)
        device = next(iter(base.values())).device
        # built on the CPU and tied to the engine's parameters before it moves, so only the LoRA
        # parameters ever take device memory (under ZeRO-3 the loaded base is never on the device)
        model = load_model(model_path, dtype=dtype)
        # A's random init from ``seed`` alone (not the process's RNG stream, which it leaves
        # untouched): every data-parallel rank and a resumed run start from the same adapter
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = get_peft_model(model, lora_config(cfg))
        self.model.base_model.model.set_attn_implementation(ATTN)
        self._base = base
        self.tie()
        self.model.to(device)      # moves the LoRA parameters; the tied ones are there already
        self.params = {lora.wire_name(n): p for n, p in self.model.named_parameters()
                       if p.requires_grad}
        if None in self.params or not self.params:
            raise ValueError(f"peft LoRA parameters not recognised: {list(self.params)[:4]}")
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=float(cfg.lr),
                                           weight_decay=0.0)

    def tie(self) -> None:
        """Point the peft model's frozen base parameters at the engine's current ones (under
        ZeRO-3 outside ``_full_base``: the empty stubs of partitioned parameters)."""
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                continue
            hf = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            if hf not in self._base:
                raise KeyError(f"distill adapter: no base parameter {hf!r} for {name!r}")
            p.data = self._base[hf].data

    @contextmanager
    def _full_base(self):
        """The adapter's model over the full base weights for the duration. ZeRO-3: a collective
        (every rank enters) that gathers every base parameter, read-only; on the way out the
        model is tied to the partitioned stubs again, so no reference keeps the gathered copies."""
        if not self.zero3:
            self.tie()
            yield
            return
        import deepspeed

        try:
            with deepspeed.zero.GatheredParameters(list(self._base.values()), modifier_rank=None):
                self.tie()
                yield
        finally:
            self.tie()

    # ---- the weights on the wire --------------------------------------------------------------
    def spec(self) -> list:
        return [(n, tuple(p.shape), lora.WIRE_DTYPE) for n, p in self.params.items()]

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach().to(lora.WIRE_DTYPE)) for n, p in self.params.items()]

    def abs_sums(self) -> dict[str, float]:
        """sum(|w|) per wire name (``common.modeling.checksum_of_sums``)."""
        return {n: abs_sum(t) for n, t in self.named()}

    # ---- training -----------------------------------------------------------------------------
    def _sparse_inputs(self, tensors: dict, rows, t: int):
        """(input_ids, attention_mask, decoder kwargs with the kept sets) of ``rows``, on the
        adapter's device."""
        dev = next(iter(self.params.values())).device
        return (tensors["input_ids"][rows, :t].to(dev), tensors["attention_mask"][rows, :t].to(dev),
                {"kv_evictions": tensors["kv_evictions"][rows, :, :t].to(dev)})

    def sparse_states(self, tensors: dict, rows, t: int) -> torch.Tensor:
        """The sparse sampler's decoder states [rows, t, hidden] (base + adapter, kept sets)."""
        return decoder_states(self.model, *self._sparse_inputs(tensors, rows, t))

    def sparse_logprobs(self, tensors: dict, rows, t: int, temperature: float,
                        hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Sparse-policy log-probs [rows, t] of rows ``rows`` (base + adapter, kept sets);
        ``hidden``: their ``sparse_states`` when already computed."""
        ids, mask, kw = self._sparse_inputs(tensors, rows, t)
        return token_logprobs(self.model, ids, mask, temperature,
                              response_mask=tensors["response_mask"][rows, :t].to(ids.device),
                              decoder_kwargs=kw, hidden=hidden)

    def train_step(self, tensors: dict, correction_cfg, temperature: float,
                   micro_batch_size: int, mini_batches: int = 1) -> dict[str, float]:
        """After the base step, one adapter step per mini-batch (``mini_batch`` 0 ..
        ``mini_batches`` - 1; every rank steps for each, rows or not: the gradient sum is a
        collective) on this rank's rows: PPO on the sparse log-probs against the sampler's
        recorded ones plus ``kl_coef`` x k3 KL to the dense old log-probs, token mean over the
        mini-batch's response tokens (all ranks). Returns distill/* metrics (token-weighted
        means over this rank's rows)."""
        t0 = time.time()
        if "kv_evictions" not in tensors:
            raise ValueError("distill_sparse: the batch has no kv_evictions (rows from a rollout "
                             "without rollout.distill_sparse.enabled)")
        cc = self._loss_config(correction_cfg)
        resp = tensors["response_mask"] > 0
        parts, norms = [], []
        with self._full_base():
            for m in range(int(mini_batches)):
                rows = (tensors["mini_batch"] == m).nonzero().squeeze(1)
                total = self._global_sum(float(resp[rows].sum()))
                if total > 0:
                    parts += self._backward(tensors, rows, resp, total, cc, temperature,
                                            micro_batch_size)
                    norms.append(self._step())
        from learner.batch import combine_weighted

        out = combine_weighted(parts)
        out["distill/grad_norm"] = sum(norms) / len(norms) if norms else 0.0
        out["distill/optimizer_steps"] = float(len(norms))
        out["time/distill_s"] = time.time() - t0
        return out

    def _backward(self, tensors: dict, rows, resp, total: float, cc, temperature: float,
                  micro_batch_size: int) -> list:
        """The adapter's gradients (zeroed first) of one mini-batch's loss on ``rows``, a share
        of the mean over its ``total`` response tokens on every rank; [(tokens, metrics)] per
        micro-batch."""
        from correction import policy_loss

        self.optimizer.zero_grad(set_to_none=True)
        parts = []
        tv = _divergence(self.cfg) == "tv"
        for chunk in rows.split(int(micro_batch_size)) if rows.numel() else ():
            t = max(2, int(tensors["attention_mask"][chunk].sum(1).max()))
            # tv: one sparse forward feeds both the PPO log-probs and the TV term
            hidden = self.sparse_states(tensors, chunk, t) if tv else None
            new = self.sparse_logprobs(tensors, chunk, t, temperature, hidden)
            keep = resp[chunk, :t].to(new.device)
            cut = lambda k: tensors[k][chunk, :t].to(new.device).float()  # noqa: E731
            loss, lm = policy_loss(new, cut("sampler_logprobs"), tensors["advantages"][chunk]
                                   .to(new.device), torch.ones_like(new), keep, cc,
                                   ref_logp=cut("old_logprobs"), denominator=total)
            means = _chunk_means(lm, total, float(keep.sum()))
            if tv:
                div = self.tv_sum(tensors, chunk, t, temperature, hidden)
                loss = loss + float(self.cfg.kl_coef) * div / total
                means["distill/tv_dense"] = float(div.detach()) / max(float(keep.sum()), 1.0)
            loss.backward()
            parts.append((float(keep.sum()), means))
        return parts

    def tv_sum(self, tensors: dict, rows, t: int, temperature: float,
               hidden: torch.Tensor | None = None) -> torch.Tensor:
        """sum over the response tokens of ``rows`` of TV(sparse, dense) = 1 - alpha_t, the exact
        disagreement the schedule's probes measure (``correction.metrics.tv_agreement``), between
        the sparse sampler (base + adapter under the kept sets; gradients reach the adapter) and
        the current dense base (adapter off, nothing evicted; no gradients), both at
        ``temperature``; ``hidden``: the rows' ``sparse_states`` when already computed. The LM
        head runs ``LOGPROB_CHUNK_TOKENS`` positions at a time, under activation checkpointing,
        so [tokens, vocab] logits of one chunk exist at once."""
        from common.kept import NEVER
        from common.modeling import LOGPROB_CHUNK_TOKENS

        ids, mask, kw = self._sparse_inputs(tensors, rows, t)
        sel = tensors["response_mask"][rows, :t].to(ids.device)[:, 1:] > 0   # t predicted at t-1
        if hidden is None:
            hidden = decoder_states(self.model, ids, mask, kw)
        h_s = hidden[:, :-1][sel]
        with torch.no_grad(), self.model.disable_adapter():
            dense = {"kv_evictions": torch.full_like(kw["kv_evictions"], NEVER)}
            h_d = decoder_states(self.model, ids, mask, dense)[:, :-1][sel]
        head = self.model.get_output_embeddings()
        from torch.utils.checkpoint import checkpoint

        total = h_s.new_zeros(())
        for a in range(0, h_s.shape[0], LOGPROB_CHUNK_TOKENS):
            part = slice(a, a + LOGPROB_CHUNK_TOKENS)
            total = total + checkpoint(_tv_chunk, head, h_s[part], h_d[part], float(temperature),
                                       use_reentrant=False)
        return total

    def _loss_config(self, correction_cfg):
        """The main loss's clipping and ratio clamp, with the adapter's KL (k3, ``kl_coef``; none
        with ``divergence=tv``, whose term ``_backward`` adds) and neither entropy bonus nor the
        main loss's reference KL."""
        from correction.config import KLEstimator, LossAggregation

        cc = copy.deepcopy(correction_cfg)
        k3 = _divergence(self.cfg) == "k3"
        cc.loss.kl_coef = float(self.cfg.kl_coef) if k3 else 0.0
        cc.loss.kl_estimator = KLEstimator.K3
        cc.loss.entropy_coef = 0.0
        cc.loss.aggregation = LossAggregation.TOKEN_MEAN
        return cc

    def _global_sum(self, x: float) -> float:
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    def _step(self) -> float:
        """Sum the adapter's gradients over ranks (each rank's loss is its share of the global
        mean), clip, step. Returns the pre-clip norm."""
        params = list(self.params.values())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.world_size > 1:
            import torch.distributed as dist

            for p in params:
                dist.all_reduce(p.grad)
        clip = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        self.optimizer.step()
        return norm

    # ---- persistence --------------------------------------------------------------------------
    def save(self, where: str | Path, optimizer: bool = True) -> None:
        """Into ``where/distill_sparse``: peft ``save_pretrained`` (adapter_config.json +
        adapter_model.safetensors, loadable with ``PeftModel.from_pretrained(base, that folder)``)
        plus the optimiser state."""
        path = Path(where) / ADAPTER_DIR
        self.model.save_pretrained(str(path))
        if optimizer:
            torch.save(self.optimizer.state_dict(), path / "optimizer.pt")

    def load(self, where: str | Path) -> None:
        """What ``save`` wrote into ``where`` (a checkpoint without it: FileNotFoundError)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = Path(where) / ADAPTER_DIR
        if not (path / "adapter_model.safetensors").is_file():
            raise FileNotFoundError(f"rollout.distill_sparse is enabled but the checkpoint has no "
                                    f"adapter at {path} (saved without DistillSparse)")
        state = load_file(str(path / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(self.model, state)
        missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
        if missing:
            raise ValueError(f"adapter checkpoint {path} lacks {missing[:3]}")
        opt = path / "optimizer.pt"
        if opt.is_file():
            self.optimizer.load_state_dict(torch.load(opt, weights_only=True))
