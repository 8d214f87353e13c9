"""Actor pools on Ray: rollout, scorer and learner pools sized independently, plus the buffer.

Actors are plain classes (tested without Ray) wrapped here, at the call site, with ``ray.remote``.
Each pool has its own CPU/GPU/custom-resource request from ``ClusterConfig``, so on a KubeRay cluster
the rollout pool can grow on its worker group while the learners stay where they are.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

from cluster import placement
from cluster.ray_setup import actor_options, pinned
from cluster.resources import wait_placed


@dataclass
class Pools:
    rollout: list = field(default_factory=list)
    scorer: list = field(default_factory=list)
    learners: list = field(default_factory=list)
    buffer: object = None
    # actor_id of each rollout actor (parallel to ``rollout``): it seeds the actor's sampling, so a
    # replacement takes over its predecessor's id and regenerates exactly its chunk of a batch
    rollout_ids: list = field(default_factory=list)
    # run.rollouts_ahead in async mode: rollout batches kept in flight (launch.rollouts)
    rollouts_ahead: int = 1
    # buffer.stale_policy=requeue: each rollout launch first takes the buffer's requeued prompts
    requeue: bool = False
    # per pool ("learner", "rollout", "scorer"), each actor's placement-group bundle
    # (cluster/placement.py); empty: actors placed anywhere (pools built by hand in tests)
    slots: dict = field(default_factory=dict)
    # the buffer's segment folder (None: rows in memory only) and how to start a buffer actor on
    # it again; the run folder, whose checkpoints a lost buffer points to (launch/recovery.py)
    buffer_root: str | None = None
    spawn_buffer: Callable | None = None
    run_dir: str | None = None
    # the driver's handle on the buffer that re-creates a lost actor (launch.recovery.buffer)
    recovering_buffer: object = None
    # the training batch the driver holds (sample_batch until mark_consumed): (num_groups,
    # version, sample ids), leased again on a re-created buffer
    buffer_lease: tuple | None = None
    # counts of faults the run survived, in every step's metrics and in the summary
    faults: dict = field(default_factory=lambda: dict.fromkeys(
        ("faults/buffer_restarts", "faults/actor_replacements"), 0))

    @property
    def receivers(self) -> list:
        """Every actor that receives weights from learner rank 0, in weight-sync rank order."""
        return self.rollout + self.scorer


def build_pools(cfg, run_dir: str) -> Pools:
    """Reserve every pool's placement group, then create the learner, buffer, rollout and scorer
    actors (learners first: they hold the GPUs).

    DeepSpeed's group forms on the address learner rank 0 picks on its own node (``listen``), while
    the rollout and scorer actors load their models.
    """
    import ray

    from learner.learner import Learner

    c = cfg.cluster
    requeue = getattr(cfg.buffer.stale_policy, "value", cfg.buffer.stale_policy) == "requeue"
    root = _buffer_root(cfg, run_dir)
    pools = Pools(rollouts_ahead=rollouts_ahead(cfg), requeue=requeue, buffer_root=root,
                  spawn_buffer=functools.partial(spawn_buffer, cfg, root), run_dir=run_dir)
    pools.slots = placement.reserve(cfg, c.placement_timeout_s)  # a pool that never fits: named
    n_learn = cfg.learner.num_learners
    opts = actor_options(c.learner_cpus, c.learner_gpus, c.learner_resources)
    learner_cls = ray.remote(**opts)(pinned(Learner, c.learner_cores))
    pools.learners = [
        learner_cls.options(**placement.options(pools.slots["learner"][r])).remote(
            cfg.learner, cfg.correction, cfg.rollout.model_path, rank=r, world_size=n_learn,
            distill=cfg.rollout.distill_sparse)
        for r in range(n_learn)]
    wait_placed([(f"learner {i}", a) for i, a in enumerate(pools.learners)],
                c.placement_timeout_s)
    addr, port = ray.get(pools.learners[0].listen.remote())
    started = [lrn.start.remote(addr, port) for lrn in pools.learners]
    pools.buffer = pools.spawn_buffer()
    pools.rollout_ids = list(range(cfg.rollout.num_actors))
    pools.rollout = [spawn_rollout(cfg, i, slot_of(pools, "rollout", i)) for i in pools.rollout_ids]
    pools.scorer = [spawn_scorer(cfg, slot_of(pools, "scorer", i))
                    for i in range(cfg.scorer.num_actors)]
    named = [("buffer", pools.buffer)] + [(f"{kind} {i}", a) for kind, group in (
        ("rollout", pools.rollout), ("scorer", pools.scorer)) for i, a in enumerate(group)]
    try:
        wait_placed(named, c.placement_timeout_s)  # an unplaceable actor: an error, not a hang
        ray.get(started)
    except BaseException:  # (SIGTERM too) none may start later and write into the run folder
        for _, actor in named + [(f"learner {i}", a) for i, a in enumerate(pools.learners)]:
            ray.kill(actor, no_restart=True)
        raise
    return pools


def slot_of(pools: Pools, role: str, index: int):
    """Actor ``index``'s bundle in its pool's placement group (None: no group, place anywhere)."""
    slots = pools.slots.get(role, [])
    return slots[index] if index < len(slots) else None


def spawn_buffer(cfg, root: str | None):
    """The replay buffer actor on ``root``: a fresh buffer on an empty folder; on one that holds
    segments (a buffer actor that died) the constructor replays them (``launch.recovery``)."""
    import ray

    from buffer import ReplayBuffer

    c = cfg.cluster
    return ray.remote(**actor_options(c.buffer_cpus, 0.0, c.buffer_resources))(ReplayBuffer).remote(
        cfg.buffer, root)


def rollouts_ahead(cfg) -> int:
    """Rollout batches kept in flight: ``run.rollouts_ahead`` in async mode, else 1."""
    run = getattr(cfg, "run", None)
    mode = getattr(getattr(run, "mode", None), "value", getattr(run, "mode", None))
    return int(getattr(run, "rollouts_ahead", 1)) if mode == "async" else 1


# Every receiver (rollout and scorer actor) has this concurrency group, one thread, for its
# weight-sync calls: they run beside a rollout or scoring call instead of queueing behind it.
WEIGHTS_GROUP = {"weights": 1}


def weights_call(actor, method: str):
    """``actor.method`` in the actor's "weights" concurrency group."""
    return getattr(actor, method).options(concurrency_group="weights")


