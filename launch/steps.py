"""Small pieces the training script calls: prompt order, fan-out over actor pools, eval, metrics log.

Kept out of ``launch/train.py`` so that file reads as the data flow and nothing else.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path


class PromptSampler:
    """Deterministic epochs over the training problems: shuffled per epoch from ``seed``.

    ``position`` (epoch, index) is the data position a checkpoint stores for exact resume.
    """

    def __init__(self, problems: list, per_step: int, seed: int):
        if not problems:
            raise ValueError("the task has no training problems (task.n_train?)")
        self.problems, self.per_step, self.seed = problems, per_step, seed
        self.epoch, self.index = 0, 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> list:
        out = []
        while len(out) < self.per_step:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            out.append(self.problems[self._order[self.index]])
            self.index += 1
        return out

    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}


def split(items, n: int) -> list:
    """``items`` in ``n`` contiguous, nearly equal chunks (some may be empty when n > len)."""
    k, r = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + k + (1 if i < r else 0)
        out.append(items[start:end])
        start = end
    return out


def split_rows(batch, n: int) -> list:
    """Contiguous row slices of an Arrow batch, one per actor (empty slices left out)."""
    out, start = [], 0
    for part in split(range(batch.num_rows), n):
        if len(part):
            out.append(batch.slice(start, len(part)))
        start += len(part)
    return out


def split_groups(batch, n: int) -> list:
    """Whole groups per data-parallel learner: GRPO advantages are computed within a group."""
    import pyarrow as pa
    import pyarrow.compute as pc

    groups = pc.unique(batch.column("group_id")).to_pylist()
    parts = split(groups, n)
    if any(not g for g in parts):
        raise ValueError(f"{len(groups)} groups cannot feed {n} learners: raise run.prompts_per_step "
                         f"to at least learner.num_learners")
    return [batch.filter(pc.is_in(batch.column("group_id"), pa.array(g))) for g in parts]


def launch(actors: list, method: str, items: list, *args) -> list:
    """Start ``method(chunk, *args)`` on each actor with its share of ``items``; returns the refs."""
    return [getattr(a, method).remote(chunk, *args)
            for a, chunk in zip(actors, split(items, len(actors))) if chunk]


def gather(refs: list) -> list:
    """Wait for ``launch``'s calls; their result lists, concatenated in actor order."""
    import ray

    return [row for part in ray.get(refs) for row in part]


def batch_metrics(batch, learner_version: int) -> dict:
    """Reward, lengths, kept ratio and staleness of a training batch; checks log-prob lengths."""
    import pyarrow.compute as pc

    lengths_ok = all(pc.all(pc.equal(pc.list_value_length(batch.column(c)),
                                     batch.column("response_len"))).as_py()
                     for c in ("sampler_logprobs", "old_logprobs"))
    lag = learner_version - 1 - batch.column("policy_version").to_numpy()  # version trained on
    return {"reward": float(pc.mean(batch.column("reward")).as_py()),
            "response_len": float(pc.mean(batch.column("response_len")).as_py()),
            "kept_ratio": float(pc.mean(batch.column("kept_ratio")).as_py()),
            "batch/logprob_lengths_match": lengths_ok,
            "batch/staleness_mean": float(lag.mean()), "batch/staleness_max": int(lag.max())}


def evaluate(rollout_actors: list, problems: list, greedy: bool) -> float:
    """Held-out accuracy over all actors (weighted by how many problems each scored)."""
    import ray

    results = ray.get(launch(rollout_actors, "evaluate", problems, greedy))
    total = sum(r["num_problems"] for r in results)
    return sum(r["accuracy"] * r["num_problems"] for r in results) / max(total, 1)


class MetricsLog:
    """One JSON object per line in ``run_dir/metrics.jsonl`` and a short line on stdout."""

    def __init__(self, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._f = self.path.open("a")
        self.t0 = time.time()

    def write(self, record: dict, show: tuple[str, ...] = ()) -> None:
        record = {"time_s": round(time.time() - self.t0, 2), **record}
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if show:
            parts = [f"{k}={_fmt(record[k])}" for k in show if k in record]
            print(" ".join(parts), flush=True)

    def close(self) -> None:
        self._f.close()


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
