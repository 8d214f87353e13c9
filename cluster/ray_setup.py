"""Starting or joining Ray, and placing actors with the resources the cluster config gives them."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from cluster.config import ClusterConfig
from common.cpu_isa import pinned_env

# Environment every actor process gets: one BLAS/torch thread (2 cores are easily oversubscribed) and
# the project's cached torch extensions (DeepSpeed compiles ops on first use otherwise).
REPO_ROOT = Path(__file__).resolve().parent.parent


def worker_env() -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".cache" / "torch_extensions")),
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
        "PYTHONUNBUFFERED": "1",
        **pinned_env(),  # the driver's CPU kernel pin (common/cpu_isa.py), if it pinned
    }


def start_ray(cfg: ClusterConfig, run_dir: str | Path):
    """Start an in-process Ray bound to 127.0.0.1, or join ``cfg.address``; returns the ray module.

    A fresh temp dir per run: Ray leaves ``ray_current_cluster`` behind and a later init with the same
    dir tries to join the dead cluster (PLATFORM.md).
    """
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 otherwise writes $HOME/.ray/auth_token
    import ray

    if ray.is_initialized():
        return ray
    runtime_env = {"env_vars": worker_env()}
    if cfg.address:
        ray.init(address=cfg.address, runtime_env=runtime_env, log_to_driver=True)
        return ray
    _loopback_only(ray)
    temp_dir = cfg.temp_dir or tempfile.mkdtemp(prefix="ray-", dir=_short_tmp())
    ray.init(num_cpus=cfg.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=temp_dir, runtime_env=runtime_env, log_to_driver=True,
             configure_logging=False)
    return ray


def _loopback_only(ray) -> None:
    """Keep a local Ray on 127.0.0.1: nothing it starts listens on another interface.

    Ray 2.60 replaces a loopback ``_node_ip_address`` with the machine's routable address (and its
    GCS, raylet and workers bind to that) unless it thinks it runs without clusters, which
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` says. The environment variable reaches the processes Ray
    spawns; the module constant covers a Ray already imported in this process.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False


def _short_tmp() -> str:
    # Ray's unix sockets live under the temp dir and must stay below ~107 characters.
    return "/tmp"


def actor_options(cpus: float, gpus: float = 0.0, resources: dict | None = None,
                  name: str | None = None) -> dict:
    """Options for ``ray.remote(**opts)(Cls)``: the pool's CPUs, GPUs and custom resources."""
    opts = {"num_cpus": cpus, "num_gpus": gpus, "max_concurrency": 1}
    if resources:
        opts["resources"] = dict(resources)
    if name:
        opts["name"] = name
    return opts


def apply_cores(cores) -> None:
    """Pin this process to ``cores`` (CPU ids) and run that many torch threads; empty: no change.

    Called first thing in an actor process (see ``pinned``), before its model loads, so torch's
    thread pool and every later allocation start out on the pool's own cores.
    """
    if not cores:
        return
    import torch

    os.sched_setaffinity(0, set(int(c) for c in cores))
    torch.set_num_threads(len(cores))
    # Ray's OMP_NUM_THREADS=1 would otherwise cap pools that were given several cores
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(len(cores))


def pinned(cls: type, cores) -> type:
    """``cls``, or a subclass whose constructor first pins its process to ``cores`` (``apply_cores``).

    Wrapping the class (rather than calling a method after construction) pins the model load and
    every thread the actor starts; the subclass keeps the name, so Ray's logs read the same.
    """
    if not cores:
        return cls
    cores = [int(c) for c in cores]

    def __init__(self, *args, **kwargs):
        apply_cores(cores)
        cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "pinned_cores": cores})
