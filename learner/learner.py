"""The learner: a DeepSpeed ZeRO engine that takes corrected GRPO/PPO steps on scored batches.

A plain class; the driver wraps it with ``ray.remote`` and starts ``num_learners`` of them, one per
data-parallel rank, all joining DeepSpeed's default process group. Rank 0 also owns the weight-sync
sender (a *separate* group, see ``cluster/weight_sync.py``).

One ``train_step``:
  1. GRPO advantages and the mismatch correction (IS weights + rejection mask) over the whole shard:
     both normalise over the batch, so they must not be computed per micro-batch (with
     ``correction.staleness.enabled`` and pi_dense at the sampler's version in the batch, the
     sparsity/staleness split of ``correction.staleness_correct``);
  2. the shard is cut into micro-batches of ``micro_batch_size`` rows; each gets new log-probs
     (``common.modeling.token_logprobs`` at the rollout temperature), the PPO loss and a backward
     with DeepSpeed's accumulation boundary set by hand on the last one, because the number of
     micro-batches follows the batch and is not a fixed ``gradient_accumulation_steps``;
  3. one optimiser step (grad clipping and LR schedule inside DeepSpeed); ``version`` += 1.
Each micro-batch loss is scaled by its share of the *global* (all ranks) kept tokens (or sequences
for ``seq_mean``), times the world size that DeepSpeed's gradient averaging divides by, so the update
equals the loss aggregated over the whole batch however it is split.
"""
from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

import torch

from common.modeling import checksum, load_model, token_logprobs
from learner.config import LearnerConfig, LRSchedule, Precision

# Non-weight files of an HF model directory, copied next to saved weights so the result is a
# complete model directory (tokenizer included) usable as any actor's model_path.
_HF_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


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
    bf16 = Precision(cfg.dtype) == Precision.BF16
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


