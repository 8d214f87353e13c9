"""Reward functions that raise, hang, die or return NaN (tasks/rewards.py): the sample gets
reward 0 and a fault mark, the rest of the batch is scored, a hang is really stopped; math-verify's
own timeouts are counted the same way; the guarded path stays cheap on the default task."""
from __future__ import annotations

import math
import time

import pytest

from common.errors import ConfigError
from tasks import TaskConfig, make_task
from tasks.faulty import _bucket
from tasks.rewards import TIMEOUT, RewardRunner, is_error


def _responses(n: int, bucket: int) -> list[str]:
    """``n`` responses whose ``tasks.faulty`` bucket is ``bucket`` (0 raises, 1 hangs)."""
    out, i = [], 0
    while len(out) < n:
        if _bucket(f"r{i}=5") == bucket:
            out.append(f"r{i}=5")
        i += 1
    return out


def test_raising_and_hanging_rewards_cost_only_their_sample():
    runner = RewardRunner(TaskConfig(reward_fn="tasks.faulty:flaky"), timeout_s=0.5)
    good, bad, hung = _responses(3, 3), _responses(2, 0), _responses(2, 1)
    pairs = [(good[0], "5"), (bad[0], "5"), (hung[0], "5"), (good[1], "5"), (hung[1], "5"),
             (bad[1], "5"), (good[2], "4")]
    t0 = time.monotonic()
    got = runner.score(pairs)
    elapsed = time.monotonic() - t0
    assert [r for r, _ in got] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    faults = [f for _, f in got]
    assert faults[0] is None and faults[3] is None and faults[6] is None
    assert faults[2] == faults[4] == TIMEOUT
    assert is_error(faults[1]) and "RuntimeError: injected reward failure" in faults[1]
    assert runner.restarts == 2            # each hang killed its child, which was started again
    # two timeouts of 0.5 s plus two child restarts: seconds, not the hang (a loaded machine may
    # take several seconds per restart, so the bound only rules out waiting on the hung call)
    assert 1.0 <= elapsed < 60.0
    assert runner.score([(good[0], "5")]) == [(1.0, None)]  # the runner goes on
    runner.close()


def test_nan_passes_through_and_in_process_mode_catches_errors():
    nan = RewardRunner(TaskConfig(reward_fn="tasks.faulty:nan_reward"), timeout_s=0)
    (r, f), = nan.score([("x", "1")])
    assert math.isnan(r) and f is None      # the batch screening skips it, not the runner
    raising = RewardRunner(TaskConfig(reward_fn="tasks.faulty:raises"), timeout_s=0)
    assert is_error(raising.score([("x", "1")])[0][1])


def test_a_dying_reward_process_is_an_error_and_restarted():
    runner = RewardRunner(TaskConfig(reward_fn="tasks.faulty:dies"), timeout_s=5.0)
    got = runner.score([("x", "1"), ("y", "1")])
    assert [r for r, _ in got] == [0.0, 0.0] and all("died (exit code 3)" in f for _, f in got)
    assert runner.restarts == 2
    runner.close()


def test_math_verify_timeouts_count_as_timeouts(monkeypatch):
    """math-verify's own signal-based limit (in the child's main thread) reports a timeout only
    as a warning; the reward turns it into a counted timeout."""
    import math_verify.parser

    import tasks.verify as verify

    monkeypatch.setattr(verify, "MATH_VERIFY_TIMEOUT_S", 1)
    monkeypatch.setattr(math_verify.parser, "extract_target_from_pred",
                        lambda *a, **k: time.sleep(3) or [])
    from tasks.rewards import call

    assert call(verify.math_reward, "\\boxed{2}", "2") == (0.0, TIMEOUT)
    monkeypatch.undo()
    assert call(verify.math_reward, "\\boxed{2}", "2") == (1.0, None)


def test_reward_fn_key_is_checked():
    with pytest.raises(ConfigError, match="task.reward_fn"):
        TaskConfig(reward_fn="no colon").validate()
    with pytest.raises(ConfigError, match="task.reward_fn.*importable"):
        make_task(TaskConfig(reward_fn="tasks.faulty:missing"))
    with pytest.raises(ConfigError, match="task.reward_timeout_s"):
        TaskConfig(reward_timeout_s=-1).validate()


def test_guarded_rewards_stay_cheap_on_the_default_task():
    """A batch of the default job (16 prompts x 4 samples) through the child process against the
    same calls in-process: the guard adds one round trip per batch and a little per sample."""
    cfg = TaskConfig()
    task = make_task(cfg)
    probs = task.problems("train")[:16]
    pairs = [(p.answer if k % 2 else "0", p.answer) for p in probs for k in range(4)]
    guarded, plain = RewardRunner(cfg, timeout_s=30), RewardRunner(cfg, timeout_s=0)
    guarded.score(pairs[:1])  # start-up, once per actor
    t0 = time.perf_counter()
    for _ in range(20):
        got = guarded.score(pairs)
    t_guarded = (time.perf_counter() - t0) / 20
    t0 = time.perf_counter()
    for _ in range(20):
        want = plain.score(pairs)
    t_plain = (time.perf_counter() - t0) / 20
    assert got == want and sum(r for r, _ in got) == 32
    print(f"\nrewards of 64 samples: guarded {t_guarded * 1e3:.2f} ms, in-process "
          f"{t_plain * 1e3:.3f} ms per batch")
    assert t_guarded < 0.05   # tens of microseconds per sample: nothing beside generation
    guarded.close()
