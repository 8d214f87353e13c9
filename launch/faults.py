"""Faults during training: poisoned batches are skipped, failed rewards counted, and a run that
only skips stops with an error naming the cause.

Every event is counted (cumulative ``faults/*`` numbers in each step's metrics record and in
``summary.json``), printed as a ``[faults]`` warning naming the cause and the sample ids, and
written to ``<run dir>/faults.jsonl`` (one line per event, every sample id), so nothing is lost
silently:

- a batch with a NaN/inf in the sampler's, scorer's (old), reference or dense-sampler log-probs,
  the rewards (``learner.screen.INPUTS``), or in the advantages / IS weights derived from them, is
  not trained (``faults/skipped/<input>``). Its poisoned groups are retired in the buffer
  (``mark_consumed``: never offered again; ``faults/dropped_samples``), its clean groups given
  back (``release``: a later step trains them, ``faults/released_samples``);
- a learner step whose every optimiser step was refused for a non-finite loss or gradient
  (``learner.guard``; weights and optimiser state untouched) is a skipped step too
  (``faults/skipped/learner_loss`` or ``learner_grad``); its rows are retired (the learner cannot
  tell which of them blew up). Refused optimiser steps of a step that still stepped count in
  ``faults/skipped_optimizer_steps`` only;
- rewards that raised or ran out of time (the rows' ``reward_fault``, ``tasks/rewards.py``):
  ``faults/reward_errors``, ``faults/reward_timeouts``; the run goes on.

``run.max_consecutive_skips`` skipped steps in a row raise ``TrainingFault`` (``launch/train.py``
exits 3 with an ``error:`` line), after writing ``summary.json`` with the counts and the error.
Counts are per run: a resumed run starts from 0.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from common.errors import TrainingFault

SHOWN_IDS = 8   # sample ids in a warning line (faults.jsonl has them all)


class Faults:
    def __init__(self, run_dir: Path, max_consecutive_skips: int, survived: dict | None = None):
        """``survived``: the counts the pools keep of faults they heal themselves
        (``cluster.pools.Pools.faults``: buffer restarts, actor replacements), reported with these."""
        self.run_dir, self.limit = Path(run_dir), int(max_consecutive_skips)
        self.counts: Counter[str] = Counter()
        self.survived = survived if survived is not None else {}
        self.consecutive = 0

    def metrics(self) -> dict[str, int]:
        """Cumulative counts (the headline ones always present, 0 until they happen)."""
        base = {k: 0 for k in ("skipped_steps", "skipped_optimizer_steps", "reward_errors",
                               "reward_timeouts")}
        return {f"faults/{k}": v for k, v in {**base, **self.counts}.items()} | \
            {"faults/consecutive_skips": self.consecutive} | self.survived

    def state(self) -> dict:
        """What a checkpoint keeps (``launch.checkpoint.save``), so a resumed run goes on counting."""
        return {"driver": dict(self.counts), "pools": dict(self.survived)}

    def event(self, step: int, kind: str, cause: str, sample_ids: list[str], **extra) -> None:
        """One ``[faults]`` warning line and one ``faults.jsonl`` record."""
        shown = ", ".join(sample_ids[:SHOWN_IDS]) + (" ..." if len(sample_ids) > SHOWN_IDS else "")
        print(f"[faults] step {step}: {kind}: {cause} ({len(sample_ids)} samples: {shown})",
              flush=True)
        with (self.run_dir / "faults.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "kind": kind, "cause": cause,
                                "sample_ids": sample_ids, **extra}) + "\n")

    def note_rewards(self, step: int, rows: list[dict]) -> None:
        """Count (and name) the rollout rows whose reward function raised or timed out."""
        from tasks.rewards import TIMEOUT

        for name, pick in (("reward_timeouts", lambda f: f == TIMEOUT),
                           ("reward_errors", lambda f: f is not None and f != TIMEOUT)):
            hit = [r for r in rows if pick(r.get("reward_fault"))]
            if hit:
                self.counts[name] += len(hit)
                self.event(step, name.replace("_", " ") + " (reward 0)",
                           hit[0]["reward_fault"], [r["sample_id"] for r in hit])

    def restore(self, state: dict) -> None:
        """The counts of the checkpoint a run resumes from (``state``; older checkpoints: none)."""
        saved = state.get("faults", {})
        self.counts.update(saved.get("driver", {}))
        self.survived.update(saved.get("pools", {}))

    def rewards_of(self, step: int):
        """``note_rewards`` for rows landed outside step 6a (checkpoint, resize)."""
        return lambda rows: self.note_rewards(step, rows)

    def skipped(self, step: int, version: int, cause: str, detail: str) -> None:
        """A step that changed nothing; stops the run at ``run.max_consecutive_skips`` in a row."""
        self.counts["skipped_steps"] += 1
        self.counts[f"skipped/{cause}"] += 1
        self.consecutive += 1
        if self.consecutive < self.limit:
            return
        msg = (f"{self.consecutive} consecutive training steps skipped (run.max_consecutive_skips="
               f"{self.limit}), the last at step {step}: {detail}; see {self.run_dir}/faults.jsonl")
        summary = {"error": msg, "step": step, "version": version, "run_dir": str(self.run_dir),
                   **self.metrics()}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        raise TrainingFault(msg)

    def stepped(self) -> None:
        self.consecutive = 0

    # ---- one training step -----------------------------------------------------------------
    def train(self, pools, cfg, batch, tensors: dict, step: int, version: int
              ) -> tuple[dict, list[str]]:
        """Screen, prepare (``learner.batch.prepare_batch``), screen, shard and train one batch
        on every learner; retire its rows in the buffer. Returns (metrics, the sample ids it
        trained on: none when the step was skipped)."""
        import ray

        from launch.recovery import buffer
        from learner.batch import prepare_batch, reduce_metrics, shard_batch
        from learner.screen import DERIVED, INPUTS, find_poison

        ids = batch.column("sample_id").to_pylist()
        poison = find_poison(tensors, ids, INPUTS)
        if poison is None:
            tensors, corr = prepare_batch(tensors, cfg.correction, version,
                                          cfg.learner.mini_batches)
            poison = find_poison(tensors, ids, DERIVED)
        if poison is not None:
            self._drop_poisoned(pools, batch, poison, step)
            self.skipped(step, version, poison.cause, str(poison))
            return {"faults/step_skipped": 1}, []
        shards = shard_batch(tensors, len(pools.learners))
        metrics = reduce_metrics(ray.get([lrn.train_step.remote(sh, cfg.rollout.temperature)
                                          for lrn, sh in zip(pools.learners, shards)])) | corr
        buffer(pools).mark_consumed(ids)
        refused = int(metrics.get("learner/skipped_steps", 0))
        self.counts["skipped_optimizer_steps"] += refused
        if refused and not metrics.get("learner/optimizer_steps"):
            cause = "learner_loss" if metrics.get("learner/skipped_loss") else "learner_grad"
            self.event(step, "step skipped (weights and optimiser untouched)",
                       f"non-finite {cause[8:]} on a learner", ids)
            self.counts["dropped_samples"] += len(ids)
            self.skipped(step, version, cause, f"non-finite {cause[8:]} in the learner step")
            return metrics | {"faults/step_skipped": 1}, []
        self.stepped()
        return metrics | {"faults/step_skipped": 0}, ids

    def _drop_poisoned(self, pools, batch, poison, step: int) -> None:
        """Retire the groups holding poisoned samples; give the clean groups back."""
        from launch.recovery import buffer

        groups = batch.column("group_id").to_pylist()
        ids = batch.column("sample_id").to_pylist()
        poisoned = set(poison.sample_ids)
        bad = {g for g, s in zip(groups, ids) if s in poisoned}
        drop = [s for g, s in zip(groups, ids) if g in bad]
        keep = [s for g, s in zip(groups, ids) if g not in bad]
        buffer(pools).mark_consumed(drop)
        if keep:
            buffer(pools).release(keep)
        self.counts["dropped_samples"] += len(drop)
        self.counts["released_samples"] += len(keep)
        self.event(step, "batch skipped", f"non-finite {poison.cause}",
                   list(poison.sample_ids), dropped=drop, released=keep)
