"""bench/rollout.py: the equal-KV-memory comparison (the batch it picks fits in dense's KV bytes,
the largest that does, measured by the engine itself; those rows stay out of the issue's bars);
issue 17's additions: ``--dtype`` in every row, vLLM rows for every policy, the equal-pool rows and
columns (a small run with vLLM where it is installed), the vLLM bars on synthetic rows (PASS, FAIL,
MISSING)."""
from __future__ import annotations

import pytest

from bench.rollout import (bars, equal_memory_info, memory_matched_batch, native_kv_bytes, prompts,
                           run_native)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from common.testmodels import build_model
    from common.modeling import load_model

    return load_model(build_model(tmp_path_factory.mktemp("bench") / "m", "tiny", seed=0))


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "rkv"])
def test_memory_matched_batch_is_the_largest_that_fits(model, policy):
    gen_len, prompt_len, every, frac, dense_batch = 64, 4, 8, 0.25, 3
    vocab = model.config.vocab_size
    dense = run_native(model, prompts(dense_batch, prompt_len, vocab), gen_len, "dense", None, every)
    limit = dense["peak_kv_bytes"]
    assert limit == native_kv_bytes(model, gen_len, prompt_len, "dense", None, every, dense_batch)
    b = memory_matched_batch(model, gen_len, prompt_len, policy, frac, every, limit)
    assert b > dense_batch   # budget 16 + N 8 = 24 slots per row vs dense's 68
    sparse = run_native(model, prompts(b, prompt_len, vocab), gen_len, policy, frac, every)
    assert sparse["peak_kv_bytes"] == native_kv_bytes(model, gen_len, prompt_len, policy, frac,
                                                      every, b)
    assert sparse["peak_kv_bytes"] <= limit
    assert native_kv_bytes(model, gen_len, prompt_len, policy, frac, every, b + 1) > limit


def test_memory_matched_rows_are_info_not_bars():
    base = {"model": "tiny", "engine": "native", "gen_len": 2048, "budget_frac": 0.25,
            "compress_every": 128}
    rows = [dict(base, policy="dense", budget_frac=1.0, compress_every=0, batch=16, tok_per_s=100.0,
                 speed_vs_dense=1.0, kv_vs_dense=1.0),
            dict(base, policy="rkv", batch=16, tok_per_s=150.0, speed_vs_dense=1.5, kv_vs_dense=0.31,
                 attn_vs_dense=0.5),
            dict(base, policy="rkv", batch=51, tok_per_s=300.0, speed_vs_dense=3.0,
                 kv_vs_dense=0.99, memory_matched=True)]
    lines = bars(rows)
    assert len(lines) == 2 and not any(ok for _, ok in lines)   # same-batch speed 1.5x, KV 0.31
    assert "attention alone would give 2.00x" in lines[0][0]
    info, = equal_memory_info(rows)
    assert "sparse at equal KV memory: 3.00x dense tokens/s (batch 51 vs 16" in info


# ---- issue 17: --dtype, vLLM rows for every policy, the equal-pool section, the vLLM bars --------

def test_flags_and_quick_mode():
    from bench.rollout import parse

    args = parse([])
    assert args.dtype == "float32" and args.equal_pool and args.pool_min_len == 2048
    assert args.pool_batch == args.pool_requests == 0      # the batch and 4x it
    quick = parse(["--quick", "--dtype", "bfloat16", "--no-equal-pool"])
    assert quick.dtype == "bfloat16" and not quick.equal_pool
    assert (quick.pool_min_len, quick.pool_batch, quick.pool_requests) == (256, 2, 8)
    with pytest.raises(SystemExit):
        parse(["--dtype", "float16"])


def test_vllm_row_configs_and_pool_bytes():
    from bench.rollout_vllm import BLOCK, kv_config, pool_bytes

    kv, budget = kv_config("streaming", 0.25, 2048, 128)
    assert (budget, kv.budget, kv.sink_tokens, kv.compress_every) == (512, 512, 0, 128)
    kv, budget = kv_config("snapkv", 0.25, 2048, 64)
    assert budget == 512 and kv.sink_tokens > 0 and kv.compress_every == 64
    assert kv_config("dense", None, 2048, 128)[1] == 0
    # 16 + 2048 + 32 = 2096 tokens per sequence, rounded up to 66 blocks of 32
    assert BLOCK == 32 and pool_bytes(16, 16, 2048, 1000) == 16 * 66 * 32 * 1000
    assert pool_bytes(1, 0, 32, 1) == 64          # already whole blocks: + one block


def test_native_bf16_rows_hold_half_the_kv_bytes(tmp_path):
    import torch

    from common.modeling import load_model
    from common.testmodels import build_model

    path = build_model(tmp_path / "m", "tiny", seed=0)
    ps = prompts(2, 4, 200)
    rows = {dt: run_native(load_model(path, dtype=dt), ps, 24, "snapkv", 0.25, 8)
            for dt in (torch.float32, torch.bfloat16)}
    assert rows[torch.bfloat16]["peak_kv_bytes"] * 2 == rows[torch.float32]["peak_kv_bytes"]
    assert rows[torch.bfloat16]["tok_per_s"] > 0


