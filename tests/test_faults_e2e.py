"""End to end (launch/train.py on the tiny model): a reward that always returns NaN poisons every
batch, each is skipped and the run stops after run.max_consecutive_skips with exit 3 and an error
naming the cause and samples; rewards that raise or hang are counted and the run completes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL_JOB, train_env

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _run(args, tmp_path):
    return subprocess.run([sys.executable, "launch/train.py", *args], cwd=REPO,
                          env=train_env(tmp_path), capture_output=True, text=True, timeout=600)


def test_nan_rewards_skip_every_batch_then_stop(tiny_model, tmp_path):
    out = tmp_path / "runs"
    proc = _run([f"rollout.model_path={tiny_model}", "run.steps=5", *SMALL_JOB,
                 "task.reward_fn=tasks.faulty:nan_reward", "run.max_consecutive_skips=2",
                 "run.checkpoint_every=1", f"run.out_dir={out}"], tmp_path)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    (err,) = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert err.startswith("error: 2 consecutive training steps skipped") and \
        "non-finite rewards" in err and "-s0" in err
    assert proc.stdout.count("[faults] step") == 2 and "batch skipped" in proc.stdout
    (run_dir,) = out.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["faults/skipped_steps"] == 2 and summary["faults/skipped/rewards"] == 2
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "faults/step_skipped" in r]
    assert [r["faults/skipped_steps"] for r in steps] == [1]  # the 2nd stopped before its record
    assert steps[0]["version"] == 0 and "loss" not in steps[0]  # nothing trained
    # the checkpoint after the skipped step 1 holds the untouched initial weights
    assert json.loads((run_dir / "checkpoints" / "step-000001" / "trainer_state.json")
                      .read_text())["version"] == 0
    events = [json.loads(x) for x in (run_dir / "faults.jsonl").read_text().splitlines()]
    assert len(events) == 2 and all(len(e["sample_ids"]) == 16 for e in events)


def test_raising_and_hanging_rewards_are_counted_and_the_run_goes_on(tiny_model, tmp_path):
    out = tmp_path / "runs"
    proc = _run([f"rollout.model_path={tiny_model}", "run.steps=2", *SMALL_JOB,
                 "task.reward_fn=tasks.faulty:flaky", "task.reward_timeout_s=0.5",
                 "rollout.max_new_tokens=8", f"run.out_dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["faults/reward_errors"] > 0 and summary["faults/reward_timeouts"] > 0
    assert summary["faults/skipped_steps"] == 0 and summary["version"] == 2
    assert "reward timeouts (reward 0): timeout" in proc.stdout
    assert "reward errors (reward 0): error: RuntimeError: injected" in proc.stdout
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "faults/reward_errors" in r][-1]
    assert last["faults/reward_errors"] == summary["faults/reward_errors"]
