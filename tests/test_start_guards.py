"""Guards before the first step: resume= refuses a checkpoint of another task or model, SIGTERM
ends a run that has not started a step (later it waits for the step's checkpoint), and a run that
ends before its first step leaves no run folder."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

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


@pytest.mark.parametrize("started, how", [(False, "raise SystemExit(2)"),
                                          (False, "os.kill(os.getpid(), signal.SIGTERM)"),
                                          (False, "raise RuntimeError('an actor failed')"),
                                          (True, "raise RuntimeError('a step failed')")])
def test_a_run_folder_is_removed_unless_a_step_started(tmp_path, started, how):
    run_dir = tmp_path / "r-1"
    script = (f"import os, signal, time\nfrom pathlib import Path\nfrom launch import checkpoint\n"
              f"stop = checkpoint.StopRequest()\nrun_dir = Path({str(run_dir)!r})\n"
              f"run_dir.mkdir()\n(run_dir / 'config.yaml').write_text('x')\n"
              f"stop.discard_until_started(run_dir)\n"
              f"{'stop.steps_started()' if started else ''}\n{how}\ntime.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert run_dir.exists() == started, proc.stderr[-2000:]
