"""What vLLM accepts, as plain values: read by ``actors.config`` to refuse a config at load (not
minutes later in an actor) and by the engine. Imports nothing of ``actors`` (the config imports
it, so it must not import the config back) and never vLLM itself."""
from __future__ import annotations

from common.errors import ConfigError

# vLLM's allowed ``max_lora_rank`` values (vllm.config.lora.MaxLoRARanks)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_slots(rank: int, key: str = "rollout.distill_sparse.rank") -> int:
    """The smallest ``max_lora_rank`` vLLM allows that holds an adapter of ``rank`` (vLLM pads
    a smaller adapter into its slots), or ConfigError naming ``key``."""
    slots = next((r for r in LORA_RANKS if r >= int(rank)), 0)
    if not slots:
        raise ConfigError(key, rank, f"<= {LORA_RANKS[-1]} with rollout.engine=vllm (vLLM's "
                                     "largest LoRA rank)")
    return slots
