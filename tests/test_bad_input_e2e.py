"""Bad input as a new user meets it: 2-step runs of launch/train.py on the tiny base, each ending
in exit 2 and one line naming the key, file or value, with no traceback and, where the input can be
checked before Ray's actors, no run folder."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL_JOB, train_env

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _fails(tmp_path: Path, *args: str, folder: bool = False) -> str:
    """Run 2 steps with ``args``; assert exit 2, one error line, no traceback; return stderr."""
    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "launch/train.py", "run.steps=2", *SMALL_JOB,
                           f"run.out_dir={out}", *args], cwd=REPO, env=train_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    err = proc.stderr
    assert proc.returncode == 2, proc.stdout[-2000:] + err[-3000:]
    assert "Traceback" not in err
    assert [x for x in err.splitlines() if x.startswith("error: ")], err[-2000:]
    assert (out.exists() and any(out.iterdir())) == folder, \
        list(out.iterdir()) if out.exists() else None
    return err


@pytest.fixture()
def copy(tiny_model, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(tiny_model, out)
    return out


def test_garbage_config_json(copy, tmp_path):
    (copy / "config.json").write_text("{not json")
    err = _fails(tmp_path, f"rollout.model_path={copy}")
    assert "rollout.model_path" in err and "config.json:1:2" in err


def test_config_without_weights(copy, tmp_path):
    for f in copy.glob("*.safetensors"):
        f.unlink()
    err = _fails(tmp_path, f"rollout.model_path={copy}")
    assert "rollout.model_path" in err and "weights" in err


def test_dataset_with_invalid_utf8(tiny_model, tmp_path):
    data = tmp_path / "d.jsonl"
    good = json.dumps({"prompt": "Sum 1 2:", "label": "3"}).encode() + b"\n"
    data.write_bytes(good * 5 + b'{"prompt": "\xff", "label": "1"}\n' + good * 5)
    task = ["task.name=dataset", f"task.path={data}", "task.n_heldout=2"]
    err = _fails(tmp_path, f"rollout.model_path={tiny_model}", *task)
    assert "d.jsonl:6: invalid UTF-8" in err


def test_plan_a_local_ray_cannot_place(tiny_model, tmp_path):
    err = _fails(tmp_path, f"rollout.model_path={tiny_model}", "cluster.num_cpus=1")
    assert "'cluster.num_cpus': got 1" in err and "CPU 1.85 in all" in err and "has 1 in total" in err


def test_gpus_the_machine_does_not_have(tiny_model, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    err = _fails(tmp_path, f"rollout.model_path={tiny_model}", "cluster.rollout_gpus=1")
    assert "'cluster.rollout_gpus': got 1.0" in err and "GPU 2 in all" in err


def test_placement_timeout_is_the_backstop(tiny_model, tmp_path):
    """Actors not up within cluster.placement_timeout_s end the run (here: too short to load);
    the run folder, made before the actors, is removed: the run never started a step."""
    err = _fails(tmp_path, f"rollout.model_path={tiny_model}", "cluster.placement_timeout_s=0.01")
    assert "cluster.placement_timeout_s" in err and "still not placed" in err
