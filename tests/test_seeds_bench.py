"""bench/seeds.py: the paired share of dense and its standard error by hand, the pooling rules
(dense keyed by seed, duplicates refused), and the command end to end on written compare.json
files with runs' metrics.jsonl."""
from __future__ import annotations

import json
import math

import pytest

from bench.seeds import load, main, markdown, pool, share_stats


def test_share_and_its_standard_error_by_hand():
    st = share_stats([0.6, 0.7, 0.8], [0.8, 0.8, 0.8], bar=0.97)
    assert st["share"] == pytest.approx(0.875)
    # residuals a - share * d = -0.1, 0, 0.1: sd 0.1, se = 0.1 / (sqrt(3) * 0.8)
    assert st["share_se"] == pytest.approx(0.1 / (math.sqrt(3) * 0.8))
    assert st["seed_shares"] == pytest.approx([0.75, 0.875, 1.0])
    # 3 * (2 se / 0.095)^2 = 6.92 -> 7 seeds
    assert st["seeds_for_bar"] == math.ceil(3 * (2 * st["share_se"] / 0.095) ** 2) == 7


def test_pairing_by_seed_removes_what_dense_and_arm_share():
    # the arm is 0.9 of dense at every seed, while dense itself moves a lot between seeds
    d = [0.5, 0.7, 0.9]
    st = share_stats([0.9 * x for x in d], d, bar=0.97)
    assert st["share"] == pytest.approx(0.9) and st["share_se"] == pytest.approx(0.0, abs=1e-12)
    assert st["seeds_for_bar"] == 1
    one = share_stats([0.6], [0.8], bar=0.97)
    assert one["share_se"] is None and one["seeds_for_bar"] is None


def write_compare(path, rows, policy="rkv", overrides="rollout.kv.protect_prompt=true"):
    path.mkdir(parents=True)
    doc = {"command": f"python bench/compare.py --task reasoning -- {overrides}",
           "policy": policy, "rows": rows}
    (path / "compare.json").write_text(json.dumps(doc))
    return path


def row(arm, budget, seed, acc, run_dir=None):
    return {"arm": arm, "budget": budget, "seed": seed, "acc_dense_decode": acc,
            "run_dir": str(run_dir) if run_dir else None}


def test_dense_is_every_budgets_reference_and_duplicates_are_refused(tmp_path):
    a = write_compare(tmp_path / "a", [row("dense", 90, 0, 0.8), row("sparse_rl", 90, 0, 0.7)])
    b = write_compare(tmp_path / "b", [row("dense", 90, 1, 0.6), row("sparse_rl", 180, 0, 0.76),
                                       row("sparse_rl", 180, 1, 0.6)])
    groups = {(g["arm"], g["budget"]): g for g in pool(load([str(a), str(b)]))}
    assert groups[("dense", None)]["seeds"] == [0, 1]
    g180 = groups[("sparse_rl", 180)]
    assert g180["paired_seeds"] == [0, 1] and g180["share"] == pytest.approx(1.36 / 1.4)
    g90 = groups[("sparse_rl", 90)]   # seed 0 only: paired with seed 0's dense alone
    assert g90["share"] == pytest.approx(0.7 / 0.8) and g90["dense_mean"] == pytest.approx(0.8)
    # --seeds keeps seed 0 only
    only0 = {(g["arm"], g["budget"]): g for g in pool(load([str(a), str(b)]), seeds={0})}
    assert only0[("sparse_rl", 180)]["share"] == pytest.approx(0.76 / 0.8)
    c = write_compare(tmp_path / "c", [row("sparse_rl", 90, 0, 0.71)])
    with pytest.raises(SystemExit, match=r"sparse_rl budget 90 seed 0 twice: .*a/compare.json "
                                         r"and .*c/compare.json"):
        pool(load([str(a), str(c)]))
    d = write_compare(tmp_path / "d", [row("dense", 90, 0, 0.81)])
    with pytest.raises(SystemExit, match="dense seed 0 twice"):
        pool(load([str(a), str(d)]))
    e = write_compare(tmp_path / "e", [row("tis", 90, 0, None)])
    with pytest.raises(SystemExit, match="arm tis seed 0 has no 'acc_dense_decode'"):
        pool(load([str(e)]))
    with pytest.raises(SystemExit, match="no compare.json at"):
        load([str(tmp_path / "missing")])