def spawn_rollout(cfg, actor_id: int, slot=None):
    """One rollout actor with the pool's resources (build_pools, and replacements or growth in
    ``cluster.elastic``: both must place and configure it the same way). Its "weights"
    concurrency group (``WEIGHTS_GROUP``) runs ``init_weight_sync``/``stage_weights``; rollouts
    and everything else stay one call at a time in the default group. ``slot``: its
    placement-group bundle (``cluster.placement``; None: anywhere)."""
    import ray

    from actors.rollout import RolloutActor

    c = cfg.cluster
    opts = actor_options(c.rollout_cpus, c.rollout_gpus, c.rollout_resources)
    opts.update(placement.options(slot))
    cls = ray.remote(max_restarts=c.actor_max_restarts, concurrency_groups=WEIGHTS_GROUP, **opts)(
        pinned(RolloutActor, c.rollout_cores))
    return cls.remote(cfg.rollout, cfg.task, cfg.rollout.model_path, actor_id=actor_id)


def spawn_scorer(cfg, slot=None):
    """One dense scorer actor with the pool's resources (see ``spawn_rollout``).

    With ``correction.loss.kl_coef > 0`` it also holds the reference policy: a frozen copy of
    ``rollout.model_path``, the initial policy, on the scorer's devices. That path is the run's
    base model even on resume (the checkpoint's weights reach the actors only by broadcast, which
    never touches the reference), so resumed runs and replacements keep the same reference."""
    import ray

    from actors.scorer import ScorerActor

    c = cfg.cluster
    opts = actor_options(c.scorer_cpus, c.scorer_gpus, c.scorer_resources)
    opts.update(placement.options(slot))
    cls = ray.remote(max_restarts=c.actor_max_restarts, concurrency_groups=WEIGHTS_GROUP, **opts)(
        pinned(ScorerActor, c.scorer_cores))
    ref = cfg.rollout.model_path if needs_reference(cfg) else None
    return cls.remote(cfg.scorer, cfg.rollout.model_path, cfg.rollout.temperature,
                      ref_model_path=ref, adapter=cfg.rollout.distill_sparse)


