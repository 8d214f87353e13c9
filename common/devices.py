"""The device a process computes on: the GPUs Ray *assigned* it, not the GPUs it can see.

Ray (2.60; ray-project/ray#54868) leaves CUDA_VISIBLE_DEVICES untouched in an actor given no GPUs,
so on a GPU node a 0-GPU actor still sees every GPU and ``torch.cuda.is_available()`` is True.
Choosing by it put a ``cluster.learner_gpus=0`` learner on the GPU, NCCL and DeepSpeed's CUDA
accelerator included. Every actor therefore asks ``assigned_device``: inside a Ray worker the
assignment decides; elsewhere (the driver, tests, scripts) whatever CUDA_VISIBLE_DEVICES lets torch
see, as before. Neither torch nor ray is imported here at module level (ray is never imported at
all: a process that has not imported it is not a Ray worker).
"""
from __future__ import annotations

import sys


def ray_gpu_ids() -> list[str] | None:
    """The GPU ids Ray assigned this worker process ([] for a 0-GPU actor); None when this is no
    Ray worker (no Ray, the driver, a test calling actor code directly)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    if ctx.worker.mode != ray.WORKER_MODE:  # the driver has no assignment of its own
        return None
    return [str(i) for i in ctx.get_accelerator_ids().get("GPU", [])]


def assigned_device():
    """``torch.device("cuda")`` when this process may use a GPU, else ``torch.device("cpu")``.

    A Ray worker may when Ray assigned it GPUs (then CUDA_VISIBLE_DEVICES holds just those, so
    "cuda" is its first one); any other process when torch sees a GPU.
    """
    import torch

    ids = ray_gpu_ids()
    if ids is not None and not ids:
        return torch.device("cpu")
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def dist_backend() -> str:
    """torch.distributed backend for a group of this process's tensors: nccl on a GPU, else gloo."""
    return "nccl" if assigned_device().type == "cuda" else "gloo"

