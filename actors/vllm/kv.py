"""KV policies on vLLM: which mechanism runs each, and KV accounting per sequence.

* ``dense``: vLLM's paged cache as is.
* ``streaming``: vLLM's sliding-window attention, switched on through ``hf_overrides`` (every layer
  a ``sliding_attention`` layer with ``sliding_window = rollout.kv.budget``). vLLM's sliding-window KV
  manager then frees every block that falls entirely outside the window, so the memory held per
  sequence is bounded by about ``budget + block_size`` tokens. Differences from the native
  ``streaming`` policy (docs/VLLM.md): no attention sinks (``rollout.kv.sink_tokens`` is ignored:
  vLLM's window has none), the window slides every token instead of every ``compress_every`` steps,
  and the prompt's own prefill is windowed too (the native engine prefills densely, then compresses).
  Both keep absolute RoPE positions (no renumbering inside the window).
* ``h2o``, ``snapkv``, ``rkv``: score-based eviction (``actors/vllm/evict``): every
  ``compress_every`` decode steps a request's cache is scored by the native engine's policy code,
  compacted in place to ``budget`` slots per layer and KV head, and the blocks it no longer needs
  go back to vLLM's block pool. Same rule, budgets and kept sets as the native engine.
"""
from __future__ import annotations

from actors.config import KVConfig, KVPolicy
from common.errors import ConfigError

SUPPORTED = tuple(KVPolicy)
EVICTING = (KVPolicy("h2o"), KVPolicy("snapkv"), KVPolicy("rkv"))   # through actors/vllm/evict


def policy_of(kv: KVConfig) -> KVPolicy:
    return KVPolicy(getattr(kv.policy, "value", kv.policy))


def check_policy(kv: KVConfig, prefix: str = "rollout.kv") -> KVPolicy:
    """The policy, or ConfigError if vLLM cannot run it."""
    policy = policy_of(kv)
    if policy not in SUPPORTED:
        raise ConfigError(f"{prefix}.policy", policy.value,
                          f"one of {[p.value for p in SUPPORTED]} with rollout.engine=vllm")
    return policy


def evicting(kv: KVConfig) -> bool:
    """Whether the policy runs through score-based eviction (``actors/vllm/evict``)."""
    return check_policy(kv) in EVICTING


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


def evicted_kept_ratio(prompt_len: int, response_len: int, kv: KVConfig) -> float:
    """``kept_ratio`` of an evicting policy, counted as the native engine counts it: the prefill
    1.0, the decode step writing position t attends ``length(t) + 1`` of ``t + 1`` keys
    (``evict.rule``: the same compactions the runner made)."""
    from actors.vllm.evict.rule import BudgetTable, CacheLength

    if response_len == 0:
        return 1.0
    cache = CacheLength(BudgetTable(kv), prompt_len)
    total = 1.0
    for t in range(prompt_len, prompt_len + response_len - 1):
        total += (cache.at(t).length + 1) / (t + 1)
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
        preempt = self.scheduler._preempt_request

        def preempt_and_count(*args, **kwargs):
            self.preemptions += 1
            return preempt(*args, **kwargs)

        self.scheduler._preempt_request = preempt_and_count

    def reset(self) -> None:
        self.peak: dict[str, int] = {}
        self.peak_total = 0
        self.max_concurrent = 0  # most requests running (holding KV) after one scheduling step
        # requests running per step while others wait (the pool, not the demand, is the limit):
        # how many requests the pool keeps going; all steps when none ever waited
        self.running = {"saturated": [0, 0], "all": [0, 0]}   # [steps, sum of running]
        self.preemptions = 0     # requests vLLM preempted (blocks freed, recomputed later)

    @property
    def concurrent(self) -> float:
        """Mean requests running per scheduling step while requests wait (else over all steps
        with a running request)."""
        steps, total = self.running["saturated"]
        if not steps:
            steps, total = self.running["all"]
        return total / steps if steps else 0.0

    def request_bytes(self, req_id: str) -> int:
        total = 0
        for mgr, block_bytes in zip(self.managers, self.group_block_bytes):
            held = sum(1 for b in mgr.req_to_blocks.get(req_id, ()) if not b.is_null)
            total += held * block_bytes
        return total

    def sample(self, requests) -> None:
        self.max_concurrent = max(self.max_concurrent, len(requests))
        if requests:
            kinds = ("all", "saturated") if len(self.scheduler.waiting) else ("all",)
            for kind in kinds:
                self.running[kind][0] += 1
                self.running[kind][1] += len(requests)
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
