"""bench/replay.py on the tiny test model: every policy's row, the chunked run agreeing with the
decode loop and taking fewer forwards than it takes steps."""
from __future__ import annotations

import json

from bench import replay


def test_replay_bench_rows_agree_and_chunk(tmp_path, capsys):
    out = tmp_path / "replay.json"
    assert replay.main(["--rows", "3", "--prompt-len", "5", "--response-len", "30", "--budget",
                        "8", "--every", "4", "--repeats", "1", "--threads", "1",
                        "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == list(replay.POLICIES)
    for r in rows:
        assert r["same_kept"] and r["max_dlogp"] < 1e-4
        assert r["steps"] == 29 and r["tokens"] == 90
        assert 1 <= r["chunks"] < r["steps"]
        assert r["stepwise_s"] > 0 and r["chunked_s"] > 0
    by = {r["policy"]: r["chunks"] for r in rows}
    assert by["dense"] == 1                   # nothing compresses: the whole response at once
    assert by["rkv"] == 1 + (29 - 7) // 4 + 1  # to 12 slots, then 4 a chunk, then the rest
    assert "| rkv | 3 | 90 |" in capsys.readouterr().out
