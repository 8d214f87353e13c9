"""Issue 14 end to end: ``launch/train.py`` with ``rollout.kv.schedule=dynamic`` re-plans the KV
budgets from the rollout actors' probes (either planner), sends them to the actors (the rows
record them), logs the per-bin probe agreement, and the checkpoint's config carries the schedule
in use (resume and replacement actors start from it)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import SMALL_JOB, train_env

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


# table: the on-policy check on, and a threshold low enough that a re-plan lowers a bin below
# the starting budget (16), so it draws samples under the proposal
@pytest.mark.parametrize("planner,verify,threshold", [("exact", 0, 0.86), ("table", 4, 0.02)])
def test_dynamic_schedule_replans_and_checkpoints(tiny_model, tmp_path, planner, verify,
                                                  threshold):
    args = [f"rollout.model_path={tiny_model}", "run.steps=2", *SMALL_JOB,
            f"rollout.kv.planner={planner}", f"rollout.kv.verify_samples={verify}",
            f"rollout.kv.threshold={threshold}",
            "rollout.num_actors=1", "rollout.kv.schedule=dynamic", "rollout.kv.probe_share=0.25",
            "rollout.kv.replan_every=1", "rollout.kv.bin_tokens=8",
            "rollout.kv.probe_budgets=[8,16,48]", "rollout.kv.objective=memory",
            "run.checkpoint_every=2", f"run.out_dir={tmp_path / 'runs'}"]
    proc = subprocess.run([sys.executable, "launch/train.py", *args], cwd=REPO,
                          env=train_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["schedule/replanned"] == 1
        # exact: a replay at the top budget, then per bin the candidates that can evict there
        assert ("schedule/replays" in r) == (planner == "exact")
        assert r.get("schedule/replays", 2) >= 2
        plan = [r[k] for k in sorted((k for k in r if k.startswith("schedule/budget_bin")),
                                     key=lambda k: int(k.rsplit("bin", 1)[1]))]
        assert plan and all(b in (8, 16, 48) for b in plan)
        assert any(k.startswith("mismatch/agreement_p5/bin") for k in r)
        assert 0.0 <= r["mismatch/probe_agreement_p5_min_bin"] <= 1.0
        assert r["rollout/kv_budget_mean"] > 0
        assert r["schedule/raised_bins"] >= 0
        # the on-policy check: drawn only for a re-plan lowering a bin below the one in use
        assert ("schedule/verify_rounds" in r) == bool(verify)
        if verify and r["schedule/verify_rounds"]:
            assert 0.0 <= r["schedule/verify_tail_min"] <= 1.0
    if verify:      # step 1 lowered the starting 16 somewhere: its samples were drawn
        assert steps[0]["schedule/verify_rounds"] >= 1
    # step 2's rollouts were generated after step 1's re-plan, with its budgets
    first = [steps[0][f"schedule/budget_bin{k}"] for k in range(8) if
             f"schedule/budget_bin{k}" in steps[0]]
    assert min(first) <= steps[1]["rollout/kv_budget_mean"] <= max(first)
    # the checkpoint's config holds the schedule of the last re-plan
    (ckpt,) = (run_dir / "checkpoints").iterdir()
    cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
    assert cfg["rollout"]["kv"]["budgets"] == plan
    # and the bounds raised over the run, as the last step logged them
    floors = {int(k.rsplit("bin", 1)[1]): v for k, v in steps[-1].items()
              if k.startswith("schedule/min_budget_bin")}
    assert {k: b for k, b in enumerate(cfg["rollout"]["kv"]["min_budgets"]) if b} == floors
