"""End to end: `python launch/train.py` for a few steps on local Ray with a tiny SFT'd model.

Asserts what the foundation promises: the learner's weights changed, the policy version advanced,
every rollout and scorer actor holds the learner's weights after each broadcast, buffer rows carry
sampler and old log-probs of equal length, and metrics and the HF model were written.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL_JOB, train_env

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch/train.py", *args], cwd=REPO,
                          env=train_env(tmp_path), capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_train_runs_end_to_end(tiny_model, tmp_path, mode):
    steps = 3
    # async runs with the staleness split (launch/configs/async.yaml's keys)
    split = ["rollout.dense_logprobs=true", "correction.staleness.enabled=true"] \
        if mode == "async" else []
    proc = _run([f"run.mode={mode}", f"rollout.model_path={tiny_model}", f"run.steps={steps}",
                 *SMALL_JOB, *split, f"run.out_dir={tmp_path / 'runs'}"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("held-out accuracy: ") and " -> " in last

    (run_dir,) = (tmp_path / "runs").iterdir()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    syncs = [r for r in records if "weights/checksum" in r]
    assert len(syncs) == steps + 1  # the initial broadcast and one per step
    assert all(r["weights/max_rel_diff"] == 0.0 for r in syncs)
    assert syncs[0]["weights/checksum"] != syncs[-1]["weights/checksum"]
    train = [r for r in records if "reward" in r]
    assert [r["version"] for r in train] == list(range(1, steps + 1))
    assert all(r["batch/logprob_lengths_match"] for r in train)
    assert all(r["kept_ratio"] < 1.0 for r in train)  # the R-KV budget really evicted tokens
    # sync trains on samples of the version it holds; async on samples one version behind
    # (generated while the previous step trained), except the very first batch.
    lags = [r["batch/staleness_max"] for r in train]
    assert lags == ([0] * steps if mode == "sync" else [0] + [1] * (steps - 1))
    assert [r["correction/staleness_split"] for r in train] == [float(mode == "async")] * steps
    # the PPO anchor: scored by the scorer at the version the learner trains from
    assert [r["batch/anchor_lag_max"] for r in train] == [0] * steps
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["version"] == steps
    # the rollout KV against a dense cache, per step and as the summary's mean, beside the accuracy
    kv = [r["rollout/kv_vs_dense"] for r in train]
    assert all(0.0 < x < 1.0 for x in kv)
    assert summary["rollout_kv_vs_dense"] == pytest.approx(sum(kv) / steps)
    assert proc.stdout.strip().splitlines()[-2].startswith("rollout KV: ")
    # the correction's shares, step means, in the summary and on the line above the KV
    vetoed = [r["correction/frac_vetoed"] for r in train]
    assert summary["correction_frac_vetoed"] == pytest.approx(sum(vetoed) / steps)
    assert proc.stdout.strip().splitlines()[-3].startswith("correction: ")
    assert (run_dir / "final" / "config.json").is_file()
    assert (run_dir / "config.yaml").is_file()
    # observability: every numeric metric in TensorBoard, the logdir line, no bar off a terminal
    from test_observe import read_scalars

    from launch.observe import scalars
    tb = read_scalars(run_dir / "tensorboard")
    assert set().union(*(scalars(r) for r in records)) == set(tb)
    assert {"rollout/tokens_per_s", "buffer/live_rows", "mismatch/agreement_p5"} <= set(tb)
    assert [s for s, _ in tb["reward"]] == list(range(1, steps + 1))
    assert f"tensorboard --logdir {run_dir}" in proc.stdout
    # (transformers draws its own loading bars in the actors: only ours must stay off)
    assert not re.search(r"(steps|eval heldout): +\d+%", proc.stderr + proc.stdout)
    assert "\r" not in proc.stdout
    assert sum(line.startswith("step=") for line in proc.stdout.splitlines()) == steps


def test_bad_config_stops_before_ray(tmp_path):
    proc = _run(["rollout.kv.polcy=rkv"], tmp_path)
    assert proc.returncode != 0
    assert proc.returncode == 2
    assert "rollout.kv.polcy" in proc.stderr and "policy" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists() and "Ray" not in proc.stdout


def test_missing_model_names_key(tmp_path):
    proc = _run([f"rollout.model_path={tmp_path / 'nope'}"], tmp_path)
    assert proc.returncode == 2 and "rollout.model_path" in proc.stderr and "nope" in proc.stderr


def test_async_rollouts_ahead_stage_weights_and_resume(tiny_model, tmp_path):
    """run.rollouts_ahead=2: two batches in flight while the learner trains. Each batch lags the
    learner by at most 2 versions; every broadcast is staged on the rollout actors and its staged
    checksum equals the learner's (each actor checks its model against that checksum when it swaps
    the weights in, before the rows it tags with that version); a checkpoint lands both in-flight
    batches and a resumed run counts them as in flight and completes. Without a scorer pool
    (``scorer.num_actors=0``, reasoning-quick.yaml's): the rollout actors' dense pass scores every
    row, those landed before the checkpoint too, at its own version (the anchor lags as the
    samples do)."""
    steps = 4
    out = tmp_path / "runs"
    proc = _run(["run.mode=async", "run.rollouts_ahead=2", "buffer.max_staleness=2",
                 f"rollout.model_path={tiny_model}", f"run.steps={steps}", *SMALL_JOB,
                 "scorer.num_actors=0", "rollout.dense_logprobs=true",
                 "run.checkpoint_every=2", "run.checkpoint_keep=0", "run.name=ahead",
                 f"run.out_dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = out.glob("ahead-*")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    syncs = [r for r in records if "weights/checksum" in r]
    assert len(syncs) == steps + 1 and all(r["weights/max_rel_diff"] == 0.0 for r in syncs)
    train = [r for r in records if "reward" in r]
    assert [r["version"] for r in train] == list(range(1, steps + 1))
    assert train[0]["batch/staleness_max"] == 0  # batches 1 and 2 start from version 0's weights
    assert all(0 <= r["batch/staleness_max"] <= 2 for r in train)
    assert [r["batch/anchor_lag_max"] for r in train] == [r["batch/staleness_max"] for r in train]
    assert any(r["batch/anchor_lag_max"] > 0 for r in train)
    # every trained sample is tagged with the version of its actor's weights: within the bound
    for t in (json.loads(x) for x in (run_dir / "trained_samples.jsonl").read_text().splitlines()):
        tags = {int(s.split("-", 1)[0][1:]) for s in t["sample_ids"]}
        assert all(t["step"] - 1 - 2 <= v <= t["step"] - 1 for v in tags), (t["step"], tags)
    state = json.loads((run_dir / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["in_flight"] == 2 and state["next_batch_in_buffer"]
    final = json.loads((run_dir / "checkpoints" / f"step-{steps:06d}" / "trainer_state.json")
                       .read_text())
    assert final["in_flight"] == 0

    resumed = _run([f"resume={run_dir / 'checkpoints' / 'step-000002'}", "run.name=again"],
                   tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    (again,) = out.glob("again-*")
    trained = [json.loads(x) for x in (again / "trained_samples.jsonl").read_text().splitlines()]
    assert [(t["step"], t["version"]) for t in trained] == [(3, 3), (4, 4)]
    # the two landed batches are the ones trained on: the same samples as the first run's
    first = [json.loads(x) for x in (run_dir / "trained_samples.jsonl").read_text().splitlines()]
    assert trained == first[2:]
