"""Native PyTorch rollout engine with a compressed KV cache (the default ``rollout.engine``).

Modules: ``model`` (runs HF Qwen2/Qwen3/Llama modules with our attention), ``kvcache`` (preallocated
per-row, per-layer KV store of ``budget + compress_every`` slots), ``policies`` (which slots each KV
policy keeps), ``sampling`` (tokens and sampler log-probs), ``engine`` (the batched generation loop),
``reference`` (teacher-forced recomputation under the recorded kept sets, for tests).
"""
from actors.native.engine import NativeEngine

__all__ = ["NativeEngine"]
