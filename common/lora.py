"""The DistillSparse LoRA adapter as it travels and as the sampler applies it (no peft needed).

One adapter tensor pair per targeted linear layer ``m`` of the decoder (``rollout.distill_sparse``):
``A [r, in]`` and ``B [out, r]``, the sampler's weight becoming ``W + (alpha / r) * B @ A`` (LoRA,
Hu et al. 2022; peft's default scaling). On the wire (``cluster.weight_sync``) they follow the base
weights as extra spec entries named ``distill_sparse.<module>.lora_A`` / ``.lora_B`` (module = the
HF module path, e.g. ``model.layers.0.self_attn.q_proj``), always float32. The learner trains them
with peft (``learner/distill.py``); ``peft_name`` / ``wire_name`` convert between the two names.
"""
from __future__ import annotations

import torch

PREFIX = "distill_sparse."
WIRE_DTYPE = torch.float32


def targets(model: torch.nn.Module, target_modules) -> list[tuple[str, torch.nn.Linear]]:
    """(module path, linear) of every layer the adapter wraps, in ``named_modules`` order: the
    ``nn.Linear`` modules whose last name component is in ``target_modules`` (peft's matching of a
    list of plain names)."""
    want = set(target_modules)
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in want]


def adapter_spec(model: torch.nn.Module, cfg) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Weight-sync spec entries of the adapter for ``model`` (a plain HF model), to append after
    ``weight_spec(model)``; [] unless ``cfg.enabled`` (``cfg``: ``DistillSparseConfig`` or None)."""
    if cfg is None or not cfg.enabled:
        return []
    spec = []
    for name, lin in targets(model, cfg.target_modules):
        spec.append((f"{PREFIX}{name}.lora_A", (int(cfg.rank), lin.in_features), WIRE_DTYPE))
        spec.append((f"{PREFIX}{name}.lora_B", (lin.out_features, int(cfg.rank)), WIRE_DTYPE))
    return spec


def is_adapter(name: str) -> bool:
    return name.startswith(PREFIX)


def wire_name(peft_param: str) -> str | None:
    """``base_model.model.<module>.lora_A.default.weight`` -> ``distill_sparse.<module>.lora_A``
    (None for a name that is not a LoRA matrix)."""
    for which in ("lora_A", "lora_B"):
        mark = f".{which}."
        if mark in peft_param:
            module = peft_param.split(mark)[0].removeprefix("base_model.model.")
            return f"{PREFIX}{module}.{which}"
    return None


def read_adapter(path) -> dict[str, torch.Tensor]:
    """Adapter tensors by wire name from a peft ``save_pretrained`` folder (``<run>/final/
    distill_sparse``, a checkpoint's ``deepspeed/v<N>/distill_sparse``)."""
    from pathlib import Path

    from safetensors.torch import load_file

    state = load_file(str(Path(path) / "adapter_model.safetensors"))
    out = {wire_name(k): v for k, v in state.items()}
    if None in out:
        raise ValueError(f"{path}: not a LoRA adapter folder (keys {sorted(state)[:3]})")
    return out


def write_adapter(path, tensors: dict[str, torch.Tensor], cfg):
    """Write wire-named adapter ``tensors`` as a peft ``save_pretrained`` folder at ``path``
    (``adapter_config.json`` + ``adapter_model.safetensors``; ``read_adapter`` reads it back,
    ``PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load it). Returns the folder."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, t in tensors.items():
        if not is_adapter(name):
            raise ValueError(f"write_adapter: {name!r} is not an adapter tensor")
        module, which = name.removeprefix(PREFIX).rsplit(".", 1)
        state[f"base_model.model.{module}.{which}.weight"] = t.detach().to("cpu", WIRE_DTYPE) \
            .contiguous()
    save_file(state, str(out / "adapter_model.safetensors"))
    conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(cfg.rank),
            "lora_alpha": float(cfg.alpha), "target_modules": sorted(cfg.target_modules),
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False}
    (out / "adapter_config.json").write_text(json.dumps(conf, indent=1))
    return out


def scale(cfg) -> float:
    return float(cfg.alpha) / float(cfg.rank)


@torch.no_grad()
def merge(sampler: torch.nn.Module, base: torch.nn.Module, adapter: dict[str, torch.Tensor],
          cfg) -> None:
    """Write the sampler's weights: a copy of ``base``'s, plus ``scale * B @ A`` on every target
    layer. The sampler is a separate model of the same architecture (the base model keeps serving
    the dense paths); its parameters are written in place, so engines over it see the change once
    their caches are invalidated."""
    s = scale(cfg)
    own = dict(sampler.named_parameters())
    for name, p in base.named_parameters():
        own[name].copy_(p)
    for module, lin in targets(sampler, cfg.target_modules):
        a, b = adapter[f"{PREFIX}{module}.lora_A"], adapter[f"{PREFIX}{module}.lora_B"]
        delta = (b.float() @ a.float()) * s
        lin.weight.copy_((lin.weight.float() + delta.to(lin.weight.device)).to(lin.weight.dtype))
