"""Checkpoints and exact resume of ``launch/train.py``: a run stopped part-way (SIGTERM, or SIGKILL
after a periodic checkpoint) and resumed with ``resume=DIR`` trains on the same samples, at the same
policy versions, with the same losses, as an uninterrupted run with the same seed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SMALL_JOB, train_env

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
STEPS = 4


def _args(model: Path, out: Path, mode: str, *extra: str) -> list[str]:
    return [sys.executable, "launch/train.py", f"rollout.model_path={model}", f"run.steps={STEPS}",
            f"run.mode={mode}", *SMALL_JOB, f"run.out_dir={out}", "run.name=r", *extra]


def _run(args: list[str], home: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=REPO, env=train_env(home), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _interrupt(args: list[str], home: Path, out: Path, after_step: int, sig: int) -> int:
    """Start a run, wait until ``after_step`` is trained, send ``sig``; returns the exit code."""
    proc = subprocess.Popen(args, cwd=REPO, env=train_env(home), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if len(_trained(out)) >= after_step:
            break
        time.sleep(0.2)
    assert proc.poll() is None, f"the run ended before step {after_step}:\n{proc.stdout.read()[-3000:]}"
    if sig == signal.SIGKILL:  # the whole session: the driver and the local Ray it started
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.send_signal(sig)
    out_text = proc.communicate(timeout=300)[0]
    assert sig == signal.SIGKILL or proc.returncode == 143, out_text[-3000:]
    return proc.returncode


def _trained(out: Path) -> list[dict]:
    files = [f for f in sorted(out.glob("r-*/trained_samples.jsonl"))]
    return [json.loads(x) for f in files for x in f.read_text().splitlines()]


def _losses(out: Path) -> dict[int, float]:
    recs = [json.loads(x) for d in sorted(out.glob("r-*"))
            for x in (d / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.mark.parametrize("mode,sig", [("async", signal.SIGTERM), ("sync", signal.SIGKILL)])
def test_stopped_and_resumed_run_matches_uninterrupted(tiny_model, tmp_path, mode, sig):
    full = tmp_path / "full"
    _run(_args(tiny_model, full, mode), tmp_path)
    part = tmp_path / "part"
    extra = ["run.checkpoint_every=2"] if sig == signal.SIGKILL else []
    _interrupt(_args(tiny_model, part, mode, *extra), tmp_path, part,
               after_step=3 if sig == signal.SIGKILL else 1, sig=sig)
    (first,) = part.glob("r-*")
    ckpts = sorted((first / "checkpoints").glob("step-*"))
    assert ckpts and not any(c.name.endswith(".partial") for c in ckpts)
    done = json.loads((ckpts[-1] / "trainer_state.json").read_text())["step"]
    assert done < STEPS
    # what the killed run trained after its last checkpoint is redone by the resumed one
    kept = [t for t in _trained(part) if t["step"] <= done]
    (first / "trained_samples.jsonl").write_text("".join(json.dumps(t) + "\n" for t in kept))

    proc = _run([sys.executable, "launch/train.py", f"resume={first}"], tmp_path)
    assert "held-out accuracy: " in proc.stdout
    got, want = _trained(part), _trained(full)
    assert [(t["step"], t["version"]) for t in got] == [(s, s) for s in range(1, STEPS + 1)]
    assert got == want  # same samples, same versions, same order
    want_loss, got_loss = _losses(full), _losses(part)
    assert [got_loss[s] for s in range(1, STEPS + 1)] == pytest.approx(
        [want_loss[s] for s in range(1, STEPS + 1)], rel=1e-5, abs=1e-7)


def test_checkpoint_layout_extend_finished_run_and_bad_resume(tiny_model, tmp_path):
    out = tmp_path / "runs"
    _run(_args(tiny_model, out, "sync", "run.checkpoint_every=1", "run.checkpoint_keep=2"), tmp_path)
    (run_dir,) = out.glob("r-*")
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == [f"step-{STEPS - 1:06d}", f"step-{STEPS:06d}"]  # keep=2: the newest two
    last = run_dir / "checkpoints" / f"step-{STEPS:06d}"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(last / "hf")
    assert sum(p.numel() for p in model.parameters()) > 0
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["step"] == state["version"] == STEPS and not state["next_batch_in_buffer"]
    assert (last / "deepspeed" / "latest").read_text().strip() == f"v{STEPS}"
    assert (last / "buffer").is_dir() and (last / "config.yaml").is_file()

    # a finished run goes on for more steps: resume with a larger run.steps; resume=latest finds
    # this run's newest checkpoint from run.out_dir and run.name (what the RayJob passes)
    proc = _run([sys.executable, "launch/train.py", "resume=latest", f"run.out_dir={out}",
                 "run.name=r", f"run.steps={STEPS + 1}"], tmp_path)
    assert f"resume=latest: {last}" in proc.stdout
    assert f"policy version {STEPS + 1}" in proc.stdout
    assert [t["step"] for t in _trained(out)][-2:] == [STEPS, STEPS + 1]

    bad = subprocess.run([sys.executable, "launch/train.py", f"resume={tmp_path / 'nowhere'}"],
                         cwd=REPO, env=train_env(tmp_path), capture_output=True, text=True)
    assert bad.returncode == 2 and "resume" in bad.stderr and "Traceback" not in bad.stderr
