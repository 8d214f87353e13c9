"""Run checkpoints and exact resume.

``launch/train.py`` writes one every ``run.checkpoint_every`` steps, after the last step and on
SIGTERM; ``python launch/train.py resume=DIR`` continues from it (DIR: a checkpoint folder, or a run
folder whose newest checkpoint is taken). ``resume=latest`` takes the newest checkpoint of the newest
run named ``run.name`` under ``run.out_dir`` and starts fresh (saying so) when there is none yet: the
same command then serves a first submission and every resubmission (KubeRay's RayJob retries,
docs/DEPLOY.md). A checkpoint ``<run_dir>/checkpoints/step-000010/`` holds

    hf/                 the policy in HF format (safetensors; ``from_pretrained`` loads it)
    deepspeed/          every learner rank's DeepSpeed state: module, optimiser moments, LR
                        schedule, ZeRO partitions, the learner's RNG state and its policy version
    buffer/             the replay buffer's segment files: every row not yet trained on
    trainer_state.json  step, policy version, the prompt sampler's position, pre-RL accuracy
    config.yaml         the run's whole config (resume starts from it; command-line keys win)

It is written as ``step-000010.partial`` and renamed when complete, so a run killed while writing
leaves nothing that resume could mistake for a checkpoint.

Why the continuation is exact: rollouts are seeded by (rollout.seed, actor id, batch number) and
the batch number is part of the sampler position, the scorer is deterministic, and the learner's
state is complete. Rollouts already in flight when the checkpoint is taken (the next batch is
launched before the step ends; ``run.rollouts_ahead`` of them) are first landed in the buffer, so
they are kept, not regenerated; ``in_flight`` in trainer_state.json counts them, and the resumed run
treats them as in flight, launching new batches only as they are gathered. (With rollouts_ahead > 1
the versions the batches were generated with depend on timing, so that continuation is not exact.)
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

from common.errors import ConfigError
# what a checkpoint folder holds and where resume= finds one (launch/recovery.py reads it too)
from launch.ckptdir import STATE_FILE, completed, find_checkpoint, latest_checkpoint, missing_parts

LATEST = "latest"  # resume=latest


def load_run_config(argv: list[str]):
    """``load_config`` for a fresh run, or for ``resume=DIR``: the checkpoint's config.yaml, then
    any other presets and overrides on the command line. Returns (config, checkpoint or None)."""
    from launch.config import load_config

    resume = [a for a in argv if a.startswith("resume=")]
    if not resume:
        return load_config(argv), None
    if len(resume) > 1:
        raise ConfigError("resume", resume, "a single resume=DIR or resume=latest")
    rest = [a for a in argv if not a.startswith("resume=")]
    where = resume[0].split("=", 1)[1]
    if where == LATEST:
        fresh = load_config(rest)
        ckpt = latest_checkpoint(fresh.run.out_dir, fresh.run.name)
        if ckpt is None:
            print(f"[resume] resume=latest: no checkpoint of run {fresh.run.name!r} under "
                  f"{fresh.run.out_dir}; starting a fresh run", flush=True)
            return fresh, None
        print(f"[resume] resume=latest: {ckpt}", flush=True)
    else:
        ckpt = find_checkpoint(where)
    cfg = load_config(["--config", str(ckpt / "config.yaml"), *rest])
    saved = load_config(["--config", str(ckpt / "config.yaml")])
    check_same_task(saved, cfg, ckpt)
    check_same_scoring(saved, cfg, ckpt)
    return cfg, ckpt


# What a checkpoint is tied to: its data position indexes the task's problems and its weights have
# the model's shapes. task.eval_sets only adds evaluations, so it may change on resume.
RESUME_FIXED = ("rollout.model_path",)
RESUME_FREE = ("task.eval_sets",)


def check_same_task(saved, cfg, ckpt: Path) -> None:
    """ConfigError naming the first key where ``cfg`` (command line, presets) leaves the
    checkpoint's task or model: resuming there would train another task from this data position."""
    import dataclasses

    keys = [f"task.{f.name}" for f in dataclasses.fields(saved.task)] + list(RESUME_FIXED)
    for key in keys:
        if key in RESUME_FREE:
            continue
        a, b = (_select(c, key) for c in (saved, cfg))
        if a != b:
            raise ConfigError("resume", str(ckpt), f"a checkpoint of this run's task and model: "
                              f"its {key} is {getattr(a, 'value', a)!r}, this run's is "
                              f"{getattr(b, 'value', b)!r}")


def check_same_scoring(saved, cfg, ckpt: Path) -> None:
    """ConfigError when a resume would switch between a scorer pool and none
    (``scorer.num_actors=0``): rows the checkpoint landed may wait for a scorer that is no longer
    there, and the PPO anchor's version would change mid-run. Other pool sizes may change."""
    if (saved.scorer.num_actors == 0) != (cfg.scorer.num_actors == 0):
        raise ConfigError("scorer.num_actors", cfg.scorer.num_actors,
                          f"{'0' if saved.scorer.num_actors == 0 else '>= 1'}, as in the "
                          f"checkpoint {ckpt} (a resumed run keeps where its old log-probs come "
                          "from)")


