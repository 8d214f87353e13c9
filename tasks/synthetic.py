"""Synthetic verifiable tasks whose answers need long generations that look far back.

Both tasks are generated deterministically from a seed. Their worked responses are long and every
step depends on a token of the prompt, which drifts further back as the response grows: a KV cache
that evicts old tokens (sliding window, H2O, ...) loses exactly what later steps need.

running_sum  prompt ``sum a3b1c4d1e5\\n``, response ``a3b4c8d9e14=14``: after each letter the model
             looks up that letter's digit in the prompt and adds it to the partial sum it just wrote.
reverse      prompt ``rev 31415\\n``, response ``51413``.

The final answer is the text after the last ``=`` (the whole response when there is none); the reward
is 1.0 for an exact match with the gold answer, else 0.0.
"""
from __future__ import annotations

import random
import string
import zlib

from tasks.base import Problem

LETTERS = string.ascii_lowercase
# One problem in HELDOUT_MOD goes to the held-out class (by a stable hash of its prompt), so the
# two splits are disjoint by construction and the train set does not move when n_heldout changes.
HELDOUT_MOD = 8
SPLITS = ("train", "heldout")


def final_answer(response: str) -> str:
    """The text after the last '=' (stripped), or the whole stripped response without one."""
    tail = response.rsplit("=", 1)[-1]
    return tail.strip()


def exact_match_reward(response: str, answer: str) -> float:
    """1.0 when the final answer equals the gold answer exactly (after stripping spaces)."""
    return 1.0 if final_answer(response) == answer.strip() else 0.0


def _split_of(prompt: str) -> str:
    return "heldout" if zlib.crc32(prompt.encode()) % HELDOUT_MOD == 0 else "train"


class SyntheticTask:
    """Base class: subclasses define ``_make_prompt(rng)`` and ``solution(prompt)``."""

    name = "synthetic"

    def __init__(self, seed: int = 0, n_train: int = 4096, n_heldout: int = 256,
                 min_terms: int = 8, max_terms: int = 16, max_digit: int = 9):
        self.seed, self.min_terms, self.max_terms, self.max_digit = seed, min_terms, max_terms, max_digit
        self._sizes = {"train": n_train, "heldout": n_heldout}
        self._cache: dict[str, list[Problem]] = {}

    # -- the Task protocol -------------------------------------------------------------------
    def problems(self, split: str) -> list[Problem]:
        """The problems of ``split`` ("train" or "heldout"), the same list for the same seed."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if split not in self._cache:
            self._cache[split] = self._generate(split, self._sizes[split])
        return self._cache[split]

    def reward(self, response: str, answer: str) -> float:
        return exact_match_reward(response, answer)

    # -- generation ---------------------------------------------------------------------------
    def _generate(self, split: str, n: int) -> list[Problem]:
        # A separate stream per split: string seeds hash deterministically (not PYTHONHASHSEED).
        rng = random.Random(f"{self.name}:{self.seed}:{split}")
        seen: set[str] = set()
        out: list[Problem] = []
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 50 * n + 1000:
                raise ValueError(f"{self.name}: only {len(out)} distinct {split} problems exist for "
                                 f"terms {self.min_terms}..{self.max_terms}; lower n_{split}")
            prompt = self._make_prompt(rng)
            if prompt in seen or _split_of(prompt) != split:
                continue
            seen.add(prompt)
            out.append(Problem(idx=len(out), prompt=prompt, answer=final_answer(self.solution(prompt))))
        return out

    def _n_terms(self, rng: random.Random) -> int:
        return rng.randint(self.min_terms, self.max_terms)

    def _make_prompt(self, rng: random.Random) -> str:
        raise NotImplementedError

    def solution(self, prompt: str) -> str:
        """The reference worked response for ``prompt`` (what SFT trains on), without EOS."""
        raise NotImplementedError


class RunningSumTask(SyntheticTask):
    """Write the running sum of a labelled digit list step by step, then ``=total``."""

    name = "running_sum"

    def _make_prompt(self, rng: random.Random) -> str:
        n = self._n_terms(rng)
        digits = [rng.randint(1, self.max_digit) for _ in range(n)]
        return "sum " + "".join(f"{LETTERS[i]}{d}" for i, d in enumerate(digits)) + "\n"

    @staticmethod
    def solution(prompt: str) -> str:
        body = prompt.strip().split(" ", 1)[1]
        total, steps = 0, []
        for i in range(0, len(body), 2):
            total += int(body[i + 1])
            steps.append(f"{body[i]}{total}")
        return "".join(steps) + f"={total}"


class ReverseTask(SyntheticTask):
    """Write a digit string backwards (the last output digit needs the first prompt digit)."""

    name = "reverse"

    def _make_prompt(self, rng: random.Random) -> str:
        n = self._n_terms(rng)
        return "rev " + "".join(str(rng.randint(0, 9)) for _ in range(n)) + "\n"

    @staticmethod
    def solution(prompt: str) -> str:
        return prompt.strip().split(" ", 1)[1][::-1]
