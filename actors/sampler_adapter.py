"""DistillSparse in a rollout actor: the sparse sampler runs the base weights plus the LoRA adapter.

The actor's engine keeps the base weights (the broadcast lands there; dense evaluation and the
rollout's dense log-probs use them); the sampler adds the adapter, and the dense paths never see it:

* native engine: the sampler is a second copy of the model whose target layers hold
  ``W + (alpha / r) * B @ A`` (``common.lora.merge``), rebuilt after every weight load (merged
  weights need no change in the native engine). Costs one more copy of the model.
* vLLM engine: vLLM's own LoRA (``VLLMEngine.set_adapter``), reloaded in place after every weight
  load; sampling requests carry it (``adapter_view``), dense ones do not. No copy of the model.

The sampler's engine records the kept sets of every sample (``trace``), which the rows carry to
the learner as ``kv_evictions`` (``common.kept.evictions``).
"""
from __future__ import annotations

import copy

import torch

from common import lora


class SamplerAdapter:
    def __init__(self, cfg, base_engine):
        """``cfg``: the ``RolloutConfig`` (``distill_sparse`` enabled); ``base_engine``: the
        actor's engine over the base weights (native, or vLLM built with ``lora_rank``)."""
        self.cfg = cfg.distill_sparse
        self.base_engine = base_engine
        self.vllm = hasattr(base_engine, "adapter_view")
        base = base_engine.model         # vLLM: its meta-device HF skeleton (names and shapes)
        device = torch.device("cpu") if self.vllm else next(base.parameters()).device
        if self.vllm:
            self.engine = base_engine.adapter_view()
        else:
            from actors.native import NativeEngine

            self.base, self.model = base, copy.deepcopy(base)
            self.engine = NativeEngine(self.model, cfg.kv, cfg.batch_size, trace=True,
                                       decode=base_engine.decode)
        # B = 0 until the first broadcast: the sampler starts as the base policy (peft's init)
        self.tensors = {n: torch.zeros(shape, dtype=dt, device=device)
                        for n, shape, dt in lora.adapter_spec(base, self.cfg)}
        hf = base.config
        self.layers, self.kv_heads = hf.num_hidden_layers, hf.num_key_value_heads
        self.apply(0)

    def spec(self) -> list:
        return [(n, tuple(t.shape), t.dtype) for n, t in self.tensors.items()]

    def take(self, named_tensors) -> list:
        """Copy the adapter's tensors out of a weight load; return the rest (the base's)."""
        rest = []
        for name, t in named_tensors:
            if lora.is_adapter(name):
                if name not in self.tensors:
                    raise KeyError(f"load_weights: no adapter tensor {name!r}")
                self.tensors[name].copy_(t)
            else:
                rest.append((name, t))
        return rest

    def apply(self, version: int) -> None:
        """Rebuild the sampler from the base weights and the adapter (after every load)."""
        if self.vllm:
            self.base_engine.set_adapter(self.tensors, self.cfg)
            return
        lora.merge(self.model, self.base, self.tensors, self.cfg)
        self.engine.load_weights([], version)   # drops the engine's caches of the old weights

    def abs_sums(self) -> dict[str, float]:
        """sum(|w|) per wire name (``common.modeling.checksum_of_sums``)."""
        from common.modeling import abs_sum

        return {n: abs_sum(t) for n, t in self.tensors.items()}

    def evictions(self, outs) -> list[list[int]]:
        """Each output's kept sets as flat eviction points [L * Hkv * (prompt + response)]."""
        from common.kept import evictions

        return [evictions(o.trace, self.layers, self.kv_heads,
                          len(o.prompt_ids) + len(o.response_ids)).view(-1).tolist()
                for o in outs]
