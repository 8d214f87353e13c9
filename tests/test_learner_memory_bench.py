"""bench/learner_memory.py end to end on a small vocabulary: both implementations run in their own
process, report the JSON columns the issue names, and compute the same loss."""
from __future__ import annotations

import json

import pytest

from bench.learner_memory import COLUMNS, main


@pytest.mark.slow
def test_bench_rows_and_same_loss(tmp_path, capsys):
    out = tmp_path / "lm.json"
    rows = main(["--vocab", "2048", "--resp-lens", "64,256", "--prompt-len", "16",
                 "--chunk", "32", "--json", str(out)])
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    assert [(r["impl"], r["resp_len"]) for r in rows] == \
        [("naive", 64), ("ours", 64), ("naive", 256), ("ours", 256)]
    assert all(set(COLUMNS) <= set(r) and r["peak_bytes"] > r["base_bytes"] > 0 for r in rows)
    for a, b in zip(rows[::2], rows[1::2]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
    assert "bar: ours <= 0.25x naive peak at 256 tokens" in capsys.readouterr().out
