"""``resume=latest``: the newest complete checkpoint of the newest run named ``run.name`` under
``run.out_dir``, or a fresh run when there is none, so one command serves a first submission and
every resubmission (the RayJob in cluster/kuberay/rayjob.yaml). Checkpoint folders are made here
as ``launch/checkpoint.save`` lays them out; tests/test_resume.py covers the resume itself."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import ConfigError
from launch import checkpoint
from launch.config import load_config, to_yaml


def _ckpt(out: Path, run: str, step: int, *, partial: bool = False, steps: int = 10) -> Path:
    d = out / run / "checkpoints" / (f"step-{step:06d}" + (".partial" if partial else ""))
    d.mkdir(parents=True)
    name = run.rsplit("-", 2)[0]
    (d / "config.yaml").write_text(to_yaml(load_config([f"run.name={name}", f"run.out_dir={out}",
                                                        f"run.steps={steps}"])))
    (d / checkpoint.STATE_FILE).write_text(json.dumps({"step": step, "version": step}))
    for folder in (f"deepspeed/global_step{step}", "hf", "buffer"):  # every part (checkpoint.PARTS)
        (d / folder).mkdir(parents=True)
    (d / "deepspeed" / "latest").write_text(f"global_step{step}")
    (d / "hf" / "config.json").write_text("{}")
    return d


@pytest.fixture
def runs(tmp_path) -> tuple[Path, Path]:
    out = tmp_path / "runs"
    _ckpt(out, "r-20261101-000000", 2)
    newest = _ckpt(out, "r-20261102-000000", 4)
    _ckpt(out, "r-20261102-000000", 3)
    _ckpt(out, "r-20261102-000000", 6, partial=True)      # killed while writing it
    (out / "r-20261103-000000").mkdir()                   # died before its first checkpoint
    _ckpt(out, "r-other-20261104-000000", 9)              # another run's name starts with r-
    (out / "r-20261105-000000-copy" / "checkpoints" / "step-000011").mkdir(parents=True)
    return out, newest


def test_latest_is_the_newest_complete_checkpoint_of_the_newest_run(runs):
    out, newest = runs
    assert checkpoint.latest_checkpoint(str(out), "r") == newest
    assert checkpoint.latest_checkpoint(str(out), "r-other").name == "step-000009"
    assert checkpoint.latest_checkpoint(str(out), "s") is None
    assert checkpoint.latest_checkpoint(str(out / "nowhere"), "r") is None


def test_run_dir_resume_passes_over_a_partial_checkpoint(runs):
    out, newest = runs
    assert checkpoint.find_checkpoint(str(newest.parent.parent)) == newest


def test_resume_latest_loads_the_checkpoint_config_and_command_line_wins(runs):
    out, newest = runs
    cfg, ckpt = checkpoint.load_run_config(["resume=latest", f"run.out_dir={out}", "run.name=r",
                                            "run.steps=12"])
    assert ckpt == newest and cfg.run.steps == 12 and cfg.run.name == "r"


def test_resume_latest_without_a_checkpoint_starts_fresh_and_says_so(tmp_path, capsys):
    cfg, ckpt = checkpoint.load_run_config(["resume=latest", f"run.out_dir={tmp_path}",
                                            "run.steps=3"])
    assert ckpt is None and cfg.run.steps == 3
    assert "starting a fresh run" in capsys.readouterr().out


def test_two_resumes_are_refused():
    with pytest.raises(ConfigError, match="resume=latest"):
        checkpoint.load_run_config(["resume=latest", "resume=runs/x"])
