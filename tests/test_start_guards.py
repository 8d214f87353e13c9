"""Guards before the first step: resume= refuses a checkpoint of another task or model, and
SIGTERM ends a run that has not started a step (later it waits for the step's checkpoint)."""
from __future__ import annotations

import os
import signal

import pytest

from common.errors import ConfigError
from launch import checkpoint
from launch.config import load_config, to_yaml


@pytest.fixture()
def ckpt(tmp_path):
    """A checkpoint folder as far as load_run_config reads it: its config and state file, and
    every other part present (empty), since a checkpoint without them is refused."""
    d = tmp_path / "run" / "checkpoints" / "step-000002"
    for folder in ("buffer", "hf", "deepspeed/v2"):
        (d / folder).mkdir(parents=True)
    (d / "hf" / "config.json").write_text("{}")
    (d / "deepspeed" / "latest").write_text("v2")
    (d / "config.yaml").write_text(to_yaml(load_config(["task.name=reverse", "task.seed=3"])))
    (d / checkpoint.STATE_FILE).write_text("{}")
    assert checkpoint.missing_parts(d) == []
    return d


def test_resume_keeps_its_own_task_and_takes_other_keys(ckpt):
    cfg, found = checkpoint.load_run_config([f"resume={ckpt.parent.parent}", "run.steps=9"])
    assert found == ckpt and cfg.task.name.value == "reverse" and cfg.run.steps == 9


@pytest.mark.parametrize("override, key", [
    ("task.name=running_sum", "task.name"), ("task.seed=4", "task.seed"),
    ("rollout.model_path=/elsewhere", "rollout.model_path")])
def test_resume_from_another_task_or_model_is_refused(ckpt, override, key):
    with pytest.raises(ConfigError, match=rf"'resume'.*its {key} is .*, this run's is "):
        checkpoint.load_run_config([f"resume={ckpt}", override])


def test_sigterm_before_the_first_step_exits_after_it_waits():
    old = signal.getsignal(signal.SIGTERM)
    try:
        stop = checkpoint.StopRequest()
        with pytest.raises(SystemExit) as exit_:
            os.kill(os.getpid(), signal.SIGTERM)
        assert exit_.value.code == 143 and stop.signal == "SIGTERM"
        stop = checkpoint.StopRequest()
        stop.steps_started()
        os.kill(os.getpid(), signal.SIGTERM)     # now only recorded: the loop checkpoints
        assert stop and stop.signal == "SIGTERM"
    finally:
        signal.signal(signal.SIGTERM, old)
