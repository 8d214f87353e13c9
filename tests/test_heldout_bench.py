"""bench/heldout.py: the binomial standard error by hand, and the re-scoring end to end on two
run directories whose final model is the small SFT'd test model (so every figure equals the
base model's, scored the same way)."""
from __future__ import annotations

import json
import math
import shutil

import pytest

from bench.heldout import binomial_se, main, summarize


def test_binomial_se_and_summary_by_hand():
    assert binomial_se(0.5, 100) == pytest.approx(0.05)
    assert binomial_se(0.0, 10) == 0.0
    row = summarize("x", [0.5, 0.7], 400, [0.6, None])
    assert row["mean"] == pytest.approx(0.6) and row["std"] == pytest.approx(math.sqrt(0.02))
    assert row["se_run"] == pytest.approx(math.sqrt(0.24 / 400))
    assert row["se_mean"] == pytest.approx(row["se_run"] / math.sqrt(2))


def fake_run(root, model, name):
    from launch.config import load_config, to_yaml

    run = root / name
    shutil.copytree(model, run / "final")
    cfg = load_config([f"rollout.model_path={model}", "rollout.max_new_tokens=24",
                       "rollout.kv.budget=12", "rollout.kv.compress_every=4"])
    (run / "config.yaml").write_text(to_yaml(cfg))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 2, "eval/accuracy": 0.25}) + "\n")
    return run


def test_heldout_bench_end_to_end(tiny_model, tmp_path):
    from bench.compare_eval import decode_accuracy

    runs = [fake_run(tmp_path / "runs", tiny_model, f"naive_sparse-b12-s{s}") for s in (0, 1)]
    out = tmp_path / "h.json"
    rows = main(["--group", "naive", str(tmp_path / "runs" / "naive_sparse-b12-s*"),
                 "--problems", "16", "--sparse", "12", "--base", str(tiny_model),
                 "--json", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    base, naive = rows
    assert base["group"] == "base" and naive["runs"] == 2 and naive["acc_own_eval"] == [0.25, 0.25]
    assert naive["accs"] == [base["mean"]] * 2 and naive["std"] == 0.0   # the same model
    assert naive["sparse"]["accs"] == [base["sparse"]["mean"]] * 2
    assert naive["se_run"] == pytest.approx(binomial_se(naive["mean"], 16))
    acc = decode_accuracy(runs[0] / "final", runs[0], 12, problems=16, sparse=False)
    assert acc["problems"] == 16 and acc["sparse"] is None and acc["dense"] == base["mean"]


def test_heldout_bench_refuses_a_glob_without_runs(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    for pattern in (str(tmp_path / "none-*"), str(tmp_path / "r")):
        with pytest.raises(SystemExit):
            main(["--group", "x", pattern])
        assert "--group x" in capsys.readouterr().err


def test_overrides_reach_the_decode_and_a_bad_one_is_named(tiny_model, tmp_path, capsys):
    """``--set`` / ``overrides`` change the run's config before the decode: a longer compression
    interval lets each sparse sequence hold more tokens at its peak (budget + interval)."""
    from bench.compare_eval import decode_accuracy

    run = fake_run(tmp_path / "runs", tiny_model, "dense-s0")   # trained with compress_every=4
    at4 = decode_accuracy(run / "final", run, 12, problems=8)
    at8 = decode_accuracy(run / "final", run, 12, problems=8,
                          overrides=["rollout.kv.compress_every=8"])
    assert at8["sparse_kv_bytes"] > at4["sparse_kv_bytes"]
    assert at8["dense"] == at4["dense"] and at8["dense_kv_bytes"] == at4["dense_kv_bytes"]
    (row,) = main(["--group", "d", str(run), "--problems", "8", "--sparse", "12",
                   "--set", "rollout.kv.compress_every=8"])
    assert row["sparse"]["accs"] == [at8["sparse"]]
    with pytest.raises(SystemExit):
        main(["--group", "d", str(run), "--set", "rollout.kv.compress_every=zero"])
    assert "--set" in (err := capsys.readouterr().err) and "rollout.kv.compress_every" in err