def needs_reference(cfg) -> bool:
    """Does the loss need reference log-probs (a KL penalty to the initial policy)?"""
    return float(cfg.correction.loss.kl_coef) > 0


def _buffer_root(cfg, run_dir: str) -> str | None:
    root = getattr(cfg.buffer, "root", None)
    return root if root else f"{run_dir}/buffer"


def connect_weight_sync(pools: Pools, cfg, fresh: bool = False) -> tuple[str, int]:
    """Form the broadcast group: learner rank 0 is rank 0, then each rollout and scorer actor.
    Returns its (host, port): learner rank 0's node IP and a port it bound there
    (``cluster.weight_sync_port``, or a free one when 0 or ``fresh``), which every actor dials.

    Separate from DeepSpeed's own process group (one default group per process): a standalone
    TCPStore + gloo (or NCCL) group that only carries weights. Every member leaves the group it was
    in first, so calling this again re-forms it (``cluster.elastic.reform_weight_sync``, on a fresh
    port). ``cluster.weight_sync_timeout_s`` bounds every wait: a member that died or never
    joins makes the others fail after that long instead of hanging.
    """
    import ray

    c = cfg.cluster
    host, port = ray.get(pools.learners[0].open_weight_sync.remote(
        0 if fresh else c.weight_sync_port))
    world = 1 + len(pools.receivers)
    timeout = float(c.weight_sync_timeout_s)
    backend = getattr(c.weight_sync_backend, "value", c.weight_sync_backend)
    calls = [pools.learners[0].init_weight_sync.remote(host, port, world, backend,
                                                       c.weight_sync_bucket_mb, timeout_s=timeout)]
    calls += [weights_call(a, "init_weight_sync").remote(host, port, rank, world,
                                                        timeout_s=timeout)
              for rank, a in enumerate(pools.receivers, start=1)]
    # every member's answer, not the first error: a failed formation leaves no member still
    # waiting in it (each waits at most the timeout), so a re-formation can follow at once
    ray.wait(calls, num_returns=len(calls))
    ray.get(calls)
    return host, port


def on_learners(pools: Pools, method: str, *args):
    """``method(*args)`` on every learner rank (under ZeRO-3 the weights are partitioned, so
    broadcasts, checksums and HF saves gather them: a collective); returns rank 0's result."""
    import ray

    return ray.get([getattr(lrn, method).remote(*args) for lrn in pools.learners])[0]


def broadcast_weights(pools: Pools, verify: bool = True) -> tuple[int, dict]:
    """Learner rank 0 sends its weights; every receiver stages them (``actors.weights``).

    Returns the version and, with ``verify``, the learner's weight checksum and the largest relative
    difference of any receiver's checksum from it (0.0 when every actor holds the learner's weights).

    Receivers stage in their "weights" concurrency group, beside a rollout or scoring call in
    progress, so this returns as soon as the bytes have landed, never after a running rollout;
    each actor swaps the staged copy in at the start of its next batch. A receiver's checksum is
    its staged copy's, computed where the copy lives, which the swap checks the model against.
    """
    import ray

    sent = [lrn.broadcast_weights.remote() for lrn in pools.learners]  # rank 0 sends
    staged = [weights_call(a, "stage_weights").remote(verify) for a in pools.receivers]
    version = ray.get(sent)[0]
    staged = ray.get(staged)
    versions = [s["version"] for s in staged]
    if any(v != version for v in versions):
        raise RuntimeError(f"weight broadcast version mismatch: learner {version}, actors {versions}")
    if not verify:
        return version, {}
    ref = on_learners(pools, "state_checksum")
    diff = max(abs(s["checksum"] - ref) / max(abs(ref), 1e-12) for s in staged)
    return version, {"weights/checksum": ref, "weights/max_rel_diff": diff}
