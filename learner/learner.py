"""The learner: a DeepSpeed ZeRO engine that takes corrected GRPO/PPO steps on scored batches.

A plain class; the driver wraps it with ``ray.remote`` and starts ``num_learners`` of them, one per
data-parallel rank, all joining DeepSpeed's default process group. Rank 0 also owns the weight-sync
sender (a *separate* group, see ``cluster/weight_sync.py``).

One ``train_step`` on this rank's shard of a batch that ``learner.batch.prepare_batch`` prepared
(GRPO advantages, IS weights and loss mask computed over the *whole* batch before the split):
  1. the shard's rows of each of the ``mini_batches`` mini-batches (``prepare_batch`` assigns whole
     groups to them, the same however many learners share the batch) are taken in turn, and the
     pass repeats ``epochs`` times; each mini-batch is one optimiser step (PPO: the old log-probs were scored before the
     first, so from the second on the ratio moves away from 1 and the clip can bind);
  2. a mini-batch is cut into micro-batches of at most ``micro_batch_size`` rows and
     ``max_tokens_per_micro_batch`` padded tokens; each gets new log-probs over its kept response
     tokens only (``common.modeling.token_logprobs``, vocabulary-chunked under checkpointing, at
     the rollout temperature), the PPO loss and a backward with DeepSpeed's accumulation boundary
     set by hand on the last one;
  3. ``engine.step()`` (grad clipping and LR schedule inside DeepSpeed); ``version`` += 1 per
     ``train_step``, i.e. per rollout batch (the unit the weight broadcast tags).
Each micro-batch loss is scaled by its share of the mini-batch's *global* (all ranks) kept tokens
(or sequences for ``seq_mean``), times the world size that DeepSpeed's gradient averaging divides
by, so the update equals the loss aggregated over the whole mini-batch however it is split.
Micro-batch counts (and, under ZeRO-3, LM-head chunk counts) are made equal on every rank, since
ZeRO-2/3 run collectives inside every forward/backward.

Under ZeRO-3 the parameters stay partitioned: the model is built inside ``zero.Init`` (through
transformers' ``HfDeepSpeedConfig``), and the broadcast, checksums and HF saves gather one
parameter at a time on every rank (collectives: the driver calls them on every learner).
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from common.devices import assigned_device
from common.dtypes import torch_dtype
from common.modeling import abs_sum, checksum_of_sums, load_model, token_logprobs
from learner.batch import PREPARED, combine_weighted
from learner.guard import (GRAD, LOSS, discard_grads, nonfinite_optimizer_state,
                           nonfinite_weight, step_fault)
from learner.config import LearnerConfig
from learner.engine_setup import (_check_no_dropout, _disable_shm_comm, _init_default_group,
                                   _param_groups, _reset_adam_step_counts, _set_dist_env,
                                   deepspeed_config, lr_lambda, use_assigned_device)


class PolicyForward(torch.nn.Module):
    """What DeepSpeed wraps: the HF causal LM's own modules, registered under the same names (so
    parameter names are the HF ones the actors use), with a forward that returns token log-probs
    (``common.modeling.token_logprobs``) instead of full logits. Going through the engine's
    forward matters: ZeRO-3 keeps per-forward state for gradient accumulation. ``hf`` (not a
    submodule) is the model itself, for its config and ``save_pretrained``."""

    def __init__(self, hf_model: torch.nn.Module):
        super().__init__()
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "hf", hf_model)

    def forward(self, input_ids, attention_mask, temperature, **kw):
        return token_logprobs(self.hf, input_ids, attention_mask, temperature, **kw)


class Learner:
    """One data-parallel DeepSpeed learner rank. See the module docstring for a step's anatomy."""

    def __init__(self, cfg: LearnerConfig, correction_cfg, model_path: str, rank: int = 0,
                 world_size: int = 1, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, local_rank: int | None = None, distill=None):
        """With ``master_port`` the DeepSpeed group forms here, at (master_addr, master_port).
        Without it (on Ray, ``cluster.pools.build_pools``) it forms at ``start``, on the address
        and port rank 0's ``listen`` picked on its own node (``cluster/rendezvous.py``).
        ``distill``: the ``rollout.distill_sparse`` section; enabled, this rank also trains the
        sparse sampler's LoRA adapter (``learner/distill.py``) after each base step and sends it
        with the weights."""
        cfg.validate("learner")
        if world_size != cfg.num_learners:
            raise ValueError(f"world_size={world_size} but learner.num_learners={cfg.num_learners}")
        self.cfg, self.correction_cfg = cfg, correction_cfg
        self.model_path, self.rank, self.world_size = str(model_path), rank, world_size
        self.version = 0
        torch.set_num_threads(cfg.num_threads)
        if local_rank is None:  # under Ray each GPU actor sees one device; elsewhere rank-per-GPU
            gpus = torch.cuda.device_count() if assigned_device().type == "cuda" else 0
            local_rank = rank % gpus if gpus > 1 else 0
        self.local_rank = local_rank
        self._sender = self._endpoint = self._ws_endpoint = None
        self._distill_cfg, self.distill = distill, None  # the adapter is built in ``start``
        if master_port is not None:
            self.start(master_addr, master_port)

    def listen(self) -> tuple[str, int]:
        """Rank 0: open the DeepSpeed group's store socket on this node's IP and a free port,
        held until ``start`` hands it to the store; returns (host, port) for every rank's
        ``start``."""
        from cluster.rendezvous import close_endpoint, open_endpoint

        if self.rank != 0:
            raise RuntimeError("only learner rank 0 serves the DeepSpeed group's store")
        close_endpoint(self._endpoint)
        self._endpoint = open_endpoint()
        return self._endpoint.address

    def start(self, master_addr: str, master_port: int) -> float:
        """Join DeepSpeed's group at (master_addr, master_port) and build the engine (every rank,
        at once: a collective). Returns the seconds it took."""
        cfg, rank, world_size = self.cfg, self.rank, self.world_size
        _set_dist_env(rank, world_size, self.local_rank, master_addr, master_port)
        fd = self._endpoint.fd if self._endpoint is not None else None
        self._endpoint = None  # the store owns the socket from here on
        backend = use_assigned_device()  # before deepspeed's import: it fixes its accelerator
        _init_default_group(rank, world_size, master_addr, master_port, fd, backend)

        import deepspeed

        if not cfg.cpu_shm_comm:
            _disable_shm_comm()
        # ZeRO-3's partitioned load (zero.Init, below) reads the world size from DeepSpeed's comm
        # layer: wrap the group made above first, or a fresh process loads for a world of 1
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
        torch.manual_seed(cfg.seed)
        t0 = time.time()
        self._zero3 = int(cfg.zero_stage) == 3
        ds_config = deepspeed_config(cfg, world_size)
        hf_zero3 = None
        if self._zero3:  # while it lives, from_pretrained builds the model in zero.Init, so the
            from transformers.integrations import HfDeepSpeedConfig  # weights load partitioned

            hf_zero3 = HfDeepSpeedConfig(ds_config)
        # loaded in the training dtype (never a full fp32 copy of a bf16 run); in eval mode unless
        # checkpointing, so at the start of a step the new log-probs equal the scorer's dense old
        # log-probs (PPO ratio 1); gradients flow in eval mode too
        model = load_model(self.model_path, dtype=torch_dtype(cfg.dtype))
        del hf_zero3  # a global switch of transformers: later loads in this process stay plain
        if cfg.gradient_checkpointing:
            _check_no_dropout(model)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr,
                                betas=tuple(cfg.betas), eps=cfg.eps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=PolicyForward(model), optimizer=opt, lr_scheduler=sched, config=ds_config)
        _reset_adam_step_counts(opt)
        self.init_seconds = time.time() - t0
        self._params = dict(self.engine.module.named_parameters())
        from learner.distill import make_adapter

        self.distill = make_adapter(self._distill_cfg, self.model_path, self._params, cfg,
                                    world_size)
        return self.init_seconds

    # ---- training -------------------------------------------------------------------------

    def train_step(self, tensors: dict, temperature: float = 1.0) -> dict:
        """``epochs`` x ``mini_batches`` optimiser steps on this rank's shard of a prepared batch
        (``buffer.tensors.to_tensors`` layout plus ``learner.batch.PREPARED`` keys).

        Every rank must call it (collectives inside). Returns this rank's float metrics: loss and
        loss/* (kept-unit weighted over its micro-batches; ``learner.batch.reduce_metrics``
        combines ranks), grad_norm (mean over optimiser steps), lr, counts, time; ``version``
        after the step. A mini-batch whose loss or gradients are not finite on any rank is not
        stepped (``learner.guard``): ``learner/skipped_steps``, by cause ``learner/skipped_loss``
        and ``learner/skipped_grad``; its losses stay out of the loss metrics.
        """
        from learner.plan import plan

        missing = [k for k in PREPARED if k not in tensors]
        if missing:
            raise ValueError(f"train_step: batch lacks {missing}: run learner.batch.prepare_batch "
                             "on the whole batch first")
        t0 = time.time()
        keep = tensors["loss_mask"] > 0
        minis = plan(tensors["attention_mask"].sum(1), self._unit_rows(keep), tensors["mini_batch"],
                     self.cfg.mini_batches, self.cfg.micro_batch_size,
                     self.cfg.max_tokens_per_micro_batch,
                     self._all_reduce if self.world_size > 1 else None)
        parts, norms, micro, skipped = [], [], 0, {LOSS: 0, GRAD: 0}
        for _ in range(self.cfg.epochs):
            for mb in minis:
                if mb.total <= 0:  # global, so every rank skips it: no kept token anywhere (Adam
                    continue       # would still move the weights on zero gradients)
                chunks = self._lm_head_chunks(tensors, keep, mb)
                mb_parts = []
                for i, (sl, unit) in enumerate(zip(mb.slices, mb.units)):
                    self.engine.set_gradient_accumulation_boundary(i == len(mb.slices) - 1)
                    share = unit * self.world_size / mb.total
                    loss, m = self._micro_step(tensors, sl, temperature, share, chunks[i])
                    if unit > 0:  # padding micro-batches (and all-rejected ones) report nothing
                        mb_parts.append((unit, float(loss), m))
                micro += len(mb.slices)
                # a non-finite loss or gradient on any rank: no rank steps (learner/guard.py)
                fault = step_fault(all(math.isfinite(x) for _, x, _ in mb_parts), self.engine,
                                   int(self.cfg.zero_stage),
                                   self._all_reduce if self.world_size > 1 else None)
                if fault is not None:
                    discard_grads(self.engine, int(self.cfg.zero_stage))
                    skipped[fault] += 1
                    continue
                parts += mb_parts
                own_norm = self._plain_grad_norm()
                self.engine.step()
                norm = self.engine.get_global_grad_norm()
                norms.append(float(own_norm if norm is None or norm == 0 else norm))
        distill = {} if self.distill is None or any(skipped.values()) else \
            self.distill.train_step(tensors, self.correction_cfg, temperature,  # after the base step
                                    self.cfg.micro_batch_size, self.cfg.mini_batches)
        self.version += 1
        units = sum(u for u, _, _ in parts)
        metrics = {"loss": 0.0, **combine_weighted([(u, {"loss": l, **m}) for u, l, m in parts])}
        resp = tensors["response_mask"]
        metrics.update({
            "grad_norm": sum(norms) / len(norms) if norms else 0.0,
            "lr": float(self.scheduler.get_last_lr()[0]), "version": float(self.version),
            "learner/stepped": float(bool(norms)), "learner/optimizer_steps": float(len(norms)),
            "learner/skipped_steps": float(sum(skipped.values())),
            "learner/skipped_loss": float(skipped[LOSS]), "learner/skipped_grad": float(skipped[GRAD]),
            "learner/micro_batches": float(micro), "learner/rows": float(resp.shape[0]),
            "learner/response_tokens": float(resp.sum()), "learner/kept_tokens": float(keep.sum()),
            "learner/loss_units": float(units), "time/train_s": time.time() - t0, **distill})
        return metrics

    def _unit_rows(self, keep: torch.Tensor) -> torch.Tensor:
        """Loss units per row: kept tokens (token_mean) or 1 per row with a kept token (seq_mean)."""
        from correction import LossAggregation

        per_seq = LossAggregation(self.correction_cfg.loss.aggregation) == LossAggregation.SEQ_MEAN
        return keep.any(1).double() if per_seq else keep.sum(1).double()

    def _all_reduce(self, values: torch.Tensor, op: str) -> torch.Tensor:
        """``values`` reduced over the learner ranks (on the engine's device: NCCL reduces CUDA
        tensors only)."""
        import deepspeed.comm as dscomm

        t = values.to(self.engine.device)
        dscomm.all_reduce(t, op=dscomm.ReduceOp.MAX if op == "max" else dscomm.ReduceOp.SUM)
        return t.cpu()

    def _lm_head_chunks(self, tensors: dict, keep: torch.Tensor, mb) -> list[int]:
        """Per micro-batch, how many LM-head chunks ``token_logprobs`` runs. Under ZeRO-3 with
        several ranks each chunk gathers the head's weight (a collective), so every rank runs
        the largest count of any rank (extra chunks are empty); elsewhere 0 (as many as needed)."""
        if not (self._zero3 and self.world_size > 1):
            return [0] * len(mb.slices)
        c = self.cfg.logprob_chunk_tokens
        need = torch.tensor([float(-(-int(keep[sl][:, 1:].sum()) // c)) for sl in mb.slices],
                            dtype=torch.float64)
        return [int(x) for x in self._all_reduce(need, "max").tolist()]

    def _plain_grad_norm(self) -> float:
        """Global grad norm before clipping when DeepSpeed does not record one (ZeRO-0 with a
        client optimizer keeps gradients in ``p.grad``, already all-reduced); 0 otherwise."""
        if int(self.cfg.zero_stage) != 0:
            return 0.0
        sq = [p.grad.float().pow(2).sum() for p in self.engine.module.parameters()
              if p.grad is not None]
        return float(torch.stack(sq).sum().sqrt()) if sq else 0.0

    def _micro_step(self, tensors, sl, temperature, share, min_chunks):
        """Forward + PPO loss + backward on rows ``sl``, trimmed to their longest sequence;
        log-probs only at kept tokens (the loss reads nothing else). The loss is NaN when the
        forward's log-probs (or entropies) were not finite."""
        from correction import policy_loss

        dev = self.engine.device
        t = max(2, int(tensors["attention_mask"][sl].sum(1).max()))

        def cut(x):  # rows of this micro-batch, trimmed to its longest sequence, on the device
            return x[sl, :t].to(dev)

        cc = self.correction_cfg
        keep = cut(tensors["loss_mask"])
        entropy = None
        out = self.engine(cut(tensors["input_ids"]), cut(tensors["attention_mask"]), temperature,
                          response_mask=keep, with_entropy=cc.loss.entropy_coef > 0,
                          chunk_tokens=self.cfg.logprob_chunk_tokens, min_chunks=min_chunks)
        new_logp, entropy = out if cc.loss.entropy_coef > 0 else (out, None)
        # a forward that blew up: the loss is refused below (learner.guard), but this backward
        # must still run, on finite numbers, to keep ZeRO's collectives in step with other ranks
        finite = all(x is None or bool(torch.isfinite(x[keep.bool()]).all())
                     for x in (new_logp, entropy))
        if not finite:
            new_logp, entropy = (None if x is None else torch.nan_to_num(x, 0.0, 0.0, 0.0)
                                 for x in (new_logp, entropy))
        ref = tensors.get("ref_logprobs")
        loss, m = policy_loss(new_logp, cut(tensors["old_logprobs"]).float(),
                              tensors["advantages"][sl].to(dev), cut(tensors["is_weights"]), keep,
                              cc, ref_logp=None if ref is None else cut(ref).float(),
                              entropy=entropy)
        # scale_wrt_gas=False: the share already normalises over every micro-batch of every rank
        self.engine.backward(loss * share, scale_wrt_gas=False)
        return (loss.detach() if finite else torch.tensor(float("nan"))), m

    # ---- weights (ZeRO-3: collectives, every rank calls them) ------------------------------

    @contextmanager
    def _full(self, name: str):
        """The full parameter ``name``: as is, or under ZeRO-3 gathered for the duration (every
        rank must enter for the same names in the same order)."""
        p = self._params[name]
        if not self._zero3:
            yield p.detach()
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            yield p.detach()

    def _abs_sums(self) -> dict[str, float]:
        sums = {}
        for name in self._params:
            with self._full(name) as t:
                sums[name] = abs_sum(t)
        return sums

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Full weights with HF names, in ``named_parameters`` order. Under ZeRO-3 a collective
        that gathers a CPU copy of every parameter (tests, HF saves; never the broadcast). In bf16
        these are the bf16 module weights the forward used (fp32 masters stay in the optimiser)."""
        if not self._zero3:
            return [(n, p.detach()) for n, p in self._params.items()]
        out = []
        for name in self._params:
            with self._full(name) as t:
                out.append((name, t.cpu().clone()))
        return out

    def weight_spec(self):
        """What the broadcast carries: the parameters, then the sampler's adapter, if any."""
        return [(n, tuple(getattr(p, "ds_shape", p.shape)), p.dtype)
                for n, p in self._params.items()] + (self.distill.spec() if self.distill else [])

    def state_checksum(self) -> float:
        """``common.modeling.checksum`` of what the broadcast carries (ZeRO-3: a collective)."""
        extra = self.distill.abs_sums() if self.distill is not None else {}
        return checksum_of_sums({**self._abs_sums(), **extra})

    def check_finite(self, optimizer: bool = True, collective: bool = True) -> None:
        """Raise ``TrainingFault`` naming a tensor when a weight (and, with ``optimizer``, an
        optimiser master weight or moment) of this rank is NaN or inf, so nothing is ever saved
        from poisoned weights. ``collective``: every rank calls it and all take the decision
        together (a rank whose own partition is clean must not go on into a save's collectives)."""
        from common.errors import TrainingFault

        bad = nonfinite_weight(self._params)
        if bad is None and optimizer:
            bad = nonfinite_optimizer_state(self.optimizer)
        flag = torch.tensor([float(bad is not None)], dtype=torch.float64)
        if collective and self.world_size > 1:
            flag = self._all_reduce(flag, "max")
        if flag[0] > 0:
            where = f"{bad!r} on learner rank {self.rank}" if bad else "another learner rank"
            raise TrainingFault(f"refusing to save: non-finite weights or optimiser state "
                                f"({where}) at policy version {self.version}")

    def save_hf(self, path: str) -> str | None:
        """Rank 0 writes an HF model directory (safetensors, config, generation config and the
        tokenizer through ``save_pretrained``, so it is a complete ``model_path``); under ZeRO-3
        every rank must call it (the weights are gathered). Returns the path on rank 0.
        Refuses (``check_finite``) non-finite weights."""
        from common.modeling import load_tokenizer

        self.check_finite(optimizer=False, collective=self._zero3)
        state = dict(self.named_weights()) if self._zero3 else None
        if self.rank != 0:
            return None
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.engine.module.hf.save_pretrained(str(out), state_dict=state)
        load_tokenizer(self.model_path).save_pretrained(str(out))
        if self.distill is not None:  # the model stays the base; the sampler's adapter beside it
            self.distill.save(out, optimizer=False)
        return str(out)

    # ---- checkpoints (all ranks) ----------------------------------------------------------

    def save_checkpoint(self, path: str) -> str:
        """DeepSpeed checkpoint (module, optimiser, LR scheduler, ZeRO partitions) plus the policy
        version, under ``path/v{version}``. A collective: every learner rank must call it.
        Refuses (``check_finite``) non-finite weights or optimiser state before writing."""
        self.check_finite()
        tag = f"v{self.version}"
        on_gpu = self.engine.device.type == "cuda"  # a CPU rank on a GPU node leaves CUDA alone
        rng = {"torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state_all() if on_gpu else None}
        self.engine.save_checkpoint(str(path), tag=tag,
                                    client_state={"version": self.version, "rng": rng})
        if self.distill is not None and self.rank == 0:  # replicated on every rank
            self.distill.save(Path(path) / tag)
        return str(Path(path) / tag)

    def load_checkpoint(self, path: str, tag: str | None = None) -> int:
        """Restore what ``save_checkpoint`` wrote (``tag`` None: the latest) on every rank;
        returns the restored version. Training then continues exactly where it stopped."""
        load_path, client = self.engine.load_checkpoint(str(path), tag=tag)
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {path} (tag {tag!r})")
        self.version = int(client["version"])
        if self.distill is not None:
            self.distill.load(Path(path) / (tag or f"v{self.version}"))
        rng = client.get("rng") or {}
        if rng.get("torch") is not None:
            torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and self.engine.device.type == "cuda":
            torch.cuda.set_rng_state_all(rng["cuda"])
        return self.version

    # ---- weight broadcast -----------------------------------------------------------------

    def open_weight_sync(self, port: int = 0) -> tuple[str, int]:
        """Learner rank 0: listen for the weight-sync group on this node's IP and ``port`` (0: a
        free one); returns (host, port) for every member's ``init_weight_sync``."""
        from cluster.rendezvous import close_endpoint, open_endpoint

        if self.rank != 0:
            raise RuntimeError("only learner rank 0 serves the weight-sync group")
        close_endpoint(self._ws_endpoint)
        self._ws_endpoint = open_endpoint(port)
        return self._ws_endpoint.address

    def init_weight_sync(self, host: str, port: int, world_size: int, backend: str = "gloo",
                         bucket_mb: int = 64, timeout_s: float = 300.0) -> None:
        """Join the weight-sync group as its rank 0 (learner rank 0 only), on the socket
        ``open_weight_sync`` opened for (host, port), else one bound here. A collective with
        every receiver's ``init_weight_sync``; ``timeout_s`` bounds its waits and every send's.
        Under ZeRO-3 the weights stream out one gathered parameter at a time, over TCP/NCCL
        (the same-host shared-memory ring wants every bucket at hand at once)."""
        from cluster.rendezvous import take_endpoint
        from cluster.weight_sync import WeightSender

        if self.rank != 0:
            raise RuntimeError("only learner rank 0 sends weights")
        if self._sender is not None:  # re-forming (actor restart / pool resize): leave the old group
            self._sender.close()
        sock, self._sender, self._ws_endpoint = take_endpoint(self._ws_endpoint, host, port), \
            None, None
        self._sender = WeightSender(host, port, world_size, self.weight_spec(), backend=backend,
                                    bucket_bytes=int(bucket_mb) << 20, timeout_s=float(timeout_s),
                                    same_host_shm=not self._zero3, listen_sock=sock)

    def broadcast_weights(self) -> int:
        """Rank 0 sends the current weights tagged with ``version`` (a collective with every
        receiver's ``sync_weights``). Under ZeRO-3 every learner rank must call it: parameters
        are gathered one at a time (a collective), sent, and released, so no rank ever holds a
        full copy. Returns the version."""
        if self.rank != 0:
            if self._zero3:
                for name in self._params:  # the same gathers, in the same order, as rank 0's send
                    with self._full(name):
                        pass
            return self.version
        if self._sender is None:
            raise RuntimeError("init_weight_sync was not called on learner rank 0")
        if not self._zero3:
            self._sender.send(self.named_weights() + (self.distill.named() if self.distill else []),
                              self.version)
            return self.version
        adapter = dict(self.distill.named()) if self.distill else {}  # replicated: no gather

        @contextmanager
        def fetch(name: str):
            if name in adapter:
                yield adapter[name]
            else:
                with self._full(name) as t:
                    yield t

        self._sender.send_streamed(fetch, self.version)
        return self.version