def logprobs_and_entropy(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``common.modeling.token_logprobs`` plus the entropy of each position's distribution.

    Same alignment (position t holds the distribution that predicted token t; t=0 is 0) and the
    same position ids; only used when the loss has an entropy bonus, since it keeps the whole
    [B, T, V] distribution alive for the backward.
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    zero = picked.new_zeros(picked.shape[0], 1)
    return torch.cat([zero, picked], dim=1), torch.cat([zero, entropy], dim=1)


def _set_dist_env(rank: int, world_size: int, local_rank: int, addr: str, port: int) -> None:
    """DeepSpeed falls back to MPI discovery (and fails without mpi4py) unless these are set."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(local_rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_SIZE": str(world_size),
                       "MASTER_ADDR": addr, "MASTER_PORT": str(port)})


def _init_default_group(rank: int, world_size: int, addr: str, port: int):
    """Create DeepSpeed's default process group ourselves, its store listening on ``addr`` only.

    ``init_process_group(init_method="env://")`` (what DeepSpeed would do) starts a TCPStore server
    on every interface ("::"); handing it a socket bound to ``addr`` keeps a 127.0.0.1 learner group
    off the network. DeepSpeed then finds the group initialised and uses it.
    """
    import torch.distributed as dist

    from cluster.weight_sync import listen_fd

    if dist.is_initialized():
        return
    server = {"master_listen_fd": listen_fd(addr, port)} if rank == 0 else {}
    store = dist.TCPStore(addr, port, world_size, is_master=(rank == 0), **server)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
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
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def _combine_loss_metrics(parts: list[tuple[float, float, dict]]) -> dict[str, float]:
    """This rank's loss/* over its micro-batches: counts summed, maxima maxed, the rest averaged
    with each micro-batch's share of the kept units (so ``loss`` is the shard's aggregated loss)."""
    out: dict[str, float] = {"loss": 0.0}
    for w, loss, m in parts:
        out["loss"] += w * loss
        for k, v in m.items():
            if "num_" in k:
                out[k] = out.get(k, 0.0) + v
            elif k.endswith("_max"):
                out[k] = max(out.get(k, v), v)
            else:
                out[k] = out.get(k, 0.0) + w * v
    return out


class Learner:
    """One data-parallel DeepSpeed learner rank. See the module docstring for a step's anatomy."""

    def __init__(self, cfg: LearnerConfig, correction_cfg, model_path: str, rank: int = 0,
                 world_size: int = 1, master_addr: str = "127.0.0.1", master_port: int = 29500,
                 local_rank: int | None = None):
        cfg.validate("learner")
        if world_size != cfg.num_learners:
            raise ValueError(f"world_size={world_size} but learner.num_learners={cfg.num_learners}")
        self.cfg, self.correction_cfg = cfg, correction_cfg
        self.model_path, self.rank, self.world_size = str(model_path), rank, world_size
        self.version = 0
        torch.set_num_threads(cfg.num_threads)
        if local_rank is None:  # under Ray each GPU actor sees one device; elsewhere rank-per-GPU
            local_rank = rank % torch.cuda.device_count() if torch.cuda.device_count() > 1 else 0
        _set_dist_env(rank, world_size, local_rank, master_addr, master_port)
        _init_default_group(rank, world_size, master_addr, master_port)

        import deepspeed

        if not cfg.cpu_shm_comm:
            _disable_shm_comm()
        torch.manual_seed(cfg.seed)
        t0 = time.time()
        # left in eval mode (as loaded): dropout off, so at the start of a step the new log-probs
        # equal the scorer's dense old log-probs (PPO ratio 1); gradients flow in eval mode too
        model = load_model(model_path, dtype=torch.float32)
        opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr,
                                betas=tuple(cfg.betas), eps=cfg.eps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=sched,
            config=deepspeed_config(cfg, world_size))
        _reset_adam_step_counts(opt)
        self.init_seconds = time.time() - t0
        self._zero3 = int(cfg.zero_stage) == 3
        self._full: dict[str, torch.Tensor] | None = None
        self._sender = None
        if self._zero3:
            self._gather_full()

    # ---- training -------------------------------------------------------------------------

    def train_step(self, tensors: dict, temperature: float = 1.0) -> dict:
        """One optimiser step on this rank's shard (``buffer.tensors.to_tensors`` layout).

        Every rank must call it (collectives inside). Returns float metrics: loss, grad_norm, lr,
        adv/*, mismatch/*, correction/*, staleness/* and sparsity/* (with the staleness split,
        see ``_correct``), loss/* (kept-token weighted over micro-batches), counts and time;
        ``version`` after the step.
        """
        from correction import grpo_advantages

        t0 = time.time()
        cc = self.correction_cfg
        resp = tensors["response_mask"].bool()
        adv, adv_metrics = grpo_advantages(tensors["rewards"].float(), tensors["group_index"], cc)
        corr = self._correct(tensors, resp)
        keep = corr.loss_mask > 0
        slices, units, total = self._plan_micro_batches(keep)
        # ``total`` is global, so every rank agrees: with nothing kept anywhere there is no
        # forward/backward and no optimiser step (Adam would still move weights on zero grads)
        stepped = total > 0
        metrics, grad_norm = {"loss": 0.0}, 0.0
        if stepped:
            local_units = sum(units)
            parts = []
            for i, (sl, unit) in enumerate(zip(slices, units)):
                self.engine.set_gradient_accumulation_boundary(i == len(slices) - 1)
                share = unit * self.world_size / total
                loss, m = self._micro_step(tensors, sl, adv, corr, temperature, share)
                parts.append((unit / local_units if local_units > 0 else 0.0, float(loss), m))
            metrics = _combine_loss_metrics(parts)
            own_norm = self._plain_grad_norm()
            self.engine.step()
            grad_norm = self.engine.get_global_grad_norm() or own_norm
        self.version += 1
        if self._zero3 and stepped:
            self._gather_full()
        metrics.update(adv_metrics)
        metrics.update(corr.metrics)
        metrics.update({
            "grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
            "lr": float(self.scheduler.get_last_lr()[0]), "version": float(self.version),
            "learner/stepped": float(stepped), "learner/micro_batches": float(len(slices) if stepped else 0),
            "learner/rows": float(resp.shape[0]), "learner/response_tokens": float(resp.sum()),
            "learner/kept_tokens": float(keep.sum()), "time/train_s": time.time() - t0})
        return metrics

    def _correct(self, tensors: dict, resp: torch.Tensor):
        """IS weights and loss mask over the whole shard.

        With ``correction.staleness.enabled`` and ``dense_sampler_logprobs`` in the batch: the
        sparsity/staleness split ``staleness_correct(sampler, dense_sampler, old, ...)`` with lag
        n - v, v = ``policy_version``, n = ``scorer_version`` (the version ``old_logprobs`` were
        scored at; the learner's own version where a row has none). ``old_logprobs`` (pi_dense^n)
        stays the PPO anchor. Otherwise ``correct(sampler, old)``. ``correction/staleness_split``
        says which (1 / 0).
        """
        from correction import correct, staleness_correct

        cc = self.correction_cfg
        sampler, old = tensors["sampler_logprobs"].float(), tensors["old_logprobs"].float()
        dense_v = tensors.get("dense_sampler_logprobs")
        if not (cc.staleness.enabled and dense_v is not None):
            corr = correct(sampler, old, resp, cc)
            corr.metrics["correction/staleness_split"] = 0.0
            return corr
        v = tensors["policy_version"].long()
        n = tensors.get("scorer_version")
        n = torch.full_like(v, self.version) if n is None else \
            torch.where(n.long() >= 0, n.long(), torch.full_like(v, self.version))
        corr = staleness_correct(sampler, dense_v.float(), old, resp, v, n, cc)
        corr.metrics["correction/staleness_split"] = 1.0
        return corr

    def _plan_micro_batches(self, keep: torch.Tensor):
        """Row slices, each slice's loss units (kept tokens or sequences) and the global total.

        The micro-batch count is the maximum over ranks, because ZeRO-2/3 run collectives inside
        every backward/forward; a rank with fewer rows runs 1-row micro-batches of weight 0.
        """
        import deepspeed.comm as dscomm
        from correction import LossAggregation

        per_seq = LossAggregation(self.correction_cfg.loss.aggregation) == LossAggregation.SEQ_MEAN
        rows = keep.shape[0]
        n_local = max(1, math.ceil(rows / self.cfg.micro_batch_size))
        unit_rows = keep.any(1).float() if per_seq else keep.sum(1).float()
        stats = torch.tensor([float(n_local), float(unit_rows.sum())], dtype=torch.float64)
        if self.world_size > 1:  # on the engine's device: NCCL reduces CUDA tensors only
            n = stats[:1].to(self.engine.device)
            dscomm.all_reduce(n, op=dscomm.ReduceOp.MAX)
            tot = stats[1:].to(self.engine.device)
            dscomm.all_reduce(tot, op=dscomm.ReduceOp.SUM)
            stats = torch.cat([n.cpu(), tot.cpu()])
        n_mb, total = int(stats[0]), float(stats[1])
        bounds = torch.linspace(0, rows, n_mb + 1).round().long().tolist()
        slices, units = [], []
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                slices.append(slice(a, b))
                units.append(float(unit_rows[a:b].sum()))
            else:  # padding micro-batch: keeps collectives in step across ranks, adds nothing
                slices.append(slice(0, 1))
                units.append(0.0)
        return slices, units, total

    def _plain_grad_norm(self) -> float:
        """Global grad norm before clipping when DeepSpeed does not record one (ZeRO-0 with a
        client optimizer keeps gradients in ``p.grad``, already all-reduced); 0 otherwise."""
        if int(self.cfg.zero_stage) != 0:
            return 0.0
        sq = [p.grad.float().pow(2).sum() for p in self.engine.module.parameters()
              if p.grad is not None]
        return float(torch.stack(sq).sum().sqrt()) if sq else 0.0

    def _micro_step(self, tensors, sl, adv, corr, temperature, share):
        """Forward + PPO loss + backward on rows ``sl``, trimmed to their longest sequence."""
        from correction import policy_loss

        dev = self.engine.device
        t = max(2, int(tensors["attention_mask"][sl].sum(1).max()))

        def cut(x):  # rows of this micro-batch, trimmed to its longest sequence, on the device
            return x[sl, :t].to(dev)

        ids, attn = cut(tensors["input_ids"]), cut(tensors["attention_mask"])
        if self.correction_cfg.loss.entropy_coef > 0:
            new_logp, entropy = logprobs_and_entropy(self.engine, ids, attn, temperature)
        else:  # the shared helper: the same numbers the scorer computes, no [B,T,V] entropy
            new_logp, entropy = token_logprobs(self.engine, ids, attn, temperature), None
        ref = tensors.get("ref_logprobs")
        loss, m = policy_loss(new_logp, cut(tensors["old_logprobs"]).float(), adv[sl].to(dev),
                              cut(corr.weights), cut(corr.loss_mask), self.correction_cfg,
                              ref_logp=None if ref is None else cut(ref).float(), entropy=entropy)
        # scale_wrt_gas=False: the share already normalises over every micro-batch of every rank
        self.engine.backward(loss * share, scale_wrt_gas=False)
        return loss.detach(), m

    # ---- weights --------------------------------------------------------------------------

    def _gather_full(self) -> None:
        """ZeRO-3: gather every parameter (a collective over all learner ranks) and keep a full
        copy on rank 0, so ``named_weights``/``save_hf``/broadcast work on rank 0 alone."""
        import deepspeed

        module = self.engine.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            if self.rank == 0:
                self._full = {n: p.detach().clone() for n, p in module.named_parameters()}

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Full (unpartitioned) weights with HF names, in ``named_parameters`` order.

        Under ZeRO-3 only rank 0 holds them (gathered after every step). In bf16 mode these are
        the bf16 module weights the forward used (the fp32 master copy stays in the optimiser).
        """
        if self._zero3:
            if self._full is None:
                raise RuntimeError("ZeRO-3 full weights are kept on learner rank 0 only")
            return list(self._full.items())
        return [(n, p.detach()) for n, p in self.engine.module.named_parameters()]

    def weight_spec(self):
        from cluster.weight_sync import weight_spec

        if self._zero3:
            return [(n, tuple(t.shape), t.dtype) for n, t in self.named_weights()]
        return weight_spec(self.engine.module)

    def state_checksum(self) -> float:
        return checksum(self.named_weights())

    def save_hf(self, path: str) -> str | None:
        """Rank 0 writes an HF model directory (safetensors + config + tokenizer files); other
        ranks do nothing. Returns the path on rank 0."""
        if self.rank != 0:
            return None
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        # ZeRO-3 parameters are partitioned: hand over the gathered copy instead of the module's
        state = dict(self._full) if self._zero3 else None
        self.engine.module.save_pretrained(str(out), state_dict=state)
        for name in _HF_SIDE_FILES:
            src = Path(self.model_path) / name
            if src.is_file():
                shutil.copy2(src, out / name)
        return str(out)

    # ---- checkpoints (all ranks) ----------------------------------------------------------

    def save_checkpoint(self, path: str) -> str:
        """DeepSpeed checkpoint (module, optimiser, LR scheduler, ZeRO partitions) plus the policy
        version, under ``path/v{version}``. A collective: every learner rank must call it."""
        tag = f"v{self.version}"
        rng = {"torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        self.engine.save_checkpoint(str(path), tag=tag,
                                    client_state={"version": self.version, "rng": rng})
        return str(Path(path) / tag)

    def load_checkpoint(self, path: str, tag: str | None = None) -> int:
        """Restore what ``save_checkpoint`` wrote (``tag`` None: the latest) on every rank;
        returns the restored version. Training then continues exactly where it stopped."""
        load_path, client = self.engine.load_checkpoint(str(path), tag=tag)
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {path} (tag {tag!r})")
        self.version = int(client["version"])
        rng = client.get("rng") or {}
        if rng.get("torch") is not None:
            torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        if self._zero3:
            self._gather_full()
        return self.version

    # ---- weight broadcast (rank 0) --------------------------------------------------------

    def init_weight_sync(self, host: str, port: int, world_size: int, backend: str = "gloo",
                         bucket_mb: int = 64, timeout_s: float = 300.0) -> None:
        """Join the weight-sync group as its rank 0 (learner rank 0 only). A collective with
        every receiver's ``init_weight_sync``; ``timeout_s`` bounds its waits and every send's."""
        from cluster.weight_sync import WeightSender

        if self.rank != 0:
            raise RuntimeError("only learner rank 0 sends weights")
        if self._sender is not None:  # re-forming (actor restart / pool resize): leave the old group
            self._sender.close()
        self._sender = WeightSender(host, port, world_size, self.weight_spec(), backend=backend,
                                    bucket_bytes=int(bucket_mb) << 20, timeout_s=float(timeout_s))

    def broadcast_weights(self) -> int:
        """Send the current weights tagged with ``version`` (a collective with every receiver's
        ``sync_weights``). Returns the version sent."""
        if self._sender is None:
            raise RuntimeError("init_weight_sync was not called on learner rank 0")
        self._sender.send(self.named_weights(), self.version)
        return self.version
