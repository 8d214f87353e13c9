"""bench/compare.py: arms planned from the config (missing ones reported, not run), and the quick
comparison end to end on the tiny model: every available arm trains, is decoded dense and sparse,
and reports its row, table and plots."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import train_env
from PIL import Image

from bench import compare
from bench.compare import ARMS, has_key, parse, plan, resolve_budgets, time_to, weights_digest
from bench.compare_eval import aggregate, markdown
from common.cpu_isa import has_avx2

REPO = Path(__file__).resolve().parent.parent
ROW_KEYS = {"arm", "budget", "seed", "acc_dense_decode", "acc_sparse_decode", "acc_base",
            "acc_problems",
            "reward_last", "agreement_p5", "frac_vetoed", "kv_bytes_vs_dense", "rollout_s_vs_dense",
            "budget_share", "to_dense_acc_wall_s", "to_dense_acc_rollout_s", "signal_dropped_pos",
            "signal_dropped_neg"}


def test_plan_reports_arms_whose_keys_do_not_exist():
    assert has_key("rollout.kv.budget") and not has_key("rollout.kv.nosuch")
    jobs, missing = plan(ARMS, [48, 16], [0, 1])
    present = [a for a in ARMS if not a.requires or has_key(a.requires)]
    assert {m["arm"] for m in missing} == {a.name for a in ARMS} - {a.name for a in present}
    assert all(a.requires in m["reason"] for a in ARMS for m in missing if m["arm"] == a.name)
    # dense trains once per seed (decoded at every budget), sparse arms per budget and seed
    assert sum(j["arm"] == "dense" for j in jobs) == 2
    assert sum(j["arm"] == "sparse_rl" for j in jobs) == 4
    sparse = [j for j in jobs if j["arm"] == "naive_sparse" and j["budget"] == 16]
    assert "rollout.kv.budget=16" in sparse[0]["overrides"]
    assert "correction.method=none" in sparse[0]["overrides"]
    assert "rollout.kv.policy=rkv" in sparse[0]["overrides"]        # the paper's, by default


def test_policy_reaches_every_sparse_arm_and_never_the_dense_one():
    jobs, _ = plan(ARMS, [40], [0], policy="h2o")
    for job in jobs:
        policies = [o for o in job["overrides"] if o.startswith("rollout.kv.policy=")]
        assert policies == (["rollout.kv.policy=dense"] if job["arm"] == "dense"
                            else ["rollout.kv.policy=h2o"]), job
    assert parse(["--policy", "h2o"]).policy == "h2o" and parse([]).policy == "rkv"
    with pytest.raises(SystemExit):
        parse(["--policy", "dense"])      # the dense arm is the reference, not a sparse policy
    empty = {"command": "c", "wall_s": 1, "budgets": [40], "seeds": [0], "summary": [],
             "missing": [], "failed": []}
    assert "with H2O at the budget" in markdown({**empty, "policy": "h2o"})
    assert "with R-KV at the budget" in markdown(empty)      # results saved before --policy


def test_aggregate_mean_and_spread():
    rows = [{"arm": "a", "budget": 16, "acc_dense_decode": v} for v in (0.2, 0.4)]
    (e,) = aggregate(rows)
    assert e["seeds"] == 2 and e["acc_dense_decode"] == pytest.approx(0.3)
    assert e["acc_dense_decode_std"] == pytest.approx(0.1414, abs=1e-3)


def test_budgets_take_tokens_or_shares_and_the_task_its_model():
    args = parse(["--task", "reasoning"])
    assert args.budgets == [0.25, 0.125] and args.model == REPO / ".cache/models/reasoning-base"
    assert parse(["--budgets", "48,0.5"]).budgets == [48, 0.5]
    assert parse([]).model == REPO / ".cache/models/tiny-base" and parse([]).build_model
    with pytest.raises(SystemExit):
        parse(["--model", "/nonexistent/model"])           # a given model is never built
    for bad in ("0", "-3", "1.5", "x"):
        with pytest.raises(SystemExit):
            parse(["--budgets", bad])
    assert resolve_budgets([48, 16], []) == ([48, 16], {})       # tokens: no config read


def test_a_share_is_of_the_mean_prompt_plus_gold_response(tiny_model):
    from common.modeling import load_tokenizer
    from launch.config import load_config
    from tasks import make_task

    common = [f"rollout.model_path={tiny_model}"]
    task, tok = make_task(load_config(common).task), load_tokenizer(tiny_model)
    lens = [len(tok(p.prompt + task.solution(p.prompt))["input_ids"]) + 1
            for p in task.problems("heldout")]
    budgets, shares = resolve_budgets([0.5, 16], common)
    assert budgets == [round(0.5 * sum(lens) / len(lens)), 16]
    assert shares == {budgets[0]: 0.5}


def test_time_to_dense_accuracy_sums_the_steps_up_to_the_first_eval_reaching_it():
    stats = {"curve": [(0, 0.2), (2, 0.5), (4, 0.7)],
             "seconds": [(1, (10.0, 4.0)), (2, (12.0, 5.0)), (3, (9.0, 3.0)), (4, (11.0, 6.0))]}
    assert time_to(stats, 0.5) == (22.0, 9.0)        # reached at step 2
    assert time_to(stats, 0.7) == (42.0, 18.0)
    assert time_to(stats, 0.1) == (0, 0)             # the base model already had it
    assert time_to(stats, 0.9) == (None, None) and time_to(stats, None) == (None, None)


@pytest.mark.slow
def test_quick_compare_runs_every_arm(tiny_model, tmp_path):
    # two runs at once, each on its own local Ray: the suite's slowest test, mostly start-up
    # (imports in every actor process) that a second run overlaps; and --parallel gets run
    proc = subprocess.run([sys.executable, "bench/compare.py", "--quick", "--parallel", "2",
                           "--model", str(tiny_model), "--out", str(tmp_path)], cwd=REPO,
                          env=train_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (out,) = tmp_path.glob("compare-*")
    result = json.loads((out / "compare.json").read_text())
    ran = {a.name for a in ARMS if a.default} - {m["arm"] for m in result["missing"]}
    assert {"dense", "naive_sparse", "sparse_rl"} <= ran
    assert {r["arm"] for r in result["rows"]} == ran and not result["failed"]
    for row in result["rows"]:
        assert ROW_KEYS <= set(row) and row["budget"] == 16 and row["seed"] == 0
        assert 0.0 <= row["acc_dense_decode"] <= 1.0 and 0.0 <= row["acc_sparse_decode"] <= 1.0
    by_arm = {r["arm"]: r for r in result["rows"]}
    assert by_arm["dense"]["kv_bytes_vs_dense"] == 1.0
    assert by_arm["dense"]["agreement_p5"] == pytest.approx(1.0)   # no mismatch without eviction
    assert by_arm["sparse_rl"]["kv_bytes_vs_dense"] < 1.0          # R-KV at 16 evicted
    assert by_arm["naive_sparse"]["agreement_p5"] < 1.0
    # nothing is rejected without a correction: no signal leaves the loss
    assert by_arm["naive_sparse"]["signal_dropped_neg"] == by_arm["dense"]["signal_dropped_pos"] == 0
    md = (out / "compare.md").read_text()
    assert all(f"| {arm} | 16 |" in md for arm in ran)
    # The comparison pins its CPU kernels (common/cpu_isa.py) and records them beside the digest.
    kernels = "AVX2" if has_avx2() else torch.backends.cpu.get_cpu_capability()
    assert result["base"] == {"path": str(tiny_model), "sha256": weights_digest(tiny_model),
                              "cpu_capability": kernels}
    assert f"weights sha256 `{result['base']['sha256']}`" in md
    assert all(f"missing arm `{m['arm']}`" in md for m in result["missing"])
    titles = json.loads(Image.open(out / "compare.png").info["Description"])["panels"]
    assert any("held-out accuracy" in t for t in titles)
    assert (out / "report-b16" / "report.png").is_file()


def test_an_override_that_a_run_would_replace_is_refused_by_name(capsys):
    """The runs' own keys come after the user's overrides: an override of one would be lost."""
    for argv, key in ((["--arms", "sparse_rl", "--", "correction.method=tis"], "correction.method"),
                      (["--", "run.seed=3"], "run.seed"),
                      (["--steps", "5", "--", "run.steps=7"], "run.steps")):
        with pytest.raises(SystemExit):
            parse(argv)
        assert key in capsys.readouterr().err
    ok = parse(["--arms", "sparse_rl", "--", "correction.rejection.veto_threshold=0",
                "run.steps=7"])
    assert ok.overrides == ["correction.rejection.veto_threshold=0", "run.steps=7"]
    # a key only another arm sets is fine when that arm does not run
    assert parse(["--arms", "dense", "--", "rollout.kv.budget=40"]).arms == ["dense"]


def test_re_planner_overrides_go_to_the_dynamic_arm_alone(capsys):
    """A static run refuses a key only the re-planner reads; compare gives those to the dynamic
    arm and the rest to every arm, and refuses them when no arm is dynamic."""
    argv = ["--arms", "sparse_rl,sparse_rl_dynamic", "--budgets", "40", "--",
            "rollout.kv.protect_prompt=true", "rollout.kv.quantile=0.01",
            "rollout.kv.replan_every=10"]
    args = parse(argv)
    assert args.replan == ["rollout.kv.quantile=0.01", "rollout.kv.replan_every=10"]
    jobs, _ = plan([a for a in ARMS if a.name in args.arms], args.budgets, [0], "rkv", args.replan)
    by_arm = {j["arm"]: j["overrides"] for j in jobs}
    assert set(args.replan) <= set(by_arm["sparse_rl_dynamic"])
    assert not set(args.replan) & set(by_arm["sparse_rl"])
    with pytest.raises(SystemExit):
        parse(["--arms", "dense,sparse_rl", "--", "rollout.kv.threshold=0.75"])
    assert "rollout.kv.threshold=0.75: only the dynamic schedule's re-planner" in \
        capsys.readouterr().err


def test_the_tis_comparator_runs_only_when_named():
    assert "tis" not in parse([]).arms
    assert set(parse([]).arms) == {a.name for a in ARMS} - {"tis", "sparse_rl_adaptive"}
    args = parse(["--arms", "tis,naive_sparse", "--budgets", "40"])
    jobs, missing = plan([a for a in ARMS if a.name in args.arms], args.budgets, [0], "snapkv")
    (tis,) = [j for j in jobs if j["arm"] == "tis"]
    assert not missing and tis["budget"] == 40
    assert set(tis["overrides"]) == {"rollout.kv.policy=snapkv", "rollout.kv.budget=40",
                                     "correction.method=tis"}


def test_the_adaptive_arm_runs_only_when_named_with_its_share_and_floor(capsys):
    assert "sparse_rl_adaptive" not in parse([]).arms
    args = parse(["--arms", "sparse_rl_adaptive", "--budgets", "90", "--keep-mass", "0.9"])
    jobs, missing = plan([a for a in ARMS if a.name in args.arms], args.budgets, [0], "rkv",
                         args.replan, args.keep_mass, args.min_budget_share)
    (job,) = jobs
    assert not missing and set(job["overrides"]) == {
        "rollout.kv.policy=rkv", "rollout.kv.budget=90", "correction.method=sparse_rl",
        "rollout.kv.keep_mass=0.9", "rollout.kv.min_budget=45"}
    for bad, flag in ((["--policy", "h2o"], "--policy"), (["--keep-mass", "1"], "--keep-mass"),
                      (["--min-budget-share", "0"], "--min-budget-share")):
        with pytest.raises(SystemExit):
            parse(["--arms", "sparse_rl_adaptive"] + bad)
        assert flag in capsys.readouterr().err
    assert parse(["--arms", "sparse_rl", "--policy", "h2o"]).policy == "h2o"   # not named: fine


def test_final_models_are_scored_on_more_problems_for_the_reasoning_task(capsys):
    """128 problems rank the reasoning arms no better than noise: its final decode takes 1024."""
    from bench.compare import REASONING_FINAL_PROBLEMS
    from bench.compare_eval import markdown

    assert parse(["--task", "reasoning"]).final_problems == REASONING_FINAL_PROBLEMS
    assert parse([]).final_problems is None                 # running_sum: the runs' own set
    assert parse(["--task", "reasoning", "--final-problems", "256"]).final_problems == 256
    with pytest.raises(SystemExit):
        parse(["--final-problems", "0"])
    assert "--final-problems" in capsys.readouterr().err
    result = {"command": "c", "wall_s": 1, "budgets": [40], "seeds": [0], "summary": [],
              "missing": [], "failed": [], "rows": [{"acc_problems": 1024}]}
    assert "held-out accuracy on 1024 held-out problems" in markdown(result)


def test_every_project_module_the_driver_imports_late_is_imported_at_its_start():
    """compare.main imports compare.LATE_IMPORTS first; every function-level import of a project
    module in bench/compare.py and bench/compare_eval.py must be among them."""
    import ast
    import importlib

    repo = Path(__file__).resolve().parent.parent
    late = set()
    for script in ("bench/compare.py", "bench/compare_eval.py"):
        tree = ast.parse((repo / script).read_text())
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.module:
                    late.add(node.module)
                elif isinstance(node, ast.Import):
                    late.update(a.name for a in node.names)
    ours = {m for m in late if (repo / m.split(".")[0] / "__init__.py").exists()}
    assert ours and ours <= set(compare.LATE_IMPORTS), sorted(ours - set(compare.LATE_IMPORTS))
    for name in compare.LATE_IMPORTS:
        importlib.import_module(name)


def test_the_base_digest_follows_the_weights_and_names_a_directory_without_them(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 100)
    (tmp_path / "config.json").write_text("{}")
    first = weights_digest(tmp_path)
    assert len(first) == 16 and weights_digest(tmp_path) == first
    (tmp_path / "config.json").write_text('{"a": 1}')              # not a weight file
    assert weights_digest(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 99 + b"\x01")
    assert weights_digest(tmp_path) != first
    with pytest.raises(SystemExit, match="no \\*.safetensors"):
        weights_digest(tmp_path / "missing")
