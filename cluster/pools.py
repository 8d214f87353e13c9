"""Actor pools on Ray: rollout, scorer and learner pools sized independently, plus the buffer.

Actors are plain classes (tested without Ray) wrapped here, at the call site, with ``ray.remote``.
Each pool has its own CPU/GPU/custom-resource request from ``ClusterConfig``, so on a KubeRay cluster
the rollout pool can grow on its worker group while the learners stay where they are.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cluster.ray_setup import actor_options, pinned
from cluster.resources import wait_placed
from cluster.weight_sync import free_port


@dataclass
class Pools:
    rollout: list = field(default_factory=list)
    scorer: list = field(default_factory=list)
    learners: list = field(default_factory=list)
    buffer: object = None
    # actor_id of each rollout actor (parallel to ``rollout``): it seeds the actor's sampling, so a
    # replacement takes over its predecessor's id and regenerates exactly its chunk of a batch
    rollout_ids: list = field(default_factory=list)
    # run.rollouts_ahead in async mode: > 1 stages broadcasts on the rollout actors (their
    # "weights" concurrency group) instead of queueing behind their rollouts
    rollouts_ahead: int = 1
    # buffer.stale_policy=requeue: each rollout launch first takes the buffer's requeued prompts
    requeue: bool = False

    @property
    def receivers(self) -> list:
        """Every actor that receives weights from learner rank 0, in weight-sync rank order."""
        return self.rollout + self.scorer


def build_pools(cfg, run_dir: str) -> Pools:
    """Create the buffer, learner, rollout and scorer actors (learners first: they hold the GPUs)."""
    import ray

    from buffer import ReplayBuffer
    from learner.learner import Learner

    c = cfg.cluster
    requeue = getattr(cfg.buffer.stale_policy, "value", cfg.buffer.stale_policy) == "requeue"
    pools = Pools(rollouts_ahead=rollouts_ahead(cfg), requeue=requeue)
    pools.buffer = ray.remote(**actor_options(c.buffer_cpus))(ReplayBuffer).remote(
        cfg.buffer, _buffer_root(cfg, run_dir))
    n_learn = cfg.learner.num_learners
    ds_port = free_port(c.host)
    learner_cls = ray.remote(**actor_options(c.learner_cpus, c.learner_gpus, c.learner_resources))(
        pinned(Learner, c.learner_cores))
    pools.learners = [
        learner_cls.remote(cfg.learner, cfg.correction, cfg.rollout.model_path, rank=r,
                           world_size=n_learn, master_addr=c.host, master_port=ds_port,
                           distill=cfg.rollout.distill_sparse)
        for r in range(n_learn)]
    pools.rollout_ids = list(range(cfg.rollout.num_actors))
    pools.rollout = [spawn_rollout(cfg, i) for i in pools.rollout_ids]
    pools.scorer = [spawn_scorer(cfg) for _ in range(cfg.scorer.num_actors)]
    named = [("buffer", pools.buffer)] + [(f"{kind} {i}", a) for kind, group in (
        ("learner", pools.learners), ("rollout", pools.rollout), ("scorer", pools.scorer))
        for i, a in enumerate(group)]
    wait_placed(named, c.placement_timeout_s)  # an unplaceable actor: an error, not a hang
    return pools


def rollouts_ahead(cfg) -> int:
    """Rollout batches kept in flight: ``run.rollouts_ahead`` in async mode, else 1."""
    run = getattr(cfg, "run", None)
    mode = getattr(getattr(run, "mode", None), "value", getattr(run, "mode", None))
    return int(getattr(run, "rollouts_ahead", 1)) if mode == "async" else 1


def _weights_group(actor, method: str, ahead: int):
    """``actor.method``, in the rollout actor's "weights" concurrency group when rollouts run
    ahead (it then runs beside the actor's rollouts instead of after every queued one)."""
    m = getattr(actor, method)
    return m.options(concurrency_group="weights") if ahead > 1 else m


def spawn_rollout(cfg, actor_id: int):
    """One rollout actor with the pool's resources (build_pools, and replacements or growth in
    ``cluster.elastic``: both must place and configure it the same way). With rollouts ahead it
    gets a "weights" concurrency group (one thread) for ``stage_weights``/``init_weight_sync``;
    rollouts and everything else stay one call at a time in the default group."""
    import ray

    from actors.rollout import RolloutActor

    c = cfg.cluster
    opts = actor_options(c.rollout_cpus, c.rollout_gpus, c.rollout_resources)
    if rollouts_ahead(cfg) > 1:
        opts["concurrency_groups"] = {"weights": 1}
    cls = ray.remote(max_restarts=c.actor_max_restarts, **opts)(
        pinned(RolloutActor, c.rollout_cores))
    return cls.remote(cfg.rollout, cfg.task, cfg.rollout.model_path, actor_id=actor_id)


def spawn_scorer(cfg):
    """One dense scorer actor with the pool's resources (see ``spawn_rollout``).

    With ``correction.loss.kl_coef > 0`` it also holds the reference policy: a frozen copy of
    ``rollout.model_path``, the initial policy, on the scorer's devices. That path is the run's
    base model even on resume (the checkpoint's weights reach the actors only by broadcast, which
    never touches the reference), so resumed runs and replacements keep the same reference."""
    import ray

    from actors.scorer import ScorerActor

    c = cfg.cluster
    opts = actor_options(c.scorer_cpus, c.scorer_gpus, c.scorer_resources)
    cls = ray.remote(max_restarts=c.actor_max_restarts, **opts)(
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


def connect_weight_sync(pools: Pools, cfg, port: int | None = None) -> None:
    """Form the broadcast group: learner rank 0 is rank 0, then each rollout and scorer actor.

    Separate from DeepSpeed's own process group (one default group per process): a standalone
    TCPStore + gloo (or NCCL) group that only carries weights. Every member leaves the group it was
    in first, so calling this again re-forms it (``cluster.elastic.reform_weight_sync``, on a fresh
    ``port``). ``cluster.weight_sync_timeout_s`` bounds every wait: a member that died or never
    joins makes the others fail after that long instead of hanging.
    """
    import ray

    c = cfg.cluster
    port = port or c.weight_sync_port or free_port(c.host)
    world = 1 + len(pools.receivers)
    timeout = float(c.weight_sync_timeout_s)
    backend = getattr(c.weight_sync_backend, "value", c.weight_sync_backend)
    calls = [pools.learners[0].init_weight_sync.remote(c.host, port, world, backend,
                                                       c.weight_sync_bucket_mb, timeout_s=timeout)]
    ahead = [pools.rollouts_ahead] * len(pools.rollout) + [1] * len(pools.scorer)
    calls += [_weights_group(a, "init_weight_sync", s).remote(c.host, port, rank, world,
                                                               timeout_s=timeout)
              for rank, (a, s) in enumerate(zip(pools.receivers, ahead), start=1)]
    # every member's answer, not the first error: a failed formation leaves no member still
    # waiting in it (each waits at most the timeout), so a re-formation can follow at once
    ray.wait(calls, num_returns=len(calls))
    ray.get(calls)


def on_learners(pools: Pools, method: str, *args):
    """``method(*args)`` on every learner rank (under ZeRO-3 the weights are partitioned, so
    broadcasts, checksums and HF saves gather them: a collective); returns rank 0's result."""
    import ray

    return ray.get([getattr(lrn, method).remote(*args) for lrn in pools.learners])[0]


def broadcast_weights(pools: Pools, verify: bool = True) -> tuple[int, dict]:
    """Learner rank 0 sends its weights; every receiver swaps them in between batches.

    Returns the version and, with ``verify``, the learner's weight checksum and the largest relative
    difference of any receiver's checksum from it (0.0 when every actor holds the learner's weights).

    With ``pools.rollouts_ahead > 1`` the rollout actors *stage* the weights (``stage_weights``, in
    their "weights" concurrency group, beside queued rollouts) and swap them in at the start of
    their next rollout/evaluate; their checksum here is the staged copy's, which the swap checks
    the model against. Scorers always receive straight into the model (they are idle meanwhile).
    """
    import ray

    ahead = pools.rollouts_ahead > 1
    sent = [lrn.broadcast_weights.remote() for lrn in pools.learners]  # rank 0 sends
    staged = [a.stage_weights.options(concurrency_group="weights").remote(verify)
              for a in pools.rollout] if ahead else []
    got = [a.sync_weights.remote() for a in (pools.scorer if ahead else pools.receivers)]
    version = ray.get(sent)[0]
    staged = ray.get(staged)
    versions = [s["version"] for s in staged] + ray.get(got)
    if any(v != version for v in versions):
        raise RuntimeError(f"weight broadcast version mismatch: learner {version}, actors {versions}")
    if not verify:
        return version, {}
    ref = on_learners(pools, "state_checksum")
    sums = [s["checksum"] for s in staged] + ray.get(
        [a.state_checksum.remote() for a in (pools.scorer if ahead else pools.receivers)])
    diff = max(abs(s - ref) / max(abs(ref), 1e-12) for s in sums)
    return version, {"weights/checksum": ref, "weights/max_rel_diff": diff}
