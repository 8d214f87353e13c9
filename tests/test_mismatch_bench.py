"""bench/mismatch.py: the per-outcome tally against hand-counted values, and the script end to end
on the small SFT'd test model."""
from __future__ import annotations

import json
import math

import pytest

from bench.mismatch import FIELDS, main, tally, token_class


def test_token_class():
    assert [token_class(t) for t in ("7", " 12", "a", " b", "=", "ab", "", "r7")] == [
        "digit", "digit", "name", "name", "other", "other", "other", "other"]


def test_tally_counts_by_hand():
    """rho = dense / sampler per token; the band [0.5, 1.5] and veto 1e-4 are the defaults."""
    right = [True, False, False]
    classes = [["digit", "other", "digit"], ["digit", "name"], ["other"]]
    sampler = [[-1.0, -1.0, -1.0], [-2.0, -2.0], [-0.5]]
    rho = [[0.25, 1.0, 2.0], [1e-5, 1.0], [1.0]]
    dense = [[s + math.log(r) for s, r in zip(ss, rr)] for ss, rr in zip(sampler, rho)]
    out = tally(right, classes, sampler, dense)
    assert out["right"] == pytest.approx({
        "samples": 1, "mean_tokens": 3.0, "low_per_sample": 1.0, "high_per_sample": 1.0,
        "low_digit_share": 1.0, "digit_share": 2 / 3, "with_low": 1.0, "vetoed": 0.0,
        "digit_weight": (0.25 + 1.5) / 2, "other_weight": 1.0})      # min(rho, 1.5)
    assert out["wrong"] == pytest.approx({
        "samples": 2, "mean_tokens": 1.5, "low_per_sample": 0.5, "high_per_sample": 0.0,
        "low_digit_share": 1.0, "digit_share": 1 / 3, "with_low": 0.5, "vetoed": 0.5,
        "digit_weight": 1e-5, "other_weight": 1.0})


def test_tally_refuses_ragged_input():
    with pytest.raises(ValueError, match="one entry per sample"):
        tally([True, False], [["digit"]], [[0.0]], [[0.0]])


def test_mismatch_bench_end_to_end(tiny_model, tmp_path):
    out = tmp_path / "m.json"
    rows = main(["--model", str(tiny_model), "--budgets", "12,24", "--n", "3", "--samples", "2",
                 "--json", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    assert [r["budget"] for r in rows] == [12, 24]
    for r in rows:
        assert r["right"]["samples"] + r["wrong"]["samples"] == 6
        for outcome in ("right", "wrong"):
            v = r[outcome]
            assert set(v) == set(FIELDS)
            for f in ("low_digit_share", "digit_share", "with_low", "vetoed"):
                assert 0.0 <= v[f] <= 1.0
            assert 0.0 <= v["digit_weight"] <= 1.5 and 0.0 <= v["other_weight"] <= 1.5
            assert v["low_per_sample"] >= v["with_low"]


def test_mismatch_bench_refuses_a_missing_model(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "nope"), "--budgets", "12"])
    assert "--model" in capsys.readouterr().err


def test_tail_by_bin_by_hand():
    """Alphas binned by absolute position (prompt length + response index), one quantile per bin,
    and the share of samples with an alpha below 0.1."""
    from bench.mismatch import tail_by_bin
    from schedule.plan import tail

    # prompt 3: response positions 3, 4, 5, 6 -> bins 0, 1, 1, 1 (width 4); prompt 5: 5, 6 -> 1, 1
    out = tail_by_bin([3, 5], [[0.9, 0.05, 0.8, 1.0], [0.7, 0.6]], 0.5, 4)
    assert out["low_alpha_share"] == 0.5
    assert out["by_bin"][0] == {"tail": tail([0.9], 0.5), "tokens": 1}
    assert out["by_bin"][1] == {"tail": tail([0.05, 0.8, 1.0, 0.7, 0.6], 0.5), "tokens": 5}
    assert out["by_bin"][1]["tail"] == pytest.approx(0.7)   # the median of the five


