"""Observability: TensorBoard event files hold every metrics.jsonl scalar, progress bars only on a
terminal, wandb optional and refused clearly when missing, Ray gauges, and `train.py --help`."""
from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from common.errors import ConfigError
from launch.config import RunConfig, TrainConfig, load_config
from launch.helptext import config_keys, field_comments, first_sentence
from launch.observe import HEADLINE, Sinks, bar, progress_on, scalars
from launch.metrics import MetricsLog

REPO = Path(__file__).resolve().parent.parent


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} read back with tensorboard's own event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_metrics_log_writes_every_scalar_to_tensorboard(tmp_path):
    log = MetricsLog(tmp_path, RunConfig(progress=False))
    records = [{"step": 0, "eval/accuracy": 0.25, "resumed_from": ""},
               {"step": 1, "reward": 0.5, "mismatch/k3": 0.01, "batch/logprob_lengths_match": True,
                "batch/staleness_max": 0},
               {"step": 2, "reward": 0.75, "mismatch/k3": 0.02, "eval/accuracy": 0.5}]
    for r in records:
        log.write(r)
    log.close()
    tb = read_scalars(tmp_path / "tensorboard")
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # every numeric key of metrics.jsonl is a TensorBoard tag, with the same values and steps
    for line in lines:
        for key, value in scalars(line).items():
            assert (line["step"], pytest.approx(value)) in tb[key], key
    assert tb["reward"] == [(1, 0.5), (2, 0.75)]
    assert tb["batch/logprob_lengths_match"] == [(1, 1.0)]
    assert "resumed_from" not in tb and "step" not in tb  # strings and the step itself are not


def test_tensorboard_off_writes_no_events(tmp_path):
    log = MetricsLog(tmp_path, RunConfig(tensorboard=False, progress=False))
    log.write({"step": 1, "reward": 1.0})
    log.close()
    assert not (tmp_path / "tensorboard").exists()
    assert (tmp_path / "metrics.jsonl").read_text().count("reward") == 1


def test_progress_only_on_a_terminal():
    assert not progress_on(True, io.StringIO())       # a log file, a CI capture
    assert not progress_on(False, FakeTTY())          # run.progress=false
    assert progress_on(True, FakeTTY())
    assert bar(10, "x", True, io.StringIO()) is None
    out = FakeTTY()
    b = bar(4, "eval heldout", True, out)
    b.update(4)
    b.close()
    assert "eval heldout" in out.getvalue() and "0/4" in out.getvalue()  # drawn, then cleared


def test_step_line_printed_without_a_bar_off_a_terminal(tmp_path, capsys):
    log = MetricsLog(tmp_path, RunConfig(tensorboard=False))  # progress on, but stderr is captured
    steps = list(log.steps(3, 5))
    log.write({"step": 3, "reward": 0.5, "loss": 0.25}, show=("step", "reward"))
    log.close()
    out = capsys.readouterr()
    assert steps == [3, 4, 5]
    assert out.out == "step=3 reward=0.5\n"
    assert out.err == ""                              # no bar, no carriage returns


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_refused_clearly_when_not_installed():
    with pytest.raises(ConfigError) as e:
        load_config(["run.wandb=true"])
    assert "run.wandb" in str(e.value) and "pip install wandb" in str(e.value)
    assert load_config(["run.wandb=false"]).run.wandb is False


def test_ray_gauges_set_once_ray_is_up(tmp_path, local_ray):
    sinks = Sinks(tmp_path, tensorboard=False, name="r1")
    sinks.write({"step": 1, "reward": 0.5, "mismatch/agreement_p5": 0.9})
    assert set(sinks._gauges) == set(HEADLINE)        # created after ray.init, not before
    sinks.close()


