"""bench/pipeline.py's pieces that decide what is measured: core layouts and the bar verdicts."""
from __future__ import annotations

import os

from bench.pipeline import bars, core_layouts
from launch.config import load_config


def test_pinned_layout_splits_this_process_cores_and_parses():
    layouts = core_layouts()
    assert layouts["shared"] == []
    if len(os.sched_getaffinity(0)) < 2:
        assert "pinned" not in layouts
        return
    cfg = load_config(layouts["pinned"]).cluster
    assert cfg.rollout_cores and cfg.learner_cores == cfg.scorer_cores
    assert not set(cfg.rollout_cores) & set(cfg.learner_cores)  # disjoint pools
    assert set(cfg.rollout_cores) | set(cfg.learner_cores) == os.sched_getaffinity(0)


def test_bar_verdicts_use_the_issue_thresholds():
    rows = [{"bench": "pipeline", "variant": "pinned/async", "vs_sync": 0.75, "step_s": 3.0},
            {"bench": "pipeline", "variant": "shared/async", "vs_sync": 0.9, "step_s": 1.8},
            {"bench": "pipeline", "variant": "shared/sync", "vs_sync": 1.0, "step_s": 2.0},
            {"bench": "broadcast", "variant": "weight sync, x", "vs_memcpy": 2.5, "vs_clone": 0.9},
            {"bench": "broadcast", "variant": "memcpy (clone: allocates)", "vs_memcpy": 2.7,
             "vs_clone": 1.0}]
    info, *lines = bars(rows)
    assert info.endswith("0.90x")  # fastest async 1.8 s over fastest sync 2.0 s
    assert len(lines) == 3  # two async rows, one weight-sync row; baselines get no verdict
    assert lines[0].endswith("PASS") and lines[1].endswith("fail") and lines[2].endswith("fail")
    assert "2.50x of a copy into an existing tensor" in lines[2]