def test_one_arm_under_two_designs_is_two_groups_against_one_dense(tmp_path, capsys):
    kept = write_compare(tmp_path / "kept", [row("dense", 90, 0, 0.8), row("dense", 90, 1, 0.6),
                                             row("sparse_rl", 90, 0, 0.7),
                                             row("sparse_rl", 90, 1, 0.5)])
    free = write_compare(tmp_path / "free", [row("sparse_rl", 90, 0, 0.76),
                                             row("sparse_rl", 90, 1, 0.6)],
                         overrides="rollout.kv.protect_prompt=false")
    groups = pool(load([str(kept), str(free)]))
    rl = {g["overrides"][0]: g for g in groups if g["arm"] == "sparse_rl"}
    assert set(rl) == {"rollout.kv.protect_prompt=true", "rollout.kv.protect_prompt=false"}
    assert rl["rollout.kv.protect_prompt=true"]["share"] == pytest.approx(1.2 / 1.4)
    assert rl["rollout.kv.protect_prompt=false"]["share"] == pytest.approx(1.36 / 1.4)
    assert main([str(kept), str(free)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].endswith("| overrides |")
    assert "| 0.760 0.600 | 0.680 ± 0.113 |" in text
    assert text.count("`rollout.kv.protect_prompt=false`") == 1
    # the same design twice is still a duplicate, whatever the order of its overrides
    again = write_compare(tmp_path / "again", [row("sparse_rl", 90, 0, 0.75)],
                          overrides="rollout.kv.protect_prompt=false")
    with pytest.raises(SystemExit, match="sparse_rl budget 90 seed 0 twice"):
        pool(load([str(free), str(again)]))
    ab = write_compare(tmp_path / "ab", [row("sparse_rl", 90, 0, 0.7)],
                       overrides="rollout.kv.protect_prompt=false rollout.kv.compress_every=32")
    ba = write_compare(tmp_path / "ba", [row("sparse_rl", 90, 1, 0.5)],
                       overrides="rollout.kv.compress_every=32 rollout.kv.protect_prompt=false")
    one = pool(load([str(ab), str(ba)]))
    assert [(g["seeds"], g["overrides"]) for g in one] == [
        ([0, 1], ["rollout.kv.compress_every=32 rollout.kv.protect_prompt=false"])]
    assert "| overrides |" not in markdown(one, "acc_dense_decode", None)
    with pytest.raises(SystemExit, match="sparse_rl budget 90 seed 0 twice"):
        pool(load([str(ab), str(write_compare(tmp_path / "ba0", [row("sparse_rl", 90, 0, 0.6)],
              overrides="rollout.kv.compress_every=32 rollout.kv.protect_prompt=false"))]))


def test_main_end_to_end_with_kv_from_the_runs(tmp_path, capsys):
    runs = []
    for seed, (kv, kept) in enumerate([(0.3, 0.6), (0.5, 0.8)]):
        run = tmp_path / f"run{seed}"
        run.mkdir()
        steps = [{"step": 1, "reward": 0.5, "rollout/kv_vs_dense": kv, "kept_ratio": kept},
                 {"step": 2, "reward": 0.5, "rollout/kv_vs_dense": kv, "kept_ratio": kept},
                 {"step": 2, "eval/accuracy": 0.5}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
        runs.append(run)
    a = write_compare(tmp_path / "a", [row("dense", 90, 0, 0.8), row("dense", 90, 1, 0.6),
                                       row("sparse_rl", 90, 0, 0.7, runs[0]),
                                       row("sparse_rl", 90, 1, 0.6, runs[1])],
                      policy="snapkv")
    out = tmp_path / "seeds.json"
    assert main([str(a / "compare.json"), "--bar", "0.97", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| snapkv | sparse_rl | 90 | 0,1 | 0.700 0.600 |" in text
    g = [g for g in json.loads(out.read_text()) if g["arm"] == "sparse_rl"][0]
    assert g["share"] == pytest.approx(1.3 / 1.4)
    assert g["rollout_kv_vs_dense"] == pytest.approx(0.4) and g["kept_ratio"] == pytest.approx(0.7)
    with pytest.raises(SystemExit):
        main([str(a), "--seeds", "0,x"])
