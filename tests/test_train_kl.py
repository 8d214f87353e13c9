"""End to end: `launch/train.py` with a KL penalty to the initial policy (k3, kl_coef 0.1).

The scorers hold a frozen copy of the initial model and fill in reference log-probs; the learner's
``loss/kl_ref`` must be finite at every step, ~0 at step 1 (the policy is still the initial one)
and > 0 once the weights moved. A run resumed from a checkpoint must keep the *initial* policy as
reference, not the checkpoint's weights: its first step's KL equals the uninterrupted run's.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL_JOB, train_env

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
KL = ["correction.loss.kl_coef=0.1", "correction.loss.kl_estimator=k3"]


def _run(args: list[str], home: Path) -> None:
    proc = subprocess.run([sys.executable, "launch/train.py", *args], cwd=REPO,
                          env=train_env(home), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _kl(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss/kl_ref"] for r in recs if "reward" in r}


def test_kl_to_the_initial_policy_end_to_end_and_across_resume(tiny_model, tmp_path):
    out = tmp_path / "runs"
    _run([f"rollout.model_path={tiny_model}", "run.steps=3", "run.checkpoint_every=2",
          *SMALL_JOB, *KL, f"run.out_dir={out}", "run.name=kl"], tmp_path)
    (run_dir,) = out.glob("kl-*")
    kl = _kl(run_dir)
    assert sorted(kl) == [1, 2, 3]
    assert all(math.isfinite(v) and v >= 0.0 for v in kl.values())  # k3 is >= 0
    assert kl[1] < 1e-6               # step 1 trains the initial policy: pi_theta == pi_ref
    assert kl[2] > 1e-5 and kl[3] > 1e-5  # measured: 0.0, 2.9e-4, 1.4e-3

    # resume from the step-2 checkpoint: its scorer loads the base model as reference (were it
    # the checkpoint's weights, step 3 would start at pi_theta == pi_ref, a KL of ~0)
    _run([f"resume={run_dir / 'checkpoints' / 'step-000002'}"], tmp_path)
    (resumed,) = [d for d in out.glob("kl-*") if d != run_dir]
    again = _kl(resumed)
    assert sorted(again) == [3]
    assert again[3] == pytest.approx(kl[3], rel=1e-4)
