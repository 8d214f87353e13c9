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
