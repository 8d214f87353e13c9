"""Checkpoints and exact resume of ``launch/train.py``: a run stopped part-way (SIGTERM, or SIGKILL
of the driver after a periodic checkpoint) and resumed with ``resume=DIR`` trains on the same
samples, at the same policy versions, with the same losses, as an uninterrupted run with the same
seed, and no sample twice. A buffer actor killed mid-run is re-created from its segments and the
run goes on, training no sample twice."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
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
    """Start a run, wait until ``after_step`` is trained, send ``sig``; returns the exit code.
    SIGKILL goes to the driver alone, as soon as checkpoint ``after_step`` exists; the Ray
    processes it started are then ended by pid (never ``ray stop``: it kills every Ray here)."""
    proc = subprocess.Popen(args, cwd=REPO, env=train_env(home), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    done = (lambda: any(out.glob(f"r-*/checkpoints/step-{after_step:06d}"))) \
        if sig == signal.SIGKILL else (lambda: len(_trained(out)) >= after_step)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not done():
        time.sleep(0.1)
    assert proc.poll() is None, f"the run ended before step {after_step}:\n{proc.stdout.read()[-3000:]}"
    if sig == signal.SIGKILL:  # Ray's processes keep the output pipe open: end them first
        ray_procs = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        proc.wait(timeout=60)
        _end_by_pid(ray_procs, session=proc.pid)
    else:
        proc.send_signal(sig)
    out_text = proc.communicate(timeout=300)[0]
    assert sig == signal.SIGKILL or proc.returncode == 143, out_text[-3000:]
    return proc.returncode


def _end_by_pid(procs: list, session: int) -> None:
    """SIGKILL what is left of a killed driver's local Ray: the processes it had started and any
    other process of its session (started since, and orphaned); assert that none survives."""
    def in_session(p):
        try:
            return os.getsid(p.pid) == session
        except ProcessLookupError:
            return False
    procs = {p.pid: p for p in procs} | {p.pid: p for p in psutil.process_iter() if in_session(p)}
    for p in procs.values():
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    gone, alive = psutil.wait_procs(list(procs.values()), timeout=30)
    assert not alive, [p.pid for p in alive]


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
               after_step=2 if sig == signal.SIGKILL else 1, sig=sig)
    (first,) = part.glob("r-*")
    ckpts = sorted((first / "checkpoints").glob("step-*"))
    assert ckpts and not any(c.name.endswith(".partial") for c in ckpts)
    done = json.loads((ckpts[-1] / "trainer_state.json").read_text())["step"]
    assert done < STEPS
    # what the killed run trained after its last checkpoint (its weights were lost with it) is
    # redone by the resumed one, with the same samples
    lost = [t for t in _trained(part) if t["step"] > done]
    kept = [t for t in _trained(part) if t["step"] <= done]
    (first / "trained_samples.jsonl").write_text("".join(json.dumps(t) + "\n" for t in kept))

    proc = _run([sys.executable, "launch/train.py", f"resume={first}"], tmp_path)
    assert "held-out accuracy: " in proc.stdout
    got, want = _trained(part), _trained(full)
    ids = [s for t in got for s in t["sample_ids"]]
    assert len(ids) == len(set(ids)) == sum(len(t["sample_ids"]) for t in want)
    assert all(t in got for t in lost)
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


# What a secret in the environment looks like; none may reach the run folder or the output.
SECRETS = {"WANDB_API_KEY": "wandb-0123456789abcdef", "HF_TOKEN": "hf_SeCrEtToKeN42"}


def test_buffer_actor_killed_mid_run_is_recreated_and_nothing_is_trained_twice(tiny_model,
                                                                                tmp_path):
    """SIGKILL of the buffer actor's process once step 1 is trained: the driver's next buffer
    call re-creates it from its segment files; the run completes with every sample trained once
    and ``faults/buffer_restarts`` 1 in the metrics and the summary. Secrets in the environment
    are written nowhere."""
    out = tmp_path / "runs"
    proc = subprocess.Popen(_args(tiny_model, out, "sync"), cwd=REPO,
                            env=train_env(tmp_path) | SECRETS, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not _trained(out):
        time.sleep(0.1)
    buffers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if "ReplayBuffer" in " ".join(p.cmdline())]
    assert len(buffers) == 1, proc.poll()
    buffers[0].kill()
    text = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, text[-3000:]
    assert "[recovery] buffer actor lost" in text

    trained = _trained(out)
    assert [(t["step"], t["version"]) for t in trained] == [(s, s) for s in range(1, STEPS + 1)]
    ids = [s for t in trained for s in t["sample_ids"]]
    assert len(ids) == len(set(ids)) == STEPS * 4 * 4  # prompts_per_step x samples_per_prompt
    (run_dir,) = out.glob("r-*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["faults/buffer_restarts"] == 1 and summary["faults/actor_replacements"] == 0
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["faults/buffer_restarts"] for r in steps if "loss" in r][-1] == 1

    for f in [p for p in run_dir.rglob("*") if p.is_file()]:
        data = f.read_bytes()
        assert not [k for k, v in SECRETS.items() if v.encode() in data], f
    assert not [k for k, v in SECRETS.items() if v in text]
