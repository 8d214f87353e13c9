"""Rollout engine interface (docs/INTERFACES.md, "Rollout engine"): the protocol and its data types.

It imports neither engine: ``actors/native`` and ``actors/vllm`` implement it, and the factory that
picks one by ``rollout.engine`` is ``actors.rollout.make_engine``, beside the actor that builds it.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy (log-probs are then of softmax(logits)).

    ``logprob_mode="processed"`` records log-probs of the distribution actually sampled from (after
    temperature, top-k and top-p); ``"raw"`` records ``log_softmax(logits / temperature)``.

    ``stop``: stop strings, searched in the decoded response (special tokens skipped). The response
    ends with the token that completed the string and ``finish_reason`` is "stop", exactly as for a
    stop token: ``response_ids`` and ``logprobs`` always have the same length, and the text after
    the stop string inside that last token (if any) stays. Engines need the model's tokenizer.
    """
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprob_mode: str = "processed"


@dataclass
class GenerationOutput:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str            # "stop" (a stop token / the token completing a stop string was
                                  # generated, and is included) | "length"
    kept_ratio: float             # mean over decode steps of kept / seen tokens (1.0 for dense)
    peak_kv_bytes: int            # most KV bytes stored for this sequence (all layers, K and V)
    trace: list = field(default_factory=list, repr=False)  # compression events when traced
    # budget in force in each position bin the sequence reached (rollout.kv.bin_tokens; native
    # compressing engine only, else empty)
    bin_budgets: list = field(default_factory=list)


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def state_checksum(self) -> float: ...

    def weight_sums(self) -> dict[str, float]: ...   # sum(|w|) per HF name (checksum's terms)

    # K and V bytes of one token over all layers: a dense cache of n tokens holds n times this
    def kv_bytes_per_token(self) -> int: ...

