"""Math answer verification for real datasets, through the maintained ``math-verify`` library.

The gold answer is parsed as if boxed (labels are bare LaTeX such as ``\\frac{1}{2}`` or ``118``); the
response is parsed the library's way: the last ``\\boxed{}`` first, else the last number or
expression. Equivalent forms (0.5 vs 1/2, 1,000 vs 1000, tuples, intervals) count as correct.
"""
from __future__ import annotations

import logging
import re
import threading
from contextlib import contextmanager

from tasks.base import RewardTimeout

_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)


def gsm8k_answer(solution: str) -> str | None:
    """The N of a GSM8K solution ending in ``#### N`` (commas dropped), or None when absent."""
    m = _GSM8K_ANSWER.search(solution)
    if not m:
        return None
    ans = m.group(1).strip().replace(",", "")
    return ans or None


MATH_VERIFY_TIMEOUT_S = 5   # math-verify's own limit per parse / comparison (whole seconds)


def _timeout() -> int | None:
    # math-verify times out with signal.alarm, which only works in the main thread; Ray may call
    # rewards from another thread, where a timeout would raise instead of protecting us. (The
    # reward runner, tasks/rewards.py, calls it in its child process's main thread.)
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


class _TimeoutsSeen(logging.Handler):
    """math-verify reports its own timeouts only as a warning (and a 0 reward): catch them, so
    they are counted like the runner's timeouts instead of passing for wrong answers."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Timeout during"):
            self.seen.append(record.getMessage()[:80])


@contextmanager
def _math_verify_timeouts():
    handler, log = _TimeoutsSeen(), logging.getLogger("math_verify")
    log.addHandler(handler)
    try:
        yield handler.seen
    finally:
        log.removeHandler(handler)


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer is mathematically equal to ``answer``, else 0.0;
    ``RewardTimeout`` when math-verify's own limit cut a parse or comparison short."""
    # Imported here: math-verify pulls in sympy (~0.5 s), which synthetic-only runs never need.
    from math_verify import parse, verify

    if not response.strip():
        return 0.0
    t = _timeout()
    with _math_verify_timeouts() as timeouts:
        gold = parse("\\boxed{" + answer + "}", parsing_timeout=t)
        pred = parse(response, parsing_timeout=t)
        ok = bool(gold and pred) and verify(gold, pred, timeout_seconds=t)
    if timeouts:
        raise RewardTimeout(f"math-verify: {timeouts[0]}")
    return 1.0 if ok else 0.0