def _select(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def due(run_cfg, step: int) -> bool:
    """Every ``run.checkpoint_every`` steps and after the last one (0: never, except SIGTERM)."""
    every = run_cfg.checkpoint_every
    return bool(every) and (step % every == 0 or step == run_cfg.steps)


def save(run_dir: Path, cfg, pools, *, step: int, version: int, sampler, accuracy_before: float,
         in_flight: int, faults: dict | None = None) -> Path:
    """Write the checkpoint after ``step`` (every learner rank takes part) and prune old ones.
    ``in_flight``: rollout batches that were in flight and landed in the buffer (resume counts them
    as in flight and launches more only up to ``run.rollouts_ahead``). ``faults``: the fault counts
    (``launch.faults.Faults.state``), so that a resumed run goes on counting."""
    import ray

    from cluster.pools import on_learners
    from launch.config import to_yaml
    from launch.recovery import call

    root = Path(run_dir) / "checkpoints"
    final, part = root / f"step-{step:06d}", root / f"step-{step:06d}.partial"
    if part.exists():
        shutil.rmtree(part)
    part.mkdir(parents=True)
    ray.get([lrn.save_checkpoint.remote(str(part / "deepspeed")) for lrn in pools.learners])
    on_learners(pools, "save_hf", str(part / "hf"))
    # a buffer actor lost half-way is re-created and snapshots again, into an empty folder
    call(pools, "snapshot", str(part / "buffer"),
         on_retry=lambda: shutil.rmtree(part / "buffer", ignore_errors=True))
    (part / "config.yaml").write_text(to_yaml(cfg))
    state = {"step": step, "version": version, "sampler": sampler.position(),
             "accuracy_before": accuracy_before, "next_batch_in_buffer": in_flight > 0,
             "in_flight": int(in_flight),
             "faults": faults or {}}
    (part / STATE_FILE).write_text(json.dumps(state, indent=2))
    missing = missing_parts(part)
    if missing:  # the learners wrote to a folder of that name on their own node
        raise RuntimeError(f"checkpoint {part} lacks {missing} after every part was written: the "
                           f"learners and the driver do not share run.out_dir "
                           f"({cfg.run.out_dir}); put it on storage every node mounts")
    os.replace(part, final)  # a directory rename: the checkpoint appears whole or not at all
    _prune(root, cfg.run.checkpoint_keep)
    return final


def restore(ckpt: Path, pools, sampler) -> dict:
    """Learners (every rank), buffer and prompt position back from ``ckpt``; returns its state.
    Call before the first weight broadcast, so every actor starts from the restored weights."""
    import ray

    state = json.loads((ckpt / STATE_FILE).read_text())
    versions = ray.get([lrn.load_checkpoint.remote(str(ckpt / "deepspeed")) for lrn in pools.learners])
    if any(v != state["version"] for v in versions):
        raise RuntimeError(f"{ckpt}: learner checkpoints hold versions {versions}, "
                           f"{STATE_FILE} says {state['version']}")
    ray.get(pools.buffer.restore.remote(str(ckpt / "buffer")))
    sampler.restore(state["sampler"])
    state.setdefault("in_flight", int(state.get("next_batch_in_buffer", False)))  # older ones
    return state


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    done = completed(root)
    for old in done[:-keep]:
        shutil.rmtree(old)


class StopRequest:
    """Turns SIGTERM (preemption, ``ray job stop``, a pod's termination) into a request the loop
    checks after each step: it checkpoints and exits instead of dying mid-step. Installed after
    ``ray.init``, which sets a SIGTERM handler of its own in the driver.

    Until ``steps_started()`` there is nothing to checkpoint, so SIGTERM ends the run at once
    (SystemExit 143, also out of a ``ray.get`` waiting on an actor that is never placed)."""

    def __init__(self, signals=(signal.SIGTERM,)):
        self.signal: str | None = None
        self.deferred = False
        if threading.current_thread() is threading.main_thread():
            for s in signals:
                signal.signal(s, self._handle)

    def discard_until_started(self, run_dir: Path) -> None:
        """Remove ``run_dir`` if this process ends before ``steps_started`` (a placement timeout,
        SIGTERM, an actor that failed to start): a run that never trained leaves no folder behind.
        Done at exit, when the error has been reported, and after Ray is shut down, so that no
        actor of this run writes into the folder afterwards."""
        atexit.register(self._discard, Path(run_dir))

    def _discard(self, run_dir: Path) -> None:
        if self.deferred or not run_dir.exists():
            return
        ray = sys.modules.get("ray")  # (importing it at exit would fail, and nothing to stop)
        if ray is not None and ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(run_dir)

    def steps_started(self) -> None:
        """From now on a signal waits for the end of the current step (and its checkpoint)."""
        self.deferred = True

    def _handle(self, signum, frame) -> None:
        self.signal = signal.Signals(signum).name
        if not self.deferred:
            print(f"stopped by {self.signal} before the first step", flush=True)
            raise SystemExit(128 + signum)

    def __bool__(self) -> bool:
        return self.signal is not None
