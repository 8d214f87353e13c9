"""Deployment options of the KubeRay manifests (cluster/kuberay/deploy.yaml), apart from the
training config they run: image, volume, worker groups. Loaded and validated like the training
config (OmegaConf structured; a bad key or value is a ConfigError naming it)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from omegaconf import OmegaConf

from common.configfile import merge, parse_override
from common.errors import ConfigError
from common.validate import check_range

REPO = Path(__file__).resolve().parents[2]   # deploy.yaml's preset is relative to it

# an image reference with an explicit tag or digest (never the implicit or explicit :latest)
IMAGE = re.compile(r"^[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?(@sha256:[0-9a-f]{64})?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,30}[a-z0-9])?$")


class Group(str, Enum):
    """Worker group a pool's actors run in."""
    rollout = "rollout"
    learner = "learner"


@dataclass
class HeadOptions:
    cpus: int = 8              # the pod's CPUs: the driver (tokenising, evaluation bookkeeping)
    memory: str = "32Gi"
    ray_cpus: int = 1          # CPUs the head offers Ray's actors: the buffer's cluster.buffer_cpus


@dataclass
class GroupOptions:
    replicas: int = 1          # pods at the start
    min_replicas: int = 0      # the autoscaler's range (KubeRay minReplicas / maxReplicas)
    max_replicas: int = 1
    gpus_per_pod: int = 8
    cpus_per_pod: int = 32
    memory: str = "256Gi"

    def validate(self, prefix: str) -> None:
        check_range(f"{prefix}.gpus_per_pod", self.gpus_per_pod, 1, 64)
        check_range(f"{prefix}.cpus_per_pod", self.cpus_per_pod, 1, 1024)
        check_range(f"{prefix}.min_replicas", self.min_replicas, 0, 10000)
        check_range(f"{prefix}.max_replicas", self.max_replicas, max(self.min_replicas, 1), 10000)
        check_range(f"{prefix}.replicas", self.replicas, self.min_replicas, self.max_replicas)
        check_quantity(f"{prefix}.memory", self.memory)


@dataclass
class DeployConfig:
    name: str = "sparse-rl"        # RayCluster name; the RayJob is <name>-train
    preset: str = "launch/configs/qwen2.5-1.5b-math.yaml"  # training preset (repo-relative)
    overrides: list[str] = field(default_factory=list)      # its key=value overrides
    image: str = "registry.example.com/sparse-rl:gpu-0.1.0"  # docker/Dockerfile.gpu, tag pinned
    ray_version: str = "2.60.0"    # RayCluster rayVersion: the image's ray (requirements-gpu.lock)
    workdir: str = "/workspace"    # where the image holds the repository (docker/Dockerfile.gpu)
    pvc: str = "sparse-rl-data"    # ReadWriteMany claim, mounted at `mount` in every pod
    pvc_size: str = "2Ti"
    storage_class: str = ""        # "": the cluster's default class (it must offer ReadWriteMany)
    mount: str = "/mnt/sparse-rl"
    model_dir: str = "models/Qwen2.5-1.5B"  # under `mount`; data files go to `mount`/data
    scorer_group: Group = Group.learner
    backoff_limit: int = 3         # RayJob retries; each resumes from the newest checkpoint
    ttl_after_finished_s: int = 600  # the finished job's cluster stays this long (logs), then goes
    head: HeadOptions = field(default_factory=HeadOptions)
    rollout: GroupOptions = field(default_factory=GroupOptions)
    learner: GroupOptions = field(default_factory=GroupOptions)

    def validate(self) -> None:
        if not DNS_LABEL.match(self.name) or len(self.name) > 26:
            raise ConfigError("name", self.name, "a DNS label of at most 26 characters (the RayJob "
                                                 "adds -train and KubeRay suffixes)")
        if not IMAGE.match(self.image) or ":" not in self.image.rsplit("/", 1)[-1] \
                or self.image.endswith(":latest"):
            raise ConfigError("image", self.image, "an image with a pinned tag or digest (not "
                                                   ":latest), e.g. REGISTRY/sparse-rl:gpu-<commit>")
        for key in ("mount", "workdir"):
            if not str(getattr(self, key)).startswith("/"):
                raise ConfigError(key, getattr(self, key), "an absolute path")
        if not self.model_dir or self.model_dir.startswith("/") or ".." in Path(self.model_dir).parts:
            raise ConfigError("model_dir", self.model_dir, "a path under `mount`, without '..'")
        if not DNS_LABEL.match(self.pvc):
            raise ConfigError("pvc", self.pvc, "a DNS label")
        check_quantity("pvc_size", self.pvc_size)
        check_quantity("head.memory", self.head.memory)
        check_range("head.cpus", self.head.cpus, 1, 1024)
        check_range("head.ray_cpus", self.head.ray_cpus, 1, self.head.cpus)
        check_range("backoff_limit", self.backoff_limit, 0, 100)
        check_range("ttl_after_finished_s", self.ttl_after_finished_s, 0, 86400 * 30)
        self.rollout.validate("rollout")
        self.learner.validate("learner")


def pool_group(dc: DeployConfig, pool: str) -> str:
    """The worker group a pool's actors run in (the scorer's is ``scorer_group``)."""
    return {"rollout": "rollout", "learner": "learner"}.get(pool) or Group(dc.scorer_group).value


def check_quantity(key: str, value: str) -> None:
    if not isinstance(value, str) or not QUANTITY.match(value):
        raise ConfigError(key, value, "a Kubernetes quantity such as 64Gi")


def load_deploy(path: Path, overrides: list[str]) -> DeployConfig:
    """``path`` merged over the defaults, then ``key=value`` overrides; validated."""
    if not Path(path).is_file():
        raise ConfigError("--deploy", str(path), "an existing YAML file")
    schema = OmegaConf.structured(DeployConfig)
    merged = merge(schema, OmegaConf.load(path), str(path))
    for item in overrides:
        merged = merge(merged, parse_override(item), "command line", item)
    cfg: DeployConfig = OmegaConf.to_object(merged)
    cfg.validate()
    return cfg
