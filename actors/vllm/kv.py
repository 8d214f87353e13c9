"""KV policies on vLLM: which ones map onto vLLM's KV manager, and KV accounting per sequence.

* ``dense``: vLLM's paged cache as is.
* ``streaming``: vLLM's sliding-window attention, switched on through ``hf_overrides`` (every layer
  a ``sliding_attention`` layer with ``sliding_window = rollout.kv.budget``). vLLM's sliding-window KV
  manager then frees every block that falls entirely outside the window, so the memory held per
  sequence is bounded by about ``budget + block_size`` tokens. Differences from the native
  ``streaming`` policy (docs/VLLM.md): no attention sinks (``rollout.kv.sink_tokens`` is ignored:
  vLLM's window has none), the window slides every token instead of every ``compress_every`` steps,
  and the prompt's own prefill is windowed too (the native engine prefills densely, then compresses).
  Both keep absolute RoPE positions (no renumbering inside the window).
* ``h2o``, ``snapkv``, ``rkv``: not available (``ConfigError`` naming ``rollout.kv.policy``). They
  choose tokens by attention scores; vLLM's fused attention kernels return no scores, and which blocks
  a request holds is decided by the scheduler's KV manager, which an attention-backend plugin cannot
  change, so a plugin could mask tokens but never free their memory. See docs/VLLM.md.
"""
from __future__ import annotations

from actors.config import KVConfig, KVPolicy
from common.errors import ConfigError

SUPPORTED = (KVPolicy("dense"), KVPolicy("streaming"))


def policy_of(kv: KVConfig) -> KVPolicy:
    return KVPolicy(getattr(kv.policy, "value", kv.policy))


def check_policy(kv: KVConfig, prefix: str = "rollout.kv") -> KVPolicy:
    """The policy, or ConfigError if vLLM cannot run it."""
    policy = policy_of(kv)
    if policy not in SUPPORTED:
        raise ConfigError(
            f"{prefix}.policy", policy.value,
            "'dense' or 'streaming' with rollout.engine=vllm (vLLM has no score-based KV eviction: "
            "h2o, snapkv and rkv need rollout.engine=native; see docs/VLLM.md)")
    return policy


def window_of(kv: KVConfig) -> int | None:
    """Sliding-window length in tokens (None for dense)."""
    return int(kv.budget) if check_policy(kv) == KVPolicy("streaming") else None


def hf_overrides(kv: KVConfig, num_layers: int) -> dict:
    """``LLM(hf_overrides=...)`` turning every layer into a sliding-window layer for ``streaming``."""
    window = window_of(kv)
    if window is None:
        return {}
    return {"use_sliding_window": True, "sliding_window": window, "max_window_layers": 0,
            "layer_types": ["sliding_attention"] * num_layers}


def kept_ratio(prompt_len: int, response_len: int, window: int | None) -> float:
    """Mean over forward passes of kept / seen keys, counted as the native engine does.

    The prefill that samples the first token counts 1.0; decode step k (k = 1..R-1) attends
    ``min(window, L + k)`` of the ``L + k`` keys a dense model would attend.
    """
    if window is None or response_len == 0:
        return 1.0
    total = 1.0 + sum(min(window, prompt_len + k) / (prompt_len + k) for k in range(1, response_len))
    return total / response_len


class KVMeter:
    """Counts, right after every scheduling step (blocks for that step allocated, blocks that left
    the sliding window freed), the KV blocks each running request holds in vLLM's KV manager. Null
    blocks (placeholders for freed ones) are not counted. Keeps per-request and summed peaks."""

    def __init__(self, llm):
        core = llm.llm_engine.engine_core.engine_core        # in-process EngineCore
        self.scheduler = core.scheduler
        self.managers = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        groups = self.scheduler.kv_cache_config.kv_cache_groups
        # page_size_bytes: one block of one layer, K and V together
        self.group_block_bytes = [g.kv_cache_spec.page_size_bytes * len(g.layer_names)
                                  for g in groups]
        self.block_size = groups[0].kv_cache_spec.block_size
        self.num_blocks = self.scheduler.kv_cache_config.num_blocks
        self.reset()
        schedule = self.scheduler.schedule

        def schedule_and_count(*args, **kwargs):
            out = schedule(*args, **kwargs)
            self.sample(list(self.scheduler.running))
            return out

        self.scheduler.schedule = schedule_and_count

    def reset(self) -> None:
        self.peak: dict[str, int] = {}
        self.peak_total = 0
        self.concurrent = 0      # most requests running (holding KV) after one scheduling step

    def request_bytes(self, req_id: str) -> int:
        total = 0
        for mgr, block_bytes in zip(self.managers, self.group_block_bytes):
            held = sum(1 for b in mgr.req_to_blocks.get(req_id, ()) if not b.is_null)
            total += held * block_bytes
        return total

    def sample(self, requests) -> None:
        self.concurrent = max(self.concurrent, len(requests))
        step_total = 0
        for req in requests:
            rid = req.request_id
            b = self.request_bytes(rid)
            step_total += b
            if b > self.peak.get(rid, 0):
                self.peak[rid] = b
        self.peak_total = max(self.peak_total, step_total)

    def bytes_per_token(self) -> float:
        return sum(self.group_block_bytes) / self.block_size

    def pool_bytes(self) -> int:
        """Bytes of the whole preallocated KV pool (all blocks; groups share the pool's blocks)."""
        return self.num_blocks * max(self.group_block_bytes)
