"""Building a learner rank's DeepSpeed engine: its config, the LR schedule, the process group,
parameter groups and the checks and fixes applied before ``deepspeed.initialize``
(``learner.learner.Learner.start``)."""
from __future__ import annotations

import math
import os

import torch

from common.devices import assigned_device
from common.dtypes import Dtype
from learner.config import LearnerConfig, LRSchedule


def lr_lambda(cfg: LearnerConfig):
    """Multiplier of ``cfg.lr`` at optimiser step s: linear warmup, then constant or cosine."""
    warm, decay, floor = cfg.warmup_steps, cfg.decay_steps, cfg.min_lr_ratio
    cosine = LRSchedule(cfg.lr_schedule) == LRSchedule.COSINE

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        if not cosine:
            return 1.0
        progress = min(1.0, (step - warm) / decay)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return f


def deepspeed_config(cfg: LearnerConfig, world_size: int) -> dict:
    """The DeepSpeed JSON config for ``cfg`` (batch sizes are nominal: accumulation is manual)."""
    bf16 = Dtype(getattr(cfg.dtype, "value", cfg.dtype)) == Dtype.bfloat16
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": cfg.micro_batch_size * world_size,
        "gradient_clipping": float(cfg.grad_clip),
        "zero_optimization": {"stage": int(cfg.zero_stage)},
        "bf16": {"enabled": bf16},
        # a torch AdamW avoids compiling DeepSpeed's fused/cpu Adam; ZeRO accepts it with this flag
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def _set_dist_env(rank: int, world_size: int, local_rank: int, addr: str, port: int) -> None:
    """DeepSpeed falls back to MPI discovery (and fails without mpi4py) unless these are set."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(local_rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_SIZE": str(world_size),
                       "MASTER_ADDR": addr, "MASTER_PORT": str(port)})


def use_assigned_device() -> str:
    """Point DeepSpeed at the device Ray assigned this rank and return the default group's backend
    (nccl on a GPU, else gloo), both from ``common.devices.assigned_device``.

    A rank given no GPUs may still see them (Ray leaves CUDA_VISIBLE_DEVICES alone then): by
    ``torch.cuda.is_available()`` it would form an NCCL group and DeepSpeed would pick its CUDA
    accelerator and move the model onto a GPU. DeepSpeed reads DS_ACCELERATOR once, at its first
    ``get_accelerator()``: call this before importing deepspeed.
    """
    device = assigned_device()
    os.environ["DS_ACCELERATOR"] = device.type  # "cuda" or "cpu": both DeepSpeed accelerator names
    return "nccl" if device.type == "cuda" else "gloo"


def _init_default_group(rank: int, world_size: int, addr: str, port: int,
                        listen_sock: int | None = None, backend: str = "gloo"):
    """Create DeepSpeed's default process group ourselves, its store listening on ``addr`` only.

    ``init_process_group(init_method="env://")`` (what DeepSpeed would do) starts a TCPStore server
    on every interface ("::"); handing it a socket bound to ``addr`` (``listen_sock``, already
    open, or bound here) keeps a 127.0.0.1 learner group off the network. DeepSpeed then finds the
    group initialised and uses it. Gloo binds the interface ``addr`` is reached through.
    """
    import torch.distributed as dist

    from cluster.rendezvous import listen_fd, use_interface_toward

    if dist.is_initialized():
        return
    use_interface_toward(addr)
    sock = (listen_fd(addr, port) if listen_sock is None else listen_sock) if rank == 0 else None
    server = {"master_listen_fd": sock} if rank == 0 else {}
    store = dist.TCPStore(addr, port, world_size, is_master=(rank == 0), **server)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def _disable_shm_comm() -> None:
    """Make DeepSpeed skip its shared-memory CPU all-reduce op, which it compiles (~50 s) at the
    first ``initialize`` of every fresh extensions dir; collectives then go through gloo.

    ``deepspeed.comm.torch.build_shm_op`` builds the op only if
    ``deepspeed.ops.__compatible_ops__[name]`` is true; that dict is probed once per process and
    cached in the module, so marking the op incompatible there is honoured by every later check.
    """
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def _reset_adam_step_counts(opt: torch.optim.Optimizer) -> None:
    """Undo the step count of DeepSpeed's state-allocating dummy step.

    With bf16 and ZeRO-0, DeepSpeed's FP16_UnfusedOptimizer calls ``optimizer.step()`` once with zero
    gradients at initialize. The moments stay 0, but Adam's step counter becomes 1, so the first
    real update's bias correction is off (measured: 0.74 x lr instead of lr). Nothing has trained yet,
    so every counter must be 0.
    """
    for state in opt.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = 0


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and norm gains (1-D) are not decayed (standard AdamW practice)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:  # ZeRO-3 partitions are flat: the full shape is ds_shape
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # ZeRO drops empty groups; the LR schedule must not


def _check_no_dropout(model: torch.nn.Module) -> None:
    """Gradient checkpointing needs training mode (HF checkpoints layers only then); training mode
    must not change the forward, or the PPO ratio starts away from 1."""
    p = float(getattr(model.config, "attention_dropout", 0.0) or 0.0)
    p = max([p] + [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)])
    if p > 0:
        raise ValueError(f"learner.gradient_checkpointing needs a model without dropout (found "
                         f"p={p}): its forward runs in training mode")
