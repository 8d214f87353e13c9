"""Weights of the vLLM engine under their HF names: spec, validation, checksum.

vLLM fuses HF parameters (``q_proj``/``k_proj``/``v_proj`` -> ``qkv_proj``, ``gate_proj``/``up_proj``
-> ``gate_up_proj``) and, on CPU, repacks linear weights into kernel formats and drops the original
tensors, so the engine's parameters cannot be read back as HF tensors. Hence:

* ``hf_skeleton`` builds the HF model on the meta device: its ``named_parameters`` give the weight
  spec (``cluster.weight_sync.weight_spec``) that the learner's broadcast must match;
* ``validate`` checks a batch of HF-named tensors against that spec *before* ``reload_weights`` (a
  reload that fails half-way leaves vLLM's parameters on the meta device, i.e. a dead engine);
* ``Ledger`` keeps ``|w|.sum()`` of every tensor last loaded successfully and reproduces
  ``common.modeling.checksum`` from them, so ``state_checksum`` equals the learner's after a sync.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from common.modeling import abs_sum, checksum_of_sums


def hf_skeleton(model_path: str | Path, dtype: torch.dtype):
    """The HF causal LM of model_path on the meta device (no memory, names/shapes/dtypes only)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.modeling import HF_LOAD

    config = AutoConfig.from_pretrained(str(model_path), **HF_LOAD)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def spec_of(skeleton) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(p.shape), p.dtype) for name, p in skeleton.named_parameters()}


def validate(named: Iterable[tuple[str, torch.Tensor]], spec: dict) -> list[tuple[str, torch.Tensor]]:
    """Materialize and check (name, tensor) pairs: known HF name, same shape, floating point,
    finite, and every parameter of the model present exactly once.

    Raises ValueError naming the first bad tensor; nothing has been loaded when it does. Complete sets
    only: vLLM's layerwise reload re-materializes every layer, and a layer that receives no tensors
    comes out uninitialized (measured: a reload of one tensor makes the model emit token 0 forever,
    and later full reloads do not recover it).
    """
    items = list(named)
    if not items:
        raise ValueError("load_weights: no tensors given")
    seen = set()
    for name, t in items:
        if name not in spec:
            raise ValueError(f"load_weights: model has no parameter {name!r}")
        if name in seen:
            raise ValueError(f"load_weights: parameter {name!r} given twice")
        seen.add(name)
        shape, _ = spec[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"load_weights: {name!r} has shape {tuple(t.shape)}, model has {shape}")
        if not t.is_floating_point():
            raise ValueError(f"load_weights: {name!r} has dtype {t.dtype}, expected floating point")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"load_weights: {name!r} has non-finite values")
    missing = [n for n in spec if n not in seen]
    if missing:
        raise ValueError(f"load_weights: the vLLM engine reloads whole models only; {len(missing)} "
                         f"of {len(spec)} parameters missing (e.g. {missing[0]!r})")
    return items


def refresh_tied_head(worker) -> bool:
    """After an in-place reload, rebuild the kernel of a ``lm_head`` tied to the embedding (runs
    in each vLLM worker, through ``collective_rpc``). True when the model has one.

    vLLM 0.32's layerwise reload loads the shared tensor under the embedding's name, so the tied
    head gets no tensor of its own (its layer is logged as a failed load) and is never processed
    again; on CPU its GEMM keeps the copy of the *old* weights that ``process_weights_after_loading``
    prepacked at start-up, and the sampler's log-probs drift off the learner's policy from the
    first broadcast on (tests/test_vllm_engine.py). Re-running that step on the head makes them
    equal again. CPU only: a GPU GEMM reads ``weight`` itself, and re-processing a quantized head
    there would convert it twice."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    if head is None or not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


class Ledger:
    """Per-tensor ``|w|.sum()`` of the weights the engine holds (HF names, engine dtype)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.sums: dict[str, float] = {}

    @torch.no_grad()
    def record(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            self.sums[name] = abs_sum(t.detach().to(self.dtype))  # on t's device

    def record_checkpoint(self, model_path: str | Path, spec: dict) -> None:
        """Initial weights: read the safetensors files of model_path (names outside spec skipped,
        e.g. a tied ``lm_head.weight``)."""
        from safetensors import safe_open

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_path}: no *.safetensors files (vLLM engine needs them)")
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    if name in spec:
                        self.record([(name, fh.get_tensor(name))])

    def checksum(self) -> float:
        """Same number as ``common.modeling.checksum`` over the HF parameters."""
        return checksum_of_sums(self.sums)
