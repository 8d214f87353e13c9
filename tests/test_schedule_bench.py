"""bench/schedule.py end to end on the small SFT'd test model: rows for every schedule, the
held-out verdicts consistent with the threshold, and the same rows for the sampler with a
DistillSparse adapter trained here (measured against the dense base model)."""
from __future__ import annotations

import json

import pytest

from bench.schedule import main


def test_schedule_bench_rows(tiny_model, tmp_path):
    out = tmp_path / "s.json"
    rows = main(["--model", str(tiny_model), "--prompts", "3", "--budgets", "12,24,160",
                 "--repeat", "1", "--json", str(out), "--distill-steps", "1",
                 "--distill-budget", "12"])
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    for distill in (False, True):
        assert {r["schedule"] for r in rows if r["distill"] == distill} >= {
            "static", "dynamic-speed", "dynamic-memory"}
    for r in rows:
        assert r["passes"] == (r["agreement_p5_min_bin"] >= 0.86)
        assert 0.0 <= r["agreement_p5_min_bin"] <= r["agreement_mean"] <= 1.0
        assert 0.0 < r["kv_bytes_vs_dense"] <= 1.0 and r["tok_per_s_vs_dense"] > 0
        assert 0.0 < r["kv_slots_vs_dense"] <= 1.0 + 1e-9
        if r["budgets"] == [160]:            # evicts nothing: the dense cache's slots
            assert abs(r["kv_slots_vs_dense"] - 1.0) < 1e-9
        assert all(b in (12, 24, 160) for b in r["budgets"])
        assert min(r["budgets"]) <= r["mean_budget"] <= max(r["budgets"])
    # 160 is above every sequence (prompt + 80 new tokens): nothing is evicted, so the speed plan or the held-out best passes
    assert any(r["passes"] for r in rows)
    assert not any("missing" in r for r in rows)


def test_distill_adapter_trains_under_the_bench_sampler(monkeypatch):
    """The adapter is trained with the policy, compression cadence and prompt rule the rows
    replay (it once always trained under R-KV every 16, whatever ``--policy`` said)."""
    import argparse

    import bench.distill
    from bench.schedule import distill_sampler

    seen = {}

    def fake_train(cfg, problems, steps, log=None):
        seen["kv"], seen["steps"] = cfg.kv, steps
        raise RuntimeError("stop here")

    monkeypatch.setattr(bench.distill, "train_adapter", fake_train)
    a = argparse.Namespace(adapter="", distill_steps=3, distill_budget=40, distill_lr=1e-3,
                           distill_kl_coef=0.001, distill_divergence="k3", model="m",
                           policy="h2o", compress_every=8, protect_prompt=True)

    class Task:
        def problems(self, split):
            return []

    with pytest.raises(RuntimeError, match="stop here"):
        distill_sampler(None, a, Task())
    kv = seen["kv"]
    assert (kv.policy, kv.budget, kv.compress_every, kv.protect_prompt) == ("h2o", 40, 8, True)
    assert seen["steps"] == 3


def test_schedule_bench_on_the_reasoning_task(tiny_model, tmp_path):
    """``--task reasoning``: its prompts and candidate budgets (the tiny model stands in for its
    base; a short response keeps the test quick), the prompt kept."""
    out = tmp_path / "r.json"
    rows = main(["--task", "reasoning", "--model", str(tiny_model), "--prompts", "2",
                 "--max-new-tokens", "24", "--budgets", "12,40,96", "--bin-tokens", "32",
                 "--protect-prompt", "--repeat", "1", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["task"] == "reasoning" and saved["rows"] == json.loads(json.dumps(rows))
    assert {r["schedule"] for r in rows} >= {"static", "dynamic-speed", "dynamic-memory"}
    # a reasoning prompt is ~25 tokens: with 24 new ones every position is in bins 0 and 1
    assert all(set(r["per_bin"]) <= {"0", "1", 0, 1} for r in rows if "per_bin" in r)
    assert all(b in (12, 40, 96) for r in rows if "budgets" in r for b in r["budgets"])


def test_schedule_bench_refuses_training_an_adapter_off_running_sum(capsys):
    with pytest.raises(SystemExit):
        main(["--task", "reasoning", "--distill-steps", "2"])
    assert "--adapter <run>/final/distill_sparse" in capsys.readouterr().err
