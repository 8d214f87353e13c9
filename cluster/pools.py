"""Actor pools on Ray: rollout, scorer and learner pools sized independently, plus the buffer.

Actors are plain classes (tested without Ray) wrapped here, at the call site, with ``ray.remote``.
Each pool has its own CPU/GPU/custom-resource request from ``ClusterConfig``, so on a KubeRay cluster
the rollout pool can grow on its worker group while the learners stay where they are.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cluster.ray_setup import actor_options
from cluster.weight_sync import free_port


@dataclass
class Pools:
    rollout: list = field(default_factory=list)
    scorer: list = field(default_factory=list)
    learners: list = field(default_factory=list)
    buffer: object = None

    @property
    def receivers(self) -> list:
        """Every actor that receives weights from learner rank 0, in weight-sync rank order."""
        return self.rollout + self.scorer


def build_pools(cfg, run_dir: str) -> Pools:
    """Create the buffer, learner, rollout and scorer actors (learners first: they hold the GPUs)."""
    import ray

    from actors.rollout import RolloutActor
    from actors.scorer import ScorerActor
    from buffer import ReplayBuffer
    from learner.learner import Learner

    c = cfg.cluster
    pools = Pools()
    pools.buffer = ray.remote(**actor_options(c.buffer_cpus))(ReplayBuffer).remote(
        cfg.buffer, _buffer_root(cfg, run_dir))
    n_learn = cfg.learner.num_learners
    ds_port = free_port(c.host)
    learner_cls = ray.remote(**actor_options(c.learner_cpus, c.learner_gpus, c.learner_resources))(Learner)
    pools.learners = [
        learner_cls.remote(cfg.learner, cfg.correction, cfg.rollout.model_path, rank=r,
                           world_size=n_learn, master_addr=c.host, master_port=ds_port)
        for r in range(n_learn)]
    rollout_cls = ray.remote(**actor_options(c.rollout_cpus, c.rollout_gpus, c.rollout_resources))(
        RolloutActor)
    pools.rollout = [rollout_cls.remote(cfg.rollout, cfg.task, cfg.rollout.model_path, actor_id=i)
                     for i in range(cfg.rollout.num_actors)]
    scorer_cls = ray.remote(**actor_options(c.scorer_cpus, c.scorer_gpus, c.scorer_resources))(ScorerActor)
    pools.scorer = [scorer_cls.remote(cfg.scorer, cfg.rollout.model_path, cfg.rollout.temperature)
                    for _ in range(cfg.scorer.num_actors)]
    return pools


def _buffer_root(cfg, run_dir: str) -> str | None:
    root = getattr(cfg.buffer, "root", None)
    return root if root else f"{run_dir}/buffer"


def connect_weight_sync(pools: Pools, cfg) -> None:
    """Form the broadcast group: learner rank 0 is rank 0, then each rollout and scorer actor.

    Separate from DeepSpeed's own process group (one default group per process): a standalone
    TCPStore + gloo (or NCCL) group that only carries weights.
    """
    import ray

    c = cfg.cluster
    port = c.weight_sync_port or free_port(c.host)
    world = 1 + len(pools.receivers)
    calls = [pools.learners[0].init_weight_sync.remote(c.host, port, world, c.weight_sync_backend.value,
                                                       c.weight_sync_bucket_mb)]
    calls += [a.init_weight_sync.remote(c.host, port, rank, world)
              for rank, a in enumerate(pools.receivers, start=1)]
    ray.get(calls)


def broadcast_weights(pools: Pools, verify: bool = True) -> tuple[int, dict]:
    """Learner rank 0 sends its weights; every receiver swaps them in between batches.

    Returns the version and, with ``verify``, the learner's weight checksum and the largest relative
    difference of any receiver's checksum from it (0.0 when every actor holds the learner's weights).
    """
    import ray

    sent = pools.learners[0].broadcast_weights.remote()
    got = [a.sync_weights.remote() for a in pools.receivers]
    version = ray.get(sent)
    versions = ray.get(got)
    if any(v != version for v in versions):
        raise RuntimeError(f"weight broadcast version mismatch: learner {version}, actors {versions}")
    if not verify:
        return version, {}
    ref = ray.get(pools.learners[0].state_checksum.remote())
    sums = ray.get([a.state_checksum.remote() for a in pools.receivers])
    diff = max(abs(s - ref) / max(abs(ref), 1e-12) for s in sums)
    return version, {"weights/checksum": ref, "weights/max_rel_diff": diff}