def test_mismatch_bench_tail_end_to_end(tiny_model, tmp_path, capsys):
    """--tail: every sample's own alphas (a replay through the same sparse engine), binned; the
    all-samples figures agree with the per-outcome tally; a budget that never evicts agrees
    exactly (alpha 1 in every bin, KV as dense's, nothing vetoed)."""
    out = tmp_path / "m.json"
    rows = main(["--model", str(tiny_model), "--budgets", "12,400", "--n", "3", "--samples", "2",
                 "--compress-every", "4", "--protect-prompt", "--tail", "0.01", "--bin-tokens",
                 "16", "--json", str(out)])
    assert "q0.01 bin" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    small, full = (r["all"] for r in rows)
    for a, r in zip((small, full), rows):
        assert a["samples"] == 6 and a["quantile"] == 0.01 and a["bin_tokens"] == 16
        assert a["vetoed"] == pytest.approx(
            (r["right"]["vetoed"] * r["right"]["samples"]
             + r["wrong"]["vetoed"] * r["wrong"]["samples"]) / 6)
        assert 0.0 <= a["reward"] <= 1.0 and 0.0 <= a["low_alpha_share"] <= 1.0
        assert all(0.0 <= b["tail"] <= 1.0 and b["tokens"] > 0 for b in a["by_bin"].values())
    assert all(b["tail"] == pytest.approx(1.0, abs=1e-5) for b in full["by_bin"].values())
    assert full["vetoed"] == 0.0 and full["low_alpha_share"] == 0.0
    assert full["kv_vs_dense"] == pytest.approx(1.0, abs=0.05) and small["kv_vs_dense"] < 1.0


def test_mismatch_bench_refuses_a_bad_tail(tiny_model, capsys):
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_model), "--budgets", "12", "--tail", "5"])
    assert "--tail" in capsys.readouterr().err


def test_task_of_a_runs_final_model_and_a_model_that_does_not_say(tiny_model, tmp_path, capsys):
    """A run's final/ (no sft_metrics.json) is measured on the task of the run's config.yaml; a
    model directory that says no task is refused, naming it, unless --task names one: guessing
    would measure the model on prompts it never saw."""
    import shutil

    from bench.attention import task_of
    from launch.config import load_config, to_yaml

    run = tmp_path / "run"
    shutil.copytree(tiny_model, run / "final")
    (run / "final" / "sft_metrics.json").unlink()
    cfg = load_config(["task.name=reasoning", "task.reasoning.response_tokens=64",
                       f"rollout.model_path={tiny_model}"])
    (run / "config.yaml").write_text(to_yaml(cfg))
    task = task_of(run / "final", None)
    assert task.name == "reasoning" and task.response_tokens == 64
    assert task_of(run / "final", "running_sum").name == "running_sum"
    bare = tmp_path / "bare"
    shutil.copytree(run / "final", bare)
    with pytest.raises(ValueError, match="sft_metrics.json"):
        task_of(bare, None)
    with pytest.raises(SystemExit):
        main(["--model", str(bare), "--budgets", "12"])
    assert "--model" in (err := capsys.readouterr().err) and str(bare) in err and "--task" in err


def test_mismatch_bench_adaptive_rows_beside_the_fixed_budget(tiny_model, tmp_path, capsys):
    """--keep-mass 0,S: a fixed and an adaptive row per budget, labelled, each with its own
    samples' figures (the engine's own tests check what the adaptive budget holds)."""
    rows = main(["--model", str(tiny_model), "--budgets", "16", "--n", "3", "--samples", "2",
                 "--compress-every", "4", "--tail", "0.05", "--bin-tokens", "16",
                 "--keep-mass", "0,0.5", "--min-budget", "8"])
    assert [(r["budget"], r["keep_mass"], r["min_budget"]) for r in rows] == \
        [(16, 0.0, 0), (16, 0.5, 8)]
    assert "| 16 mass 0.5 >= 8 |" in capsys.readouterr().out
    for r in rows:
        assert r["all"]["samples"] == 6 and 0.0 < r["all"]["kv_vs_dense"] < 1.0


@pytest.mark.parametrize("args, flag", [
    (["--keep-mass", "0.9"], "--min-budget"),               # no floor: 0 < obs_window
    (["--keep-mass", "x"], "--keep-mass"),
    (["--keep-mass", "1.5", "--min-budget", "8"], "--keep-mass"),
    (["--keep-mass", "0.9", "--min-budget", "8", "--policy", "h2o"], "--keep-mass"),
])
def test_mismatch_bench_refuses_bad_adaptive_flags(tiny_model, capsys, args, flag):
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_model), "--budgets", "12"] + args)
    assert flag in capsys.readouterr().err
