"""Native PyTorch rollout engine with a compressed KV cache (the default ``rollout.engine``).

Modules: ``model`` (runs HF Qwen2/Qwen3/Llama modules with our attention), ``kvcache`` (the slot
pool of a call: every row's KV, ``budget + compress_every`` slots, and its row state on the
device), ``step`` (the fixed-shape, sync-free decode step: eager, compiled or CUDA graphs),
``batch`` (host bookkeeping by arithmetic), ``policies`` (which slots each KV policy keeps),
``sampling`` (tokens and sampler log-probs), ``engine`` (the batched generation loop),
``reference`` (teacher-forced recomputation under the recorded kept sets, for tests).
"""
from actors.native.engine import NativeEngine

__all__ = ["NativeEngine"]
