"""vLLM rollout engine (``rollout.engine=vllm``), an optional peer of ``actors/native``.

``VLLMEngine`` implements the ``actors.engine.Engine`` protocol on top of vLLM's ``LLM`` in
in-process mode. Importing this package does not import vLLM; constructing the engine does (vLLM is an
optional extra: ``requirements-vllm.txt``, docs/VLLM.md).

Modules: ``env`` (cache directories and process settings, applied before vLLM is imported),
``limits`` (what vLLM accepts, as plain values the config checks at load), ``kv``
(KV policy -> vLLM model overrides, kept ratio, KV accounting from the KV manager's blocks),
``weights`` (HF-named weight spec, validation before reload, checksum, NCCL transfer on GPU),
``engine`` (generation loop).
"""
from __future__ import annotations

__all__ = ["VLLMEngine", "SUPPORTED_POLICIES"]

SUPPORTED_POLICIES = ("dense", "streaming")


def __getattr__(name):
    if name == "VLLMEngine":
        from actors.vllm.engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
