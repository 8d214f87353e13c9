"""bench/rollout_gpu.py (issue 27 items 6 and 8): ``bench/rollout.py --shape`` runs the GPU bench's
code path on the CPU with a shrunk shape: every row kind, ratios against the dense row of the same
run, the equal-memory batch, JSON rows, the bars (MISSING, never PASS, for rows not finished), the
per-row time cap; the public shapes build to the published parameter counts."""
from __future__ import annotations

import json
import time

import pytest
import torch

from bench import rollout, rollout_gpu as rg

TINY = ("hidden_size=64,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,"
        "intermediate_size=128,vocab_size=512")
# prompt 8 + 48 tokens dense = 56 slots a row; sparse budget 16 + N 8 = 24: 2 * 56 // 24 = 4 rows
SMALL = ["--shape", "qwen2.5-0.5b", "--override", TINY, "--dtype", "float32", "--prompt-len", "8",
         "--gen-len", "48", "--batch", "2", "--budget", "16", "--every", "8",
         "--equal-gen-len", "32", "--hf-gen-len", "16"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "rows.json"
    rows = rollout.main(SMALL + ["--json", str(out)])   # through bench/rollout.py's dispatch
    return rows, json.loads(out.read_text())


def test_rows_and_ratios_against_the_same_runs_dense(run):
    rows, saved = run
    assert [r["status"] for r in saved] == ["ok"] * len(saved)
    assert set(saved[0]) == set(rg.FIELDS) and saved[0]["device"] == "cpu"
    kinds = {(r["engine"], r["policy"], r["memory_matched"], r["gen_len"]) for r in saved}
    for pol in rg.POLICIES:
        assert ("native", pol, False, 48) in kinds and ("native", pol, True, 32) in kinds
    assert {("native", "dense", False, 48), ("native", "dense", False, 16),
            ("hf-static", "dense", False, 16)} <= kinds
    assert len(saved) == 1 + 4 + 4 + 2
    dense = {r["gen_len"]: r for r in saved if r["policy"] == "dense" and r["engine"] == "native"}
    for r in saved:
        ref = dense[16] if r["engine"] == "hf-static" or r["gen_len"] == 16 else dense[48]
        assert (r["dense_batch"], r["dense_gen_len"]) == (2, ref["gen_len"])
        assert r["speed_vs_dense"] == pytest.approx(r["tok_per_s"] / ref["tok_per_s"])
        assert r["kv_vs_dense"] == pytest.approx(r["allocated_kv_bytes"] / ref["allocated_kv_bytes"])
        assert r["tok_per_s"] > 0 and r["peak_cuda_bytes"] is None   # CPU: no CUDA peak
    for r in saved:
        if r["memory_matched"]:   # the largest batch whose KV fits in dense's at batch 2 x 48
            assert r["batch"] == 4 and r["allocated_kv_bytes"] <= dense[48]["allocated_kv_bytes"]
            assert r["kv_vs_dense"] == pytest.approx(4 * 24 / (2 * 56))
        elif r["engine"] == "native" and r["policy"] != "dense":
            assert r["kv_vs_dense"] == pytest.approx(24 / 56)
    hf = next(r for r in saved if r["engine"] == "hf-static")
    assert hf["allocated_kv_bytes"] == dense[16]["allocated_kv_bytes"]   # same static length
    assert saved == json.loads(json.dumps([{k: r.get(k) for k in rg.FIELDS} for r in rows]))


def test_bars_judge_this_runs_rows_and_name_the_settings(run, capsys):
    rows, _ = run
    args = rg.parse(SMALL)
    found = rg.bars(rows, args)
    assert len(found) == 5 and all(ok is not None for _, ok in found)
    assert not found[0][1]          # a 0.1M-parameter model on a shared CPU: not 12,000 tok/s
    dense = next(r for r in rows if r["policy"] == "dense" and r["gen_len"] == 48)
    snap = next(r for r in rows if r["policy"] == "snapkv" and not r["memory_matched"])
    assert f"{snap['tok_per_s'] / dense['tok_per_s']:.2f}x (>= 1.3x)" in found[1][0]
    assert "equal KV memory (batch 4 x 32 tokens)" in found[3][0]
    rg.print_bars(rows, args)
    text = capsys.readouterr().out
    assert "not the paper's settings" in text and "gen_len 48 (paper 4096)" in text
    assert text.count("INFO") == 5   # streaming, h2o (both kinds), hf-static


def test_missing_or_unfinished_rows_print_missing_never_pass():
    args = rg.parse(SMALL)
    base = dict(model="m", engine="native", memory_matched=False, batch=2, gen_len=48,
                dense_batch=2, dense_gen_len=48, status="ok")
    rows = [dict(base, policy="dense", tok_per_s=20000.0, allocated_kv_bytes=10, attn_slots=4),
            dict(base, policy="snapkv", tok_per_s=40000.0, allocated_kv_bytes=5, attn_slots=2),
            dict(base, policy="rkv", status="timeout", tok_per_s=None)]
    rg.add_ratios(rows)
    got = [ok for _, ok in rg.bars(rows, args)]
    assert got == [True, True, None, None, None]
    lines = [line for line, _ in rg.bars(rows, args)]
    assert "timeout" in lines[2] and "not in this run" in lines[3]
    rows[0]["status"] = "error: OutOfMemoryError"     # no dense: nothing has a ratio
    rg.add_ratios(rows)
    assert [ok for _, ok in rg.bars(rows, args)] == [None] * 5
    assert "no native dense row to compare with" in rg.bars(rows, args)[1][0]


def test_time_cap_stops_a_row_and_the_budget_skips_the_rest(tmp_path):
    with pytest.raises(rg.RowTimeout):
        with rg.time_cap(0.05):
            while True:
                time.sleep(0.001)
    # an alarm landing inside no_grad's enter must not leave gradients off for the process
    with pytest.raises(rg.RowTimeout):
        with rg.time_cap(0.02):
            while True:
                with torch.no_grad():
                    pass
    assert torch.is_grad_enabled()
    out = tmp_path / "rows.json"
    rows = rg.main(SMALL + ["--rows", "same", "--policies", "snapkv", "--row-cap", "0.001",
                            "--json", str(out)])
    assert [r["status"] for r in rows] == ["timeout", "timeout"]
    assert "stopped at its 0 s cap" in rows[0]["note"] and rows[0]["speed_vs_dense"] is None
    assert json.loads(out.read_text())[1]["status"] == "timeout" and torch.is_grad_enabled()
    rows = rg.main(SMALL + ["--rows", "same", "--policies", "rkv", "--time-budget", "0.01"])
    assert [r["status"] for r in rows] == ["skipped", "skipped"]


def test_public_shapes_and_bad_values():
    from common.testmodels import random_model

    published = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304,
                 "qwen2.5-7b": 7_615_616_512}
    for name, count in published.items():   # on the meta device: shapes only, no memory
        m = random_model("qwen2.5", "meta", torch.bfloat16, **rg.SHAPES[name])
        assert sum(p.numel() for p in m.parameters()) == count
        assert m.config.rope_parameters["rope_theta"] == 1e6 and m.dtype == torch.bfloat16
    args = rg.parse(["--device", "cpu"])
    assert (args.shape, args.dtype, args.gen_len, args.batch, args.budget, args.every) == \
        (["qwen2.5-1.5b"], "bfloat16", 4096, 64, 512, 128)
    bpt = 2 * 28 * 2 * 128 * 2            # 1.5B in bf16: K and V, 28 layers, 2 KV heads of 128
    assert rg.equal_batch(args, bpt)[0] == 64 * 4224 // 640 == 422
    for bad, needle in ((["--shape", "qwen2.5-3b"], "qwen2.5-3b"),
                        (["--override", "hidden=3"], "hidden=3"),
                        (["--rows", "same,peers"], "peers"), (["--gen-len", "0"], "--gen-len 0")):
        with pytest.raises(SystemExit, match=needle):
            rg.parse(bad)
    with pytest.raises(SystemExit, match="--equal-batch 500"):
        rg.equal_batch(rg.parse(["--equal-batch", "500"]), bpt)
    assert rollout.parse([]).device == "cpu"    # today's CPU bench is unchanged by default
