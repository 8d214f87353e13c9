"""``VLLMEngine``: the ``actors.engine.Engine`` protocol on vLLM (in-process ``LLM``), dense, with a
sliding-window KV cache (``rollout.kv.policy=streaming``) or with score-based eviction (``h2o``,
``snapkv``, ``rkv``: ``actors/vllm/evict``, blocks returned to vLLM's pool as requests compact).

* Log-probs: the engine runs with ``logprobs_mode="processed_logprobs"``: the log-prob of each sampled
  token under the distribution it was drawn from (after temperature, top-k, top-p), as the native
  engine's ``logprob_mode="processed"``. vLLM's default (``raw_logprobs``) is taken before temperature.
  ``logprob_mode="raw"`` (``log_softmax(logits / T)`` without truncation) is the same number when
  top-k and top-p are off and is refused otherwise.
* Sampling: every prompt is its own request; with ``SamplingParams.seed`` request i gets seed
  ``seed * 1000003 + i`` (equal prompts must not share a seed, or the G samples of a group coincide).
  Generation stops only at ``stop_token_ids`` (the stop token is kept, finish_reason "stop") or at
  ``max_new_tokens`` ("length"); the model's own EOS is ignored unless listed, as in the native engine.
  Stop strings (``SamplingParams.stop``) go to vLLM's own stop-string check, which detokenizes
  incrementally (so the engine loads the model's tokenizer; requests without stop strings are not
  detokenized): vLLM keeps the token that completed the string in ``token_ids`` and its log-prob,
  finish_reason "stop", as the native engine does. Only the detokenized *text* is cut at the string,
  and the engine returns ids, not text.
* KV: ``peak_kv_bytes`` is measured, not estimated: after every scheduling step the engine counts the
  KV blocks each request holds in vLLM's KV manager (blocks freed by the sliding window excluded), so
  it is block-granular (``block_size`` tokens). ``kept_ratio`` is computed as the native engine
  counts it (``actors.vllm.kv.kept_ratio``).
* Weights: ``load_weights`` validates HF-named tensors, then reloads them in memory through the model
  runner's ``reload_weights(weights_iterator=...)`` and resets the prefix cache. Tensors keep the
  device they arrive on (CUDA with ``cluster.weight_sync_backend=nccl``): no device -> host -> device
  round trip. Broadcasts reach the engine the same way on every backend: the rollout actor's
  ``cluster.weight_sync`` receiver stages them (``actors.weights``), then ``load_weights``.
* Resources (``rollout.vllm``, ``VLLMConfig``): on GPU ``gpu_memory_utilization`` and
  ``tensor_parallel_size`` go to vLLM (and ``kv_cache_bytes`` only when set); on CPU the KV pool is
  ``kv_cache_bytes`` (default: ``_pool_bytes``) and tensor parallelism is refused. ``max_model_len``
  is derived from the prompt limit and ``max_new_tokens`` (``derive_max_model_len``).
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from actors.config import KVConfig, longest_prompt
from actors.engine import GenerationOutput, SamplingParams
from actors.vllm import kv as kvmod
from actors.vllm.env import setup_env
from actors.vllm.evict.rule import DENSE_PREFIX, BudgetTable
from actors.vllm.limits import lora_slots
from actors.vllm.weights import Ledger, hf_skeleton, refresh_tied_head, spec_of, validate
from common.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ADAPTER, ADAPTER_ID = "distill_sparse", 1     # the one LoRA adapter an engine serves


def _check_gpu_assigned(cpu: bool) -> None:
    """A CUDA build of vLLM in a process Ray gave no GPU would still find the node's GPUs (Ray
    leaves CUDA_VISIBLE_DEVICES alone then) and take memory on one another actor owns. Only a
    Ray worker that was assigned none is refused; elsewhere vLLM finds what it finds."""
    from common.devices import ray_gpu_ids

    if not cpu and ray_gpu_ids() == []:
        raise ConfigError("cluster.rollout_gpus", 0, ">= 1 with a CUDA build of vLLM (this "
                          "rollout actor was assigned no GPU); or the CPU build (make vllm)")


class VLLMEngine:
    def __init__(self, model_path: str | Path, kv: KVConfig | None = None, batch_size: int = 64,
                 dtype: str = "float32", kv_cache_bytes: int | None = None,
                 max_model_len: int | None = None, seed: int = 0, threads: int | None = 1,
                 enforce_eager: bool | None = None,
                 block_size: int | None = None, gpu_memory_utilization: float = 0.9,
                 tensor_parallel_size: int = 1, trace: bool = False,
                 scoring_copy: bool = False, lora_rank: int = 0):
        setup_env()
        self.model_path = str(model_path)
        self.kv = kv or KVConfig()
        self.kv.validate("rollout.kv")
        self.policy = kvmod.check_policy(self.kv)
        self.window = kvmod.window_of(self.kv)
        self.evicting = kvmod.evicting(self.kv)
        self.trace = bool(trace)
        self.dtype = DTYPES[getattr(dtype, "value", dtype)]
        self.batch_size = int(batch_size)
        # Meta-device HF model: names/shapes for the weight spec (RolloutActor.weight_spec uses
        # ``engine.model``); it holds no weights.
        self.model = hf_skeleton(self.model_path, self.dtype)
        self._spec = spec_of(self.model)
        self._ledger = Ledger(self.dtype)
        self._ledger.record_checkpoint(self.model_path, self._spec)
        # An HF model with the same weights, for teacher-forced dense log-probs in the actor
        # (rollout.dense_logprobs, the staleness split): vLLM's prompt log-probs are at
        # temperature 1 only. One more copy of the weights; kept in step by load_weights.
        self.scoring_model = None
        if scoring_copy:
            from common.modeling import load_model

            self.scoring_model = load_model(self.model_path, dtype=self.dtype)
        self.version = 0
        self.last_stats: dict = {}
        self._calls = 0
        self._broken: str | None = None
        if threads:
            torch.set_num_threads(int(threads))   # before vLLM freezes the thread count
        self.gpu_memory_utilization = float(gpu_memory_utilization)
        self.tensor_parallel_size = int(tensor_parallel_size)
        self.lora_rank = lora_slots(lora_rank) if lora_rank else 0   # 0: no LoRA
        self._lora, self._lora_dir = None, None
        self.llm = self._start(kv_cache_bytes, max_model_len, seed, enforce_eager, block_size)
        self.eviction = None
        if self.evicting:
            from actors.vllm.evict.install import install

            self.eviction = install(self.llm, self.kv, trace=self.trace)
        self.meter = kvmod.KVMeter(self.llm)

    @classmethod
    def from_config(cls, cfg, model_path: str | None = None, **overrides) -> "VLLMEngine":
        """From a ``RolloutConfig``: ``batch_size``, ``dtype``, ``seed``, ``kv`` and the vLLM-only
        ``rollout.vllm`` section (``max_model_len`` derived when 0); keyword overrides win."""
        path = model_path or cfg.model_path
        v = cfg.vllm
        kw = dict(kv=cfg.kv, batch_size=cfg.batch_size, dtype=getattr(cfg.dtype, "value", cfg.dtype),
                  seed=cfg.seed, kv_cache_bytes=v.kv_cache_bytes or None,
                  gpu_memory_utilization=v.gpu_memory_utilization,
                  tensor_parallel_size=v.tensor_parallel_size,
                  scoring_copy=bool(cfg.dense_logprobs))
        if cfg.distill_sparse.enabled:   # the sampler's adapter, and the kept sets it trains under
            kw.update(lora_rank=int(cfg.distill_sparse.rank), trace=True)
        if "max_model_len" not in overrides:
            from transformers import AutoConfig

            from common.modeling import HF_LOAD

            model_cfg = AutoConfig.from_pretrained(str(path), **HF_LOAD)
            kw["max_model_len"] = derive_max_model_len(cfg, model_cfg)
        kw.update(overrides)
        return cls(path, **kw)

    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers (from the HF config)."""
        from common.modeling import hf_kv_bytes_per_token

        return hf_kv_bytes_per_token(self.model.config, self.dtype)

    def _pool_bytes(self, max_model_len: int, block_size: int | None) -> int:
        """Default KV pool: every one of ``batch_size`` sequences at its longest (``max_model_len``
        tokens dense, the window + 2 blocks sliding, the largest budget + ``compress_every`` + a
        block evicting), plus a block each, and at least one ``max_model_len`` sequence; within
        [16 MiB, 1 GiB]."""
        block = block_size or 128
        tokens = max_model_len
        if self.window is not None:
            tokens = min(max_model_len, self.window + 2 * block)
        elif self.evicting:
            tokens = min(max_model_len, max(self.kv.bin_budgets()) + self.kv.compress_every + block)
        # vLLM refuses to start unless one max_model_len sequence fits: a prefill is dense
        need = max(self.batch_size * (tokens + block), max_model_len + block) * \
            self.kv_bytes_per_token()
        return int(min(max(need, 16 << 20), 1 << 30))

    def _start(self, kv_cache_bytes, max_model_len, seed, enforce_eager, block_size):
        from vllm import LLM
        from vllm.platforms import current_platform

        from common.modeling import HF_LOAD

        cpu = current_platform.is_cpu()
        _check_gpu_assigned(cpu)
        max_model_len = self._check_max_model_len(max_model_len)
        self._check_tensor_parallel(cpu)
        kwargs = dict(
            model=self.model_path, tokenizer=self.model_path, skip_tokenizer_init=False,
            trust_remote_code=HF_LOAD["trust_remote_code"], load_format="safetensors",
            dtype={torch.float32: "float32", torch.bfloat16: "bfloat16",
                   torch.float16: "float16"}[self.dtype],
            seed=int(seed), max_num_seqs=self.batch_size,
            logprobs_mode="processed_logprobs", generation_config="vllm",
            enforce_eager=cpu if enforce_eager is None else enforce_eager,
            hf_overrides=kvmod.hf_overrides(self.kv, self.model.config.num_hidden_layers),
            max_model_len=max_model_len, tensor_parallel_size=self.tensor_parallel_size)
        if self.evicting:
            from actors.vllm.evict.install import llm_kwargs

            kwargs.update(llm_kwargs(self.kv, cpu))
        if cpu:  # no device memory to take a share of: an explicit pool
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes or
                                                  self._pool_bytes(max_model_len, block_size))
            # No chunked prefill on CPU: a seeded request whose prefill is split has its partial
            # step's sample discarded, and vLLM 0.32 then rewinds the request's generator offset,
            # which CPU generators do not have ("CPU Generator does not use offset"): it happened
            # to requests recomputed after a preemption in a full pool. Whole prefills instead.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(int(max_model_len), 4096)
        else:    # vLLM sizes the pool from what the share leaves, unless given exactly
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
            if kv_cache_bytes:
                kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        if block_size:
            kwargs["block_size"] = int(block_size)
        if self.lora_rank:
            kwargs.update(enable_lora=True, max_lora_rank=self.lora_rank, max_loras=1)
        return LLM(**kwargs)

    def _check_max_model_len(self, max_model_len: int | None) -> int:
        """``max_model_len`` (None: the model's limit) if the model's positions allow it."""
        limit = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        n = int(max_model_len or limit)
        if n <= 0:
            raise ConfigError("rollout.vllm.max_model_len", max_model_len,
                              "> 0 (the model config has no max_position_embeddings to derive "
                              "it from)")
        # VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 is vLLM's own opt-in to extrapolate RoPE past the
        # model's positions (the native engine always may): honoured, not implied
        if limit and n > limit and os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1":
            raise ConfigError("rollout.vllm.max_model_len", n,
                              f"<= the model's max_position_embeddings ({limit}); when derived, "
                              "lower the longest prompt or rollout.max_new_tokens")
        return n

    def _check_tensor_parallel(self, cpu: bool) -> None:
        tp, heads = self.tensor_parallel_size, int(self.model.config.num_attention_heads)
        if tp > 1 and cpu:
            raise ConfigError("rollout.vllm.tensor_parallel_size", tp,
                              "1 on CPU (tensor parallelism is for GPUs)")
        if heads % tp:
            raise ConfigError("rollout.vllm.tensor_parallel_size", tp,
                              f"a divisor of the model's {heads} attention heads")
        if tp > 1 and self.evicting:
            raise ConfigError("rollout.vllm.tensor_parallel_size", tp,
                              f"1 with rollout.kv.policy={self.kv.policy.value} (every worker would "
                              "need the same kept sets: not implemented)")

    # ---- generation ------------------------------------------------------------------------------
    def _sampling(self, params: SamplingParams, index: int):
        from vllm import SamplingParams as VSP

        mode = getattr(params.logprob_mode, "value", params.logprob_mode)
        truncated = params.temperature > 0 and (params.top_k > 0 or params.top_p < 1.0)
        if mode == "raw" and truncated:
            raise ValueError("rollout.logprob_mode='raw' with top-k/top-p is not available with "
                             "rollout.engine=vllm (vLLM reports processed log-probs); use 'processed'")
        seed = None if params.seed is None else (int(params.seed) * 1_000_003 + index) % (1 << 63)
        return VSP(max_tokens=int(params.max_new_tokens), temperature=float(params.temperature),
                   top_p=float(params.top_p), top_k=int(params.top_k), seed=seed, logprobs=0,
                   stop_token_ids=[int(t) for t in params.stop_token_ids], ignore_eos=True,
                   stop=list(params.stop) or None, detokenize=bool(params.stop))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 dense: bool = False, adapter: bool = False) -> list[GenerationOutput]:
        """``dense=True``: these requests are never compacted (evaluation of the model itself on
        an evicting engine, ``dense_view``); other policies ignore it (dense or windowed).
        ``adapter=True``: sampled with the LoRA adapter of ``set_adapter`` (``adapter_view``)."""
        if self._broken:
            raise RuntimeError(self._broken)
        if adapter and self._lora is None:
            raise RuntimeError("vllm engine: generate(adapter=True) before set_adapter")
        lora_request = self._lora if adapter else None
        if any(len(p) == 0 for p in prompts):
            raise ValueError("vllm engine: empty prompt (every prompt needs at least one token)")
        engine = self.llm.llm_engine
        call, self._calls = self._calls, self._calls + 1
        index: dict[str, int] = {}
        internal: list[str] = []
        self.meter.reset()
        t0 = time.perf_counter()
        finished: dict[int, object] = {}
        try:
            for i, p in enumerate(prompts):
                ext = f"{DENSE_PREFIX if dense and self.evicting else ''}c{call}-r{i}"
                rid = engine.add_request(ext, {"prompt_token_ids": [int(t) for t in p]},
                                         self._sampling(params, i), lora_request=lora_request)
                index[ext] = index[rid] = i
                internal.append(rid)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[index[out.request_id]] = out
        except BaseException:
            # leave no request behind for the next call (e.g. a prompt longer than max_model_len)
            if internal:
                engine.abort_request(internal, internal=True)
            raise
        elapsed = time.perf_counter() - t0
        traces = {}
        if self.evicting and self.trace:
            from actors.vllm.evict.install import traces as fetch

            traces = fetch(self.llm, internal)
        outs = [self._output(prompts[i], finished[i], internal[i], traces.get(internal[i], []),
                             dense) for i in range(len(prompts))]
        self.last_stats = {"allocated_kv_bytes": self.meter.pool_bytes(),
                           "peak_kv_bytes": self.meter.peak_total, "time_s": elapsed,
                           "concurrent_requests": self.meter.concurrent,
                           "max_concurrent_requests": self.meter.max_concurrent,
                           "preemptions": self.meter.preemptions,
                           "tokens": sum(len(o.response_ids) for o in outs)}
        return outs

    def _output(self, prompt, req_out, rid: str, trace: list, dense: bool) -> GenerationOutput:
        c = req_out.outputs[0]
        ids = [int(t) for t in c.token_ids]
        logps = [float(next(iter(d.values())).logprob) if len(d) == 1 else
                 float(d[t].logprob) for d, t in zip(c.logprobs or [], ids)]
        if len(logps) != len(ids):
            raise RuntimeError(f"vllm engine: {len(logps)} log-probs for {len(ids)} tokens")
        reason = "stop" if c.finish_reason == "stop" else "length"
        if dense and self.evicting:
            kept, bin_budgets = 1.0, []
        elif self.evicting:
            kept = kvmod.evicted_kept_ratio(len(prompt), len(ids), self.kv)
            table = BudgetTable(self.kv)      # the rule's own per-position lookup
            bins = -(-(len(prompt) + len(ids)) // table.bin_tokens)
            bin_budgets = [table.at(b * table.bin_tokens) for b in range(bins)]
        else:
            kept, bin_budgets = kvmod.kept_ratio(len(prompt), len(ids), self.window), []
        return GenerationOutput(
            prompt_ids=list(prompt), response_ids=ids, logprobs=logps, finish_reason=reason,
            kept_ratio=kept, peak_kv_bytes=int(self.meter.peak.get(rid, 0)), trace=trace,
            bin_budgets=bin_budgets)

    def dense_view(self) -> "DenseView":
        """This engine decoding with a full cache (``generate(..., dense=True)``): evaluation
        measures the model, not the sparse sampler."""
        return DenseView(self)

    # ---- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Validate, then reload in memory (``reload_weights``), then reset the prefix cache.

        Tensors stay on the device they come on: with an NCCL weight-sync group they are CUDA
        tensors and reach vLLM's GPU parameters without a trip through host memory. (With
        ``tensor_parallel_size > 1`` vLLM's workers are other processes and ``collective_rpc``
        pickles the tensors.)
        """
        if self._broken:
            raise RuntimeError(self._broken)
        items = validate(named_tensors, self._spec)
        items = [(n, t.detach().to(dtype=self.dtype).contiguous()) for n, t in items]
        try:
            self.llm.collective_rpc("reload_weights",
                                    kwargs={"weights_iterator": iter(items),
                                            "is_checkpoint_format": True})
            self.llm.collective_rpc(refresh_tied_head)   # else a tied head keeps the old weights
        except BaseException as exc:
            self._broken = (f"vllm engine: weight reload failed ({exc!r}); its parameters may be "
                            f"on the meta device: rebuild the engine")
            raise
        self.llm.reset_prefix_cache()
        if self.scoring_model is not None:
            params = dict(self.scoring_model.named_parameters())
            for name, tensor in items:
                params[name].data.copy_(tensor)
        self._ledger.record(items)
        self.version = int(version)

    def state_checksum(self) -> float:
        """``common.modeling.checksum`` of the HF-named weights last loaded successfully (vLLM's own
        parameters are fused/repacked and cannot be read back as HF tensors), each tensor's
        share computed on the device it arrived on."""
        return self._ledger.checksum()

    def weight_sums(self) -> dict[str, float]:
        return dict(self._ledger.sums)

    # ---- the sparse sampler's LoRA adapter (DistillSparse) --------------------------------
    def set_adapter(self, tensors: dict[str, torch.Tensor], cfg) -> None:
        """Serve ``tensors`` (``common.lora`` wire names; ``cfg``: ``DistillSparseConfig``) as
        the LoRA adapter of ``adapter_view`` requests: written as a peft folder and loaded in
        place under one adapter id (vLLM applies ``scale * B @ A`` beside each base layer, so the
        base weights, dense requests and ``dense_view`` never see it)."""
        from vllm.lora.request import LoRARequest

        from common import lora

        if not self.lora_rank:
            raise RuntimeError("vllm engine: set_adapter needs an engine built with lora_rank > 0")
        if int(cfg.rank) > self.lora_rank:
            raise ValueError(f"vllm engine: adapter rank {cfg.rank} > the engine's "
                             f"{self.lora_rank}")
        if self._lora_dir is None:
            import tempfile

            self._lora_dir = tempfile.TemporaryDirectory(prefix="sparse-rl-lora-")
        path = lora.write_adapter(self._lora_dir.name, tensors, cfg)
        self.llm.llm_engine.add_lora(LoRARequest(ADAPTER, ADAPTER_ID, str(path), load_inplace=True))
        self._lora = LoRARequest(ADAPTER, ADAPTER_ID, str(path))

    def adapter_view(self) -> "AdapterView":
        """This engine sampling with the adapter (``set_adapter``): the DistillSparse sampler."""
        return AdapterView(self)


class AdapterView:
    """``generate`` of a vLLM engine with its LoRA adapter on every request (``set_adapter``)."""

    def __init__(self, engine: VLLMEngine):
        self.engine = engine
        self.policy = engine.policy

    def generate(self, prompts, params: SamplingParams) -> list[GenerationOutput]:
        return self.engine.generate(prompts, params, adapter=True)


class DenseView:
    """``generate`` of a vLLM engine with every request dense (the ``Engine`` protocol's call)."""

    def __init__(self, engine: VLLMEngine):
        self.engine = engine
        self.policy = kvmod.KVPolicy("dense")

    def generate(self, prompts, params: SamplingParams) -> list[GenerationOutput]:
        return self.engine.generate(prompts, params, dense=True)


def derive_max_model_len(cfg, model_config) -> int:
    """``rollout.vllm.max_model_len``, or when 0 the longest prompt allowed plus
    ``rollout.max_new_tokens``; without a prompt limit (``actors.config.longest_prompt``) the
    model's ``max_position_embeddings``, the longest any prompt + response can be."""
    if cfg.vllm.max_model_len:
        return int(cfg.vllm.max_model_len)
    prompt = longest_prompt(cfg)
    if prompt:
        return prompt + int(cfg.max_new_tokens)
    return int(getattr(model_config, "max_position_embeddings", 0) or 0)
