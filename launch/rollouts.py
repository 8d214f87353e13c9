"""Step 6a of ``launch/train.py``: which prompts each step gets, and the rollouts in flight.

``PromptSampler`` orders the training prompts (seeded, resumable); ``fill_rollouts`` keeps the
in-flight queue full (sync: one batch; async: ``run.rollouts_ahead``), ``gather_rollouts`` waits for
the oldest batch (replacing a rollout actor that died), ``land_rollouts`` puts every batch still in
flight into the buffer (before a checkpoint or a resize); without a scorer pool ``own_scores`` makes
the rollout actors' dense pass the rows' old log-probs. ``split``/``launch`` fan work out over a pool.
"""
from __future__ import annotations

import random


class PromptSampler:
    """Deterministic epochs over the training problems: shuffled per epoch from ``seed``.

    ``position`` (epoch, index, requeued) is the data position a checkpoint stores for exact
    resume. Problems handed back by ``requeue`` (``buffer.stale_policy=requeue``: their groups went
    stale) open the next batches, before fresh draws.
    """

    def __init__(self, problems: list, per_step: int, seed: int):
        if not problems:
            raise ValueError("the task has no training problems (task.n_train?)")
        self.problems, self.per_step, self.seed = problems, per_step, seed
        self.epoch, self.index, self.drawn = 0, 0, 0   # drawn: batches handed out so far
        self.requeued: list[int] = []                  # prompt_idx waiting to be drawn again
        self._by_idx = {getattr(p, "idx", p): p for p in problems}
        self._order = self._shuffle(0)

    def requeue(self, prompt_idx: list[int]) -> None:
        """Draw these problems (their ``idx``, the rows' ``prompt_idx``) again, first."""
        unknown = [i for i in prompt_idx if i not in self._by_idx]
        if unknown:
            raise ValueError(f"requeued prompt_idx {unknown[:5]} are not training problems")
        self.requeued += [int(i) for i in prompt_idx]

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> list:
        take = self.requeued[:self.per_step]
        self.requeued = self.requeued[self.per_step:]
        out = [self._by_idx[i] for i in take]
        while len(out) < self.per_step:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            out.append(self.problems[self._order[self.index]])
            self.index += 1
        self.drawn += 1
        return out

    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "drawn": self.drawn,
                "requeued": list(self.requeued)}

    def restore(self, position: dict) -> None:
        """Continue from a ``position()`` (a checkpoint's): the same batches follow."""
        epoch, index = int(position["epoch"]), int(position["index"])
        if not 0 <= index <= len(self.problems):
            raise ValueError(f"sampler position index {index} is outside the {len(self.problems)} "
                             "training problems: the checkpoint comes from another task config")
        self.epoch, self.index, self.drawn = epoch, index, int(position["drawn"])
        self.requeued = []
        self.requeue(position.get("requeued", []))  # older checkpoints have none
        self._order = self._shuffle(epoch)


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


def launch(actors: list, method: str, items: list, *args) -> list:
    """Start ``method(chunk, *args)`` on each actor with its share of ``items``; returns the refs."""
    return [getattr(a, method).remote(chunk, *args)
            for a, chunk in zip(actors, split(items, len(actors))) if chunk]


def launch_rollouts(pools, sampler: PromptSampler, version: int) -> list[tuple]:
    """The sampler's next prompts to the rollout actors, tagged with the batch number, which seeds
    the sampling and names the samples (so a resumed run, or a replacement actor, draws the very
    same ones). Returns one (actor index, chunk, batch, ref) per call, for ``gather_rollouts``.
    With rollouts ahead (``pools.rollouts_ahead > 1``) each actor tags its rows with the version
    of the weights it holds when the call starts (it swaps in staged weights first): that version
    depends on timing, between ``version`` and the learner's version when the batch is gathered."""
    if pools.requeue:  # buffer.stale_policy=requeue: stale groups' prompts are generated again
        from launch.recovery import buffer

        sampler.requeue(buffer(pools).take_requeued())
    problems, batch = sampler.next(), sampler.drawn
    tag = _row_version(pools, version)
    return [(i, chunk, batch, pools.rollout[i].rollout.remote(chunk, tag, batch))
            for i, chunk in enumerate(split(problems, len(pools.rollout))) if chunk]


def _row_version(pools, version: int) -> int | None:
    """The version a rollout call tags its rows with: the driver's, or with rollouts ahead None
    (the actor tags them with the weights it swapped in, which depends on timing)."""
    return version if pools.rollouts_ahead == 1 else None


def fill_rollouts(in_flight, pools, sampler: PromptSampler, version: int, steps: int) -> None:
    """Launch batches until ``in_flight`` (a deque, oldest first) holds ``pools.rollouts_ahead``
    of them, never beyond batch ``steps`` (batch k is trained at step k). Entries may be ``[]``:
    a batch already landed in the buffer (a checkpoint's), gathered as no rows."""
    while len(in_flight) < pools.rollouts_ahead and sampler.drawn < steps:
        in_flight.append(launch_rollouts(pools, sampler, version))


def land_rollouts(in_flight, pools, cfg, version: int, note=None) -> int:
    """Every batch in flight into the buffer (before a checkpoint or a resize); ``in_flight`` then
    holds as many landed (empty) entries, so the run goes on as if they were still running. Returns
    how many batches it holds (``trainer_state.json``'s ``in_flight``: resume refills from it).
    ``note(rows)``: sees each landed batch's rows first (``launch.faults.Faults.note_rewards``)."""
    from launch.recovery import buffer

    n = len(in_flight)
    for calls in list(in_flight):
        rows = gather_rollouts(calls, pools, cfg, version)
        if note is not None:
            note(rows)
        buffer(pools).append(rows)
    in_flight.clear()
    in_flight.extend([] for _ in range(n))
    return n


def gather_rollouts(in_flight: list[tuple], pools, cfg, version: int) -> list:
    """The rows of ``launch_rollouts``' calls, in actor order. When a rollout actor has died, it
    is replaced (``cluster.elastic.replace_dead``: the weight group re-forms and every actor gets
    the learner's current weights) and its chunk is generated again with the same batch number,
    tagged with the current ``version``, whose weights the replacement holds (with rollouts
    ahead: tagged by the actor, like ``launch_rollouts``)."""
    import ray
    from ray.exceptions import RayActorError

    from cluster.elastic import replace_dead

    rows = []
    for i, chunk, batch, ref in in_flight:
        try:
            rows += ray.get(ref)
        except RayActorError as err:
            print(f"[elastic] rollout actor {i} lost ({type(err).__name__}): "
                  f"{replace_dead(pools, cfg)}", flush=True)
            rows += ray.get(pools.rollout[i].rollout.remote(chunk, _row_version(pools, version),
                                                             batch))
    return own_scores(rows) if cfg.scorer.num_actors == 0 else rows


def own_scores(rows: list[dict]) -> list[dict]:
    """Rows of a run without a scorer pool (``scorer.num_actors=0``): each row's dense pass on its
    rollout actor (``dense_sampler_logprobs``: pi_dense at the sampler's version v) becomes its
    old log-probs, scored at v, so the buffer takes the rows as scored (``ReplayBuffer.append``)
    and step 6b has nothing to do."""
    for row in rows:
        row["old_logprobs"] = row.pop("dense_sampler_logprobs")
        row["scorer_version"] = row["policy_version"]
    return rows
