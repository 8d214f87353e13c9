"""Cluster layout: where Ray runs and how many of each actor, with what resources."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum

from common.errors import ConfigError
from common.validate import check_range


class Placement(str, Enum):
    """How each pool's placement group spreads its actors over nodes (Ray's PACK / SPREAD)."""
    pack = "pack"       # as few nodes as possible (the learners' collectives stay on one node)
    spread = "spread"   # across nodes (one node's loss takes fewer actors of a pool)


class CommBackend(str, Enum):
    """Backend of the weight-broadcast group: gloo on CPU, nccl between GPUs."""
    gloo = "gloo"
    nccl = "nccl"


@dataclass
class ClusterConfig:
    # None: start Ray in-process on this machine, listening on 127.0.0.1 only. "auto" or
    # "ray://host:10001": join an existing cluster (e.g. under `ray job submit` or on KubeRay).
    address: str | None = None
    num_cpus: int = 2                   # CPUs given to a local Ray (ignored when joining a cluster)
    # Learner rank 0 serves DeepSpeed's group and the weight-sync group on its own node's IP
    # (loopback on a local Ray) and reports the address; this is the weight-sync port (0: a free one)
    weight_sync_port: int = 0
    weight_sync_backend: CommBackend = CommBackend.gloo
    weight_sync_bucket_mb: int = 64
    # Longest wait of any weight-sync step (group formation, one broadcast): a member that died or
    # never joins turns into an error after this long instead of a hang. It must exceed the longest
    # rollout call, since an async-mode broadcast waits for actors to finish their batch.
    weight_sync_timeout_s: float = 300.0
    # Ray restarts a crashed rollout or scorer actor up to this many times (fresh, from its
    # constructor); ``cluster.elastic.replace_dead`` then takes it back into the weight-sync group.
    actor_max_restarts: int = 0
    # Fractional CPUs let several actors share 2 cores; Ray then sets OMP_NUM_THREADS=1 in them.
    rollout_cpus: float = 0.5
    scorer_cpus: float = 0.25
    learner_cpus: float = 0.5
    buffer_cpus: float = 0.1
    rollout_gpus: float = 0.0
    scorer_gpus: float = 0.0
    learner_gpus: float = 0.0
    # Custom Ray resources per actor, to pin pools to worker groups (KubeRay: rollout_pool/learner_pool).
    rollout_resources: dict[str, float] = field(default_factory=dict)
    scorer_resources: dict[str, float] = field(default_factory=dict)
    learner_resources: dict[str, float] = field(default_factory=dict)
    # KubeRay: {buffer_pool: 1}, which only the head advertises, keeps the buffer beside the driver
    buffer_resources: dict[str, float] = field(default_factory=dict)
    # One Ray placement group per pool (learners: one group for the DeepSpeed ranks), its bundles
    # (one per actor) packed onto few nodes or spread over many.
    placement: Placement = Placement.pack
    # CPU ids each pool's actor processes are pinned to (sched_setaffinity, and that many torch
    # threads); empty: no pinning. Emulates disjoint per-pool hardware on one machine, e.g. rollout
    # on core 0 and learner + scorer on core 1, so the pools stop competing for the same cores.
    rollout_cores: list[int] = field(default_factory=list)
    scorer_cores: list[int] = field(default_factory=list)
    learner_cores: list[int] = field(default_factory=list)
    # Longest wait for every actor to be placed and constructed (cluster/resources.py): a plan a
    # local Ray can never place stops at start-up; on a joined (autoscaling) cluster an actor still
    # unplaced after this long stops the run, naming it, instead of a silent hang.
    placement_timeout_s: float = 900.0
    temp_dir: str | None = None         # None: a fresh dir under the run's output folder

    def validate(self, prefix: str = "cluster") -> None:
        check_range(f"{prefix}.num_cpus", self.num_cpus, 1)
        check_range(f"{prefix}.weight_sync_port", self.weight_sync_port, 0, 65535)
        check_range(f"{prefix}.weight_sync_bucket_mb", self.weight_sync_bucket_mb, 1, 4096)
        check_range(f"{prefix}.actor_max_restarts", self.actor_max_restarts, -1, 1000)
        for name in ("weight_sync_timeout_s", "placement_timeout_s"):
            check_range(f"{prefix}.{name}", getattr(self, name), 0.0, 86400.0, lo_open=True)
        for name in ("rollout_cpus", "scorer_cpus", "learner_cpus", "buffer_cpus"):
            check_range(f"{prefix}.{name}", getattr(self, name), 0.0, 64.0, lo_open=True)
        for name in ("rollout_gpus", "scorer_gpus", "learner_gpus"):
            check_range(f"{prefix}.{name}", getattr(self, name), 0.0, 8.0)
        for name in ("rollout_cores", "scorer_cores", "learner_cores"):
            check_cores(f"{prefix}.{name}", getattr(self, name))
        self._check_nccl_gpus(prefix)

    def _check_nccl_gpus(self, prefix: str) -> None:
        """One NCCL rank per GPU: a learner with GPUs runs DeepSpeed over NCCL on exactly one;
        with ``weight_sync_backend=nccl`` every member (learner, rollout, scorer) holds whole
        GPUs, since NCCL ranks cannot share a device."""
        if self.learner_gpus not in (0, 1):
            raise ConfigError(f"{prefix}.learner_gpus", self.learner_gpus,
                              "0 (CPU) or 1: each learner is one NCCL rank on one whole GPU")
        if CommBackend(self.weight_sync_backend) != CommBackend.nccl:
            return
        for pool in ("learner", "rollout", "scorer"):
            gpus = getattr(self, f"{pool}_gpus")
            if gpus < 1 or gpus != int(gpus):
                raise ConfigError(f"{prefix}.{pool}_gpus", gpus,
                                  f"whole GPUs (1, 2, ...) with {prefix}.weight_sync_backend=nccl: "
                                  f"every {pool} actor is an NCCL rank, which needs a GPU of "
                                  f"its own (or weight_sync_backend=gloo)")


def check_cores(key: str, cores: list[int]) -> None:
    """Raise ConfigError unless ``cores`` lists distinct CPU ids this machine has (empty is fine).

    Checked against this (the driver's) machine: pinning is meant for a single-machine run.
    """
    n = os.cpu_count() or 1
    allowed = f"a list of distinct CPU ids in [0, {n - 1}] (empty: no pinning)"
    if not isinstance(cores, (list, tuple)):
        raise ConfigError(key, cores, allowed)
    for c in cores:
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < n:
            raise ConfigError(key, list(cores), allowed)
    if len(set(cores)) != len(cores):
        raise ConfigError(key, list(cores), allowed)
