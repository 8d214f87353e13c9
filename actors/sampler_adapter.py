"""DistillSparse in a rollout actor: the sparse sampler runs the base weights plus the LoRA adapter.

The actor's model keeps the base weights (the broadcast lands there; dense evaluation and the
rollout's dense log-probs use it). The sampler is a second copy of the model whose target layers
hold ``W + (alpha / r) * B @ A`` (``common.lora.merge``), rebuilt after every weight load: merged
weights need no change in the native engine, and the dense paths never see the adapter. Its
engine records the kept sets of every sample (``trace``), which the rows carry to the learner as
``kv_evictions`` (``actors.native.reference.evictions``). Costs one more copy of the model.
"""
from __future__ import annotations

import copy

import torch

from common import lora


class SamplerAdapter:
    def __init__(self, cfg, base_engine):
        """``cfg``: the ``RolloutConfig`` (``distill_sparse`` enabled, native engine);
        ``base_engine``: the actor's ``NativeEngine`` over the base weights."""
        from actors.native import NativeEngine

        self.cfg = cfg.distill_sparse
        self.base = base_engine.model
        self.model = copy.deepcopy(self.base)
        self.engine = NativeEngine(self.model, cfg.kv, cfg.batch_size, trace=True,
                                   decode=base_engine.decode)
        # B = 0 until the first broadcast: the sampler starts as the base policy (peft's init)
        self.tensors = {n: torch.zeros(shape, dtype=dt, device=next(self.base.parameters()).device)
                        for n, shape, dt in lora.adapter_spec(self.base, self.cfg)}
        hf = self.base.config
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
        """Rebuild the sampler's weights from the base's and the adapter (after every load)."""
        lora.merge(self.model, self.base, self.tensors, self.cfg)
        self.engine.load_weights([], version)   # drops the engine's caches of the old weights

    def evictions(self, outs) -> list[list[int]]:
        """Each output's kept sets as flat eviction points [L * Hkv * (prompt + response)]."""
        from actors.native.reference import evictions

        return [evictions(o.trace, self.layers, self.kv_heads,
                          len(o.prompt_ids) + len(o.response_ids)).view(-1).tolist()
                for o in outs]
