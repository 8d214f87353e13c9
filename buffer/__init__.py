"""Durable Arrow replay buffer: staleness control, PODS down-sampling, crash recovery.

Imports no Ray/DeepSpeed/vLLM; serve it with `ray.remote(ReplayBuffer)` at the call site.
"""
from buffer.config import BufferConfig, PodsConfig, StalePolicy
from buffer.errors import BufferFull, SegmentCorrupt
from buffer.replay import ReplayBuffer
from buffer.schema import LOG_SCHEMA, SCHEMA, State

__all__ = ["BufferConfig", "PodsConfig", "StalePolicy", "BufferFull", "SegmentCorrupt",
           "ReplayBuffer", "SCHEMA", "LOG_SCHEMA", "State"]
