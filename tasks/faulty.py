"""Reward functions that fail on purpose, for fault-injection runs and tests
(``task.reward_fn=tasks.faulty:<name>``). Which samples fail is a function of the response
text only (a stable hash), so a run fails the same samples every time."""
from __future__ import annotations

import time
import zlib

from tasks.synthetic import exact_match_reward


def _bucket(response: str) -> int:
    return zlib.crc32(response.encode()) % 8


def nan_reward(response: str, answer: str) -> float:
    """Always NaN: every batch is poisoned (the driver skips it; after
    ``run.max_consecutive_skips`` the run stops)."""
    return float("nan")


def raises(response: str, answer: str) -> float:
    raise RuntimeError(f"injected reward failure on {response[:20]!r}")


def hangs(response: str, answer: str) -> float:
    time.sleep(3600)
    return 0.0


def flaky(response: str, answer: str) -> float:
    """The synthetic tasks' exact-match reward, except that one response in eight raises and
    one in eight hangs (by a hash of the response)."""
    b = _bucket(response)
    if b == 0:
        return raises(response, answer)
    if b == 1:
        return hangs(response, answer)
    return exact_match_reward(response, answer)


def dies(response: str, answer: str) -> float:
    """Ends the process computing it (a crash in native code looks the same)."""
    import os

    os._exit(3)
