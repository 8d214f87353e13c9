"""bench/schedule.py end to end on the small SFT'd test model: rows for every schedule, the
held-out verdicts consistent with the threshold, and the same rows for the sampler with a
DistillSparse adapter trained here (measured against the dense base model)."""
from __future__ import annotations

import json

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
