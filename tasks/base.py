"""The task interface: problems with verifiable answers and a reward function."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Problem:
    idx: int          # stable index within its split (data position for resume)
    prompt: str       # text given to the model
    answer: str       # ground truth the reward compares against


class RewardTimeout(Exception):
    """A reward computation ran out of time inside the reward function itself (math-verify's own
    limit): counted as a reward timeout, like a call the runner's per-call timeout stopped."""


class Task(Protocol):
    name: str

    def problems(self, split: str) -> list[Problem]:
        """Problems of a split: "train" or "heldout"."""

    def reward(self, response: str, answer: str) -> float:
        """1.0 for a correct final answer, else 0.0 (exact match / math verification). May
        raise (counted as a reward error) or ``RewardTimeout``; ``tasks.rewards`` runs it."""