def test_no_gauges_without_ray(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    sinks = Sinks(tmp_path, tensorboard=False)
    sinks.write({"step": 1, "reward": 0.5})
    assert sinks._gauges is None


def test_help_lists_every_key_with_default_and_exits_0(tmp_path):
    proc = subprocess.run([sys.executable, "launch/train.py", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("sparse-rl training")
    lines = proc.stdout.splitlines()
    keys = config_keys(TrainConfig)
    assert len(keys) > 100
    for key, default, desc in keys:
        (line,) = [x for x in lines if x.startswith(f"  {key} = ")]
        assert line.split(" = ", 1)[1].startswith(default)
        assert "# " in line and desc in line
    # exactly the keys the config takes (OmegaConf's view of the same dataclasses)
    assert {k for k, _, _ in keys} == leaf_keys(OmegaConf.structured(TrainConfig))
    line = next(x for x in lines if x.startswith("  run.steps = "))
    assert "20" in line and "learner steps" in line
    assert "[sync|async]" in next(x for x in lines if x.startswith("  run.mode = "))


def leaf_keys(node, prefix: str = "") -> set[str]:
    out = set()
    for k in node.keys():
        child = node._get_node(k)
        if OmegaConf.is_dict(child) and OmegaConf.get_type(child) is not dict:  # a section
            out |= leaf_keys(child, f"{prefix}{k}.")
        else:
            out.add(f"{prefix}{k}")
    return out


def test_field_comments_trailing_and_above():
    c = field_comments(RunConfig)
    assert c["steps"].startswith("learner steps")
    assert c["rollouts_ahead"].startswith("async only")   # the comment block above the field
    assert "log_every" in c and "seed" in c
    assert first_sentence("A one. Two.") == "A one."
    assert first_sentence("k+1 .. k+s are fine") == "k+1 .. k+s are fine"


def test_batch_metrics_rollout_throughput_from_engine_time():
    import pyarrow as pa

    from launch.metrics import batch_metrics

    batch = pa.table({"reward": [1.0, 0.0], "response_len": [3, 5], "kept_ratio": [0.5, 1.0],
                      "sampler_logprobs": [[0.0] * 3, [0.0] * 5],
                      "old_logprobs": [[0.0] * 3, [0.0] * 5], "policy_version": [1, 1],
                      "scorer_version": [1, 1],
                      "gen_time_s": [0.25, 0.25],    # each row's share of one 0.5 s engine call
                      "peak_kv_bytes": [1000, 3000]})
    m = batch_metrics(batch, 2)
    assert m["rollout/kv_bytes_per_seq"] == 2000.0
    old_rows = batch.set_column(batch.schema.get_field_index("peak_kv_bytes"), "peak_kv_bytes",
                                pa.nulls(2, pa.int64()))   # segments written before the column
    assert "rollout/kv_bytes_per_seq" not in batch_metrics(old_rows, 2)
    assert m["batch/response_tokens"] == 8 and m["time/rollout_gen_s"] == pytest.approx(0.5)
    assert m["rollout/tokens_per_s"] == pytest.approx(16.0)
    assert m["reward"] == 0.5 and m["batch/staleness_max"] == 0


def test_rollout_kv_vs_dense_counts_every_token_of_the_rows_that_carry_a_peak():
    import pyarrow as pa

    from launch.metrics import batch_metrics, kv_vs_dense

    batch = pa.table({"reward": [1.0, 0.0, 0.0], "response_len": [3, 5, 7],
                      "prompt_len": [2, 3, 4], "kept_ratio": [0.5, 1.0, 1.0],
                      "sampler_logprobs": [[0.0] * 3, [0.0] * 5, [0.0] * 7],
                      "old_logprobs": [[0.0] * 3, [0.0] * 5, [0.0] * 7],
                      "policy_version": [1, 1, 1], "scorer_version": [1, 1, 1],
                      "gen_time_s": [0.1, 0.1, 0.1],
                      "peak_kv_bytes": pa.array([40, 60, None], pa.int64())})
    # rows 0 and 1 carry a peak: (40 + 60) bytes over (2 + 3 + 3 + 5) tokens x 10 bytes
    assert kv_vs_dense(batch, 10) == pytest.approx(100 / 130)
    m = batch_metrics(batch, 2, kv_bytes_per_token=10)
    assert m["rollout/kv_vs_dense"] == pytest.approx(100 / 130)
    assert "rollout/kv_vs_dense" not in batch_metrics(batch, 2)   # no bytes per token given


def test_summary_prints_the_rollout_kv_beside_the_accuracy(tmp_path, capsys):
    log = MetricsLog(tmp_path, RunConfig(tensorboard=False, progress=False))
    log.write({"step": 1, "rollout/kv_bytes_per_seq": 2048.0, "rollout/kv_vs_dense": 0.25})
    log.write({"step": 2, "rollout/kv_bytes_per_seq": 4096.0, "rollout/kv_vs_dense": 0.35})
    log.write({"step": 2, "eval/accuracy": 0.5})                 # records without KV: not counted
    log.summary({"steps": 2, "version": 2, "time_s": 1.0, "accuracy_before": 0.25,
                 "accuracy_after": 0.5, "eval_after": {"eval/accuracy": 0.5}})
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == ("rollout KV: 3 KiB per sequence at peak, 0.30 of a dense cache "
                         "(mean over 2 steps)")
    assert lines[-1] == "held-out accuracy: 0.25 -> 0.50"
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["rollout_kv_vs_dense"] == pytest.approx(0.30)
    assert saved["rollout_kv_bytes_per_seq"] == 3072.0


def test_summary_reports_the_correction_shares_and_the_step_line_the_vetoed_share(tmp_path,
                                                                                 capsys):
    # at a budget too tight for the policy the veto takes most of a batch: the step line and the
    # summary say so, so a run that learns from little is not read as a hard task
    from launch.metrics import STEP_COLUMNS

    log = MetricsLog(tmp_path, RunConfig(tensorboard=False, progress=False))
    log.write({"step": 1, "reward": 0.5, "correction/frac_vetoed": 0.9,
               "correction/frac_rejected": 0.02}, show=STEP_COLUMNS)
    log.write({"step": 2, "reward": 0.5, "correction/frac_vetoed": 1.0,
               "correction/frac_rejected": 0.04})
    log.write({"step": 2, "eval/accuracy": 0.5})            # records without them: not counted
    log.summary({"steps": 2, "version": 2, "time_s": 1.0, "accuracy_before": 0.25,
                 "accuracy_after": 0.5, "eval_after": {"eval/accuracy": 0.5}})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "step=1 reward=0.5 correction/frac_vetoed=0.9"
    assert lines[-2] == ("correction: 95.0% of sequences vetoed, 3.0% of tokens rejected "
                         "(mean over 2 steps)")
    assert lines[-1] == "held-out accuracy: 0.25 -> 0.50"
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["correction_frac_vetoed"] == pytest.approx(0.95)
    assert saved["correction_frac_rejected"] == pytest.approx(0.03)


def test_summary_counts_the_steps_under_the_kept_share_floor(tmp_path, capsys):
    log = MetricsLog(tmp_path, RunConfig(tensorboard=False, progress=False))
    for step, floored in ((1, 0.0), (2, 1.0), (3, 1.0)):
        log.write({"step": step, "correction/frac_vetoed": 0.5, "correction/frac_rejected": 0.0,
                   "correction/batch_floored": floored})
    log.summary({"steps": 3, "version": 3, "time_s": 1.0, "accuracy_before": 0.25,
                 "accuracy_after": 0.25, "eval_after": {"eval/accuracy": 0.25}})
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == ("correction: 50.0% of sequences vetoed, 0.0% of tokens rejected (mean "
                         "over 3 steps); 2 of 3 steps under rejection.min_kept_share, no "
                         "optimizer step")
    assert json.loads((tmp_path / "summary.json").read_text())["correction_steps_floored"] == 2


def test_summary_without_rollout_kv_prints_no_kv_line(tmp_path, capsys):
    log = MetricsLog(tmp_path, RunConfig(tensorboard=False, progress=False))
    log.summary({"steps": 0, "version": 0, "time_s": 1.0, "accuracy_before": 0.25,
                 "accuracy_after": 0.25, "eval_after": {"eval/accuracy": 0.25}})
    out = capsys.readouterr().out
    assert "rollout KV" not in out and "correction:" not in out   # no step logged either
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert "rollout_kv_vs_dense" not in saved and "correction_frac_vetoed" not in saved
