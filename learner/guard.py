"""Skipping an optimiser step whose loss or gradients are not finite, under every ZeRO stage.

DeepSpeed skips a step on overflow only in its fp16 loss-scaling path (and, in some stages and
dtypes, on an invalid gradient norm); in fp32 and bf16 a NaN gradient would otherwise reach Adam
and the weights. So the learner checks before ``engine.step()``: its own micro-batch losses and the
gradients where this stage keeps them (after the accumulation boundary's reduction), all-reduces
the two flags so every data-parallel rank takes the same decision, and on a fault drops the
accumulated gradients without stepping: weights, optimiser moments, Adam's step count and the LR
schedule stay exactly as they were. Where the gradients live, and how to drop them so the next
mini-batch starts clean, differs per stage:

- ZeRO-0: ``p.grad`` of the module parameters (fp32; in bf16 too: its unfused optimiser copies
  them to the fp32 masters only inside ``step``); dropped with ``engine.zero_grad()``.
- ZeRO-1/2: the reduced partitions in the optimiser's ``averaged_gradients`` (and, stage 2, its
  accumulation buffers, which restart at the next backward when ``micro_step_id`` is reset):
  dropped as its own overflow path in ``step`` drops them.
- ZeRO-3: ``averaged_gradients`` likewise; dropped by its overflow clean-up.

The local checks are DeepSpeed's own serial ones (no collective inside); the decision's
all-reduce is ours, so it also covers a fault seen in the loss alone.
"""
from __future__ import annotations

import torch

LOSS, GRAD = "loss", "grad"


def local_grads_finite(engine, zero_stage: int) -> bool:
    """Whether the gradients this rank holds after the boundary's reduction are all finite."""
    if zero_stage == 0:
        return all(bool(torch.isfinite(p.grad).all()) for p in engine.module.parameters()
                   if p.grad is not None)
    return not bool(engine.optimizer.has_overflow_partitioned_grads_serial())


def discard_grads(engine, zero_stage: int) -> None:
    """Drop the mini-batch's accumulated gradients without an optimiser step, leaving the
    optimiser ready for the next mini-batch's first backward (as DeepSpeed's overflow skip does)."""
    if zero_stage == 0:
        engine.zero_grad()
        return
    opt = engine.optimizer
    if zero_stage == 3:
        opt._overflow_clean_up(opt.loss_scale)
        return
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

    opt.micro_step_id = INITIAL_MICRO_STEP_ID
    opt.zero_grad(set_to_none=True)
    opt._release_preflattened_grad_buffers()
    for k in opt.averaged_gradients.keys():
        opt.averaged_gradients[k] = None
        opt.all_grad_tensors[k] = None


def step_fault(losses_finite: bool, engine, zero_stage: int, all_reduce) -> str | None:
    """None when the step may go ahead, else its cause (``"loss"`` before ``"grad"``), agreed
    by every rank: ``all_reduce(tensor, "max")`` over the learners, or None with one learner."""
    flags = torch.tensor([float(not losses_finite),
                          float(not local_grads_finite(engine, zero_stage))], dtype=torch.float64)
    if all_reduce is not None:
        flags = all_reduce(flags, "max")
    if flags[0] > 0:
        return LOSS
    return GRAD if flags[1] > 0 else None


def nonfinite_weight(params: dict) -> str | None:
    """The name of the first parameter of this rank holding a NaN or inf (under ZeRO-3 its own
    partition, ``ds_tensor``), or None."""
    return next((n for n, p in params.items()
                 if not bool(torch.isfinite(getattr(p, "ds_tensor", p)).all())), None)


def nonfinite_optimizer_state(optimizer) -> str | None:
    """The first non-finite tensor of the torch optimiser under DeepSpeed's wrapper (its
    parameters: the fp32 master partitions under ZeRO; its moments), as a short name, or None."""
    opt = getattr(optimizer, "optimizer", optimizer)
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            if not bool(torch.isfinite(p).all()):
                return f"optimizer master {g}.{i}"
            for key, t in opt.state.get(p, {}).items():
                if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    return f"optimizer {key} {g}.{i}"
    return None
