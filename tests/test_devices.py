"""Actors without GPUs stay off them (issue 27, item 7): the device and the collective backends
come from the GPUs Ray assigned a process, not from ``torch.cuda.is_available()``, which is True
in a 0-GPU actor on a GPU node. A visible GPU is faked on CPU by patching ``is_available``."""
from __future__ import annotations

import os
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

import common.devices as devices
from actors.scorer import ScorerActor
from common.testmodels import build_model
from learner.engine_setup import use_assigned_device

torch.set_num_threads(1)


@pytest.fixture()
def gpu_visible(monkeypatch):
    """This process sees a GPU (as every actor on a GPU node does); returns a setter for the GPU
    ids Ray assigned it (None: not a Ray worker)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def assign(ids):
        monkeypatch.setattr(devices, "ray_gpu_ids", lambda: ids)
    return assign


@pytest.mark.parametrize("ids, device, backend", [
    ([], "cpu", "gloo"),          # a 0-GPU actor: the visible GPU is not its own
    (["0"], "cuda", "nccl"),      # Ray gave it a GPU
    (None, "cuda", "nccl"),       # no Ray worker (driver, script): what torch sees
])
def test_device_and_backend_follow_the_assignment(gpu_visible, ids, device, backend):
    gpu_visible(ids)
    assert devices.assigned_device() == torch.device(device)
    assert devices.dist_backend() == backend


def test_without_cuda_everything_is_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devices, "ray_gpu_ids", lambda: ["0"])  # a GPU resource, CPU-only torch
    assert devices.assigned_device() == torch.device("cpu")
    assert devices.dist_backend() == "gloo"


def test_not_a_ray_worker_outside_ray():
    assert devices.ray_gpu_ids() is None  # plain pytest process (ray not initialised here)


@pytest.mark.parametrize("ids, accel, backend", [([], "cpu", "gloo"), (["0"], "cuda", "nccl")])
def test_learner_group_and_deepspeed_accelerator(gpu_visible, monkeypatch, ids, accel, backend):
    """``learner_gpus=0`` on a GPU node: DeepSpeed's group is gloo and DeepSpeed is told to use
    the CPU (left alone it picks CUDA whenever torch sees a GPU)."""
    gpu_visible(ids)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # monkeypatch restores it afterwards
    assert use_assigned_device() == backend
    assert os.environ["DS_ACCELERATOR"] == accel


def test_scorer_without_a_gpu_stays_on_cpu(gpu_visible, tmp_path):
    gpu_visible([])
    model_dir = build_model(tmp_path / "model")
    scorer = ScorerActor(SimpleNamespace(micro_batch=2, dtype="float32"), model_dir)
    assert scorer.device == torch.device("cpu")
    assert {p.device.type for p in scorer.model.parameters()} == {"cpu"}


def test_nccl_weight_sync_refused_without_an_assigned_gpu(gpu_visible):
    """The weight-sync group's backend comes from config (cluster.weight_sync_backend); a member
    that was assigned no GPU refuses nccl with a clear error instead of using a visible one."""
    from cluster.sync_guard import make_process_group

    gpu_visible([])
    with pytest.raises(RuntimeError, match="assigned to this process"):
        make_process_group("nccl", None, 0, 1, timedelta(seconds=1))


def test_zero_gpu_ray_actor_is_assigned_no_gpu(local_ray):
    """In a real Ray worker: a 0-GPU actor reads [] from Ray and picks the CPU although torch
    (faked) sees a GPU; the driver itself is no worker."""
    ray = local_ray

    @ray.remote(num_cpus=0, num_gpus=0)
    class Probe:
        def device(self):
            torch.cuda.is_available = lambda: True  # this actor process only
            return devices.ray_gpu_ids(), str(devices.assigned_device())

    assert ray.get(Probe.remote().device.remote(), timeout=60) == ([], "cpu")
    assert devices.ray_gpu_ids() is None


def test_a_cuda_vllm_in_an_actor_given_no_gpu_is_refused(monkeypatch):
    from actors.vllm.engine import _check_gpu_assigned
    from common import devices
    from common.errors import ConfigError

    monkeypatch.setattr(devices, "ray_gpu_ids", lambda: [])
    with pytest.raises(ConfigError, match="cluster.rollout_gpus.*assigned no GPU"):
        _check_gpu_assigned(cpu=False)
    _check_gpu_assigned(cpu=True)                       # the CPU build runs anywhere
    for ids in (["0"], None):                           # given a GPU; or no Ray worker at all
        monkeypatch.setattr(devices, "ray_gpu_ids", lambda ids=ids: ids)
        _check_gpu_assigned(cpu=False)