def _vllm_rows(policies=("snapkv", "rkv"), same=(1.6, 1.4), pool=((4.0, 1.7), (2.0, 1.6)),
               dense_running=16.0):
    base = {"model": "mid", "gen_len": 2048, "engine": "vllm", "budget_frac": 0.25}
    rows = [dict(base, policy="dense", budget_frac=1.0, tok_per_s=100.0, equal_pool=False),
            dict(base, policy="dense", budget_frac=1.0, tok_per_s=80.0, equal_pool=True,
                 concurrent_requests=dense_running, max_concurrent_requests=64)]
    for p, s, (run, speed) in zip(policies, same, pool):
        rows.append(dict(base, policy=p, tok_per_s=100.0 * s, equal_pool=False))
        rows.append(dict(base, policy=p, tok_per_s=80.0 * speed, equal_pool=True,
                         concurrent_requests=dense_running * run, max_concurrent_requests=64))
    return rows


def test_issue17_bars_pass_fail_and_missing():
    from bench.rollout_vllm import bars as vllm_bars

    got = vllm_bars(_vllm_rows(), 0.25, 2048)
    status = [ok for _, ok in got]
    # snapkv: same batch 1.6x, pool speed 1.7x, running 4x; rkv: 1.4x, 1.6x, 2x
    assert status == [True, False, True, True, True, False]
    assert "snapkv same batch: 1.60x vLLM dense tok/s" in got[0][0]
    assert "running at once (mean 64.0 vs 16.0; >= 3x)" in got[3][0]
    # a policy without rows (the engine refused it) and a run without the dense rows: MISSING
    only_snapkv = _vllm_rows(policies=("snapkv",), same=(1.6,), pool=((4.0, 1.7),))
    missing = [line for line, ok in vllm_bars(only_snapkv, 0.25, 2048) if ok is None]
    assert len(missing) == 2 and all("vllm rkv row MISSING" in m for m in missing)
    no_dense = [r for r in _vllm_rows() if r["policy"] != "dense"]
    assert all(ok is None for _, ok in vllm_bars(no_dense, 0.25, 2048))
    # judged on the mid model only, at the bar's length only (no vLLM rows run at 8192)
    assert vllm_bars([dict(r, model="tiny") for r in _vllm_rows()], 0.25, 2048) == []
    for other in (512, 8192):
        assert vllm_bars([dict(r, gen_len=other) for r in _vllm_rows()], 0.25, 2048) == []


def test_print_bars_counts_missing_as_not_passed(capsys):
    from bench.rollout import print_bars

    rows = _vllm_rows(policies=("snapkv",), same=(1.6,), pool=((4.0, 1.7),))
    rows.append(dict(rows[0], engine="native", policy="dense", tok_per_s=50.0,
                     speed_vs_dense=1.0, kv_vs_dense=1.0))
    print_bars(rows)
    out = capsys.readouterr().out
    assert "bars (3/5 pass)" in out
    assert out.count("  MISSING  mid 2048 vllm rkv") == 2 and "  PASS  mid 2048 vllm snapkv" in out


def test_bench_without_vllm_writes_the_new_columns(tmp_path, capsys):
    import json

    from bench.rollout import main

    out = tmp_path / "rows.json"
    main(["--models", "tiny", "--lengths", "32", "--budgets", "0.5", "--batch", "2",
          "--repeat", "1", "--hf", "", "--policies", "rkv", "--every", "8", "--no-vllm",
          "--dtype", "bfloat16", "--pool-min-len", "32", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["engine"], r["policy"]) for r in rows] == [("native", "dense"), ("native", "rkv")]
    for r in rows:
        assert r["dtype"] == "bfloat16" and r["equal_pool"] is False
        assert r["concurrent_requests"] is None and r["max_concurrent_requests"] is None
    assert "equal KV pool" not in capsys.readouterr().out


def test_quick_sized_run_with_vllm_rows_and_equal_pool(tmp_path):
    """A small run with vLLM: dense, window and eviction rows at the bench batch, the equal-pool
    rows at one pool for every vLLM policy. In a subprocess: in-process vLLM starts its own
    torch.distributed group, which later DeepSpeed learners in this pytest process must not see."""
    pytest.importorskip("vllm")
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "rows.json"
    args = ["--models", "tiny", "--lengths", "64", "--budgets", "0.25", "--batch", "3",
            "--repeat", "1", "--hf", "", "--policies", "streaming,snapkv", "--every", "16",
            "--dtype", "bfloat16", "--pool-min-len", "64", "--pool-batch", "2",
            "--pool-requests", "6", "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, str(root / "bench" / "rollout.py"), *args], cwd=root,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert all(r["dtype"] == "bfloat16" for r in rows)
    vllm = {(r["policy"], r["equal_pool"]): r for r in rows if r["engine"] == "vllm"}
    for policy in ("dense", "streaming", "snapkv"):
        for pool in (False, True):
            assert (policy, pool) in vllm, (policy, pool)
    assert vllm[("streaming", False)]["budget"] == 16 and vllm[("dense", False)]["batch"] == 3
    pool = [r for r in rows if r["equal_pool"]]
    assert len({r["pool_bytes"] for r in pool}) == 1 and all(r["batch"] == 6 for r in pool)
    for r in pool:
        assert r["engine"] == "vllm"
        assert 1 <= r["concurrent_requests"] <= r["max_concurrent_requests"] <= 6
        assert r["preemptions"] >= 0 and r["tok_per_s"] > 0
    # the pool holds two dense sequences at full length (plus a block each): dense never runs all
    # six at once for long; eviction reserves its growth and is never preempted
    assert vllm[("dense", True)]["concurrent_requests"] < 6
    assert vllm[("snapkv", True)]["preemptions"] == 0
    for r in rows:
        if r["engine"] != "vllm":
            assert r["concurrent_requests"] is None and r["pool_bytes"] is None
    assert "# vLLM at equal KV pool bytes" in proc.stdout and "dense's running" in proc.stdout
