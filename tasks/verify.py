"""Math answer verification for real datasets, through the maintained ``math-verify`` library.

The gold answer is parsed as if boxed (labels are bare LaTeX such as ``\\frac{1}{2}`` or ``118``); the
response is parsed the library's way: the last ``\\boxed{}`` first, else the last number or
expression. Equivalent forms (0.5 vs 1/2, 1,000 vs 1000, tuples, intervals) count as correct.
"""
from __future__ import annotations

import re
import threading

_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)


def gsm8k_answer(solution: str) -> str | None:
    """The N of a GSM8K solution ending in ``#### N`` (commas dropped), or None when absent."""
    m = _GSM8K_ANSWER.search(solution)
    if not m:
        return None
    ans = m.group(1).strip().replace(",", "")
    return ans or None


def _timeout() -> int | None:
    # math-verify times out with signal.alarm, which only works in the main thread; Ray may call
    # rewards from another thread, where a timeout would raise instead of protecting us.
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer is mathematically equal to ``answer``, else 0.0."""
    # Imported here: math-verify pulls in sympy (~0.5 s), which synthetic-only runs never need.
    from math_verify import parse, verify

    if not response.strip():
        return 0.0
    t = _timeout()
    gold = parse("\\boxed{" + answer + "}", parsing_timeout=t)
    pred = parse(response, parsing_timeout=t)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=t) else 0.0
