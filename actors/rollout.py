"""Rollout actor: generates G samples per problem with the sparse (compressed-KV) engine.

A plain class; the driver wraps it with ``ray.remote(RolloutActor)``. Rows follow
docs/INTERFACES.md "Buffer rows". Rewards come from ``tasks.make_task(task_cfg).reward`` on the decoded
response; weights arrive versioned through ``cluster.weight_sync`` (``init_weight_sync`` once, then
``sync_weights`` between generation batches) or directly through ``load_weights``.
"""
from __future__ import annotations

import threading
import time
from dataclasses import is_dataclass

import torch

from actors.config import KVPolicy, RolloutConfig
from actors.engine import SamplingParams, make_engine


def _as_object(cfg):
    """OmegaConf DictConfig -> the dataclass it was built from; dataclasses pass through."""
    if cfg is None or is_dataclass(cfg):
        return cfg
    from omegaconf import OmegaConf

    return OmegaConf.to_object(cfg)


class RolloutActor:
    def __init__(self, cfg: RolloutConfig, task_cfg, model_path: str | None = None,
                 actor_id: int = 0):
        torch.set_num_threads(1)
        from common.modeling import load_tokenizer
        from common.tokens import PromptEncoder, eos_token_ids, max_positions

        self.cfg = _as_object(cfg)
        self.cfg.validate("rollout")
        self.task_cfg = _as_object(task_cfg)
        self.model_path = model_path or self.cfg.model_path
        self.actor_id = actor_id
        self.engine = make_engine(self.cfg, self.model_path)
        # DistillSparse: the sparse sampler runs base + LoRA adapter on a copy of the model
        self.adapter = None
        if self.cfg.distill_sparse.enabled:
            from actors.sampler_adapter import SamplerAdapter

            self.adapter = SamplerAdapter(self.cfg, self.engine)
        self.tokenizer = load_tokenizer(self.model_path)
        # chat template + length rule (the driver already dropped or refused over-long prompts)
        self.prompts = PromptEncoder.from_config(self.tokenizer, self.cfg,
                                                 max_positions(self.model_path))
        self.stop_ids = eos_token_ids(self.tokenizer, self.model_path)  # + generation_config's
        self.version = 0
        self._task = None
        self._receiver = None
        self._calls = 0
        self._dense = None
        # rollouts ahead (run.rollouts_ahead > 1): ``stage_weights`` receives into ``_staged``
        # beside a running rollout; the next rollout()/evaluate() swaps it in (``_swap_staged``)
        self._stage_lock = threading.Lock()
        self._staged: dict | None = None       # name -> tensor, the model's dtypes, reused
        self._staged_version: int | None = None
        self._staged_sum: float | None = None
        self.swaps: list[tuple[int, float | None]] = []   # (version, checksum after swap), last 64

    # ---- generation ------------------------------------------------------------------------------
    def _task_obj(self):
        if self._task is None:
            import tasks

            self._task = tasks.make_task(self.task_cfg)
        return self._task

    def _params(self, greedy: bool, batch: int | None = None) -> SamplingParams:
        """Sampling settings for one engine call. The seed derives from (rollout.seed, actor_id,
        batch): the driver numbers its rollout batches, so a resumed run draws exactly the samples
        an uninterrupted one would. Without ``batch`` (evaluation, direct use) a per-actor call
        counter stands in, in a separate seed stream."""
        c = self.cfg
        key = batch if batch is not None else -1 - self._calls
        seed = (c.seed * 1_000_003 + self.actor_id) * 1_000_003 + key
        self._calls += 1
        return SamplingParams(max_new_tokens=c.max_new_tokens,
                              temperature=0.0 if greedy else c.temperature, top_p=c.top_p,
                              top_k=c.top_k, stop_token_ids=self.stop_ids,
                              stop=tuple(c.stop), seed=seed,
                              logprob_mode=getattr(c.logprob_mode, "value", c.logprob_mode))

    def _dense_engine(self):
        """A dense-KV engine over the same model (shared weights) for evaluation.

        Held-out accuracy measures the *model*, so it is decoded with the full cache whatever KV
        policy the rollouts use. The vLLM engine has no second cache on the same weights: it
        evaluates with its own (dense or sliding-window) setting.
        """
        from actors.config import EngineKind, KVConfig
        from actors.native import NativeEngine

        if EngineKind(self.cfg.engine) != EngineKind.native or self.engine.policy == KVPolicy.dense:
            return self.engine
        if self._dense is None:
            self._dense = NativeEngine(self.engine.model, KVConfig(policy=KVPolicy.dense),
                                       self.cfg.batch_size)
        return self._dense

    def _sampler(self):
        """The sparse sampler: with DistillSparse the engine over base + adapter, which also
        records every sample's kept sets."""
        return self.adapter.engine if self.adapter is not None else self.engine

    def _generate(self, problems, samples: int, greedy: bool, dense: bool = False,
                  batch: int | None = None):
        prompts = [self.prompts.encode(p.prompt) for p in problems]
        expanded = [ids for ids in prompts for _ in range(samples)]
        params = self._params(greedy, batch)
        engine = self._dense_engine() if dense else self._sampler()
        t0 = time.perf_counter()
        outs = engine.generate(expanded, params)
        return outs, (time.perf_counter() - t0), params

    def _reward(self, output, answer: str) -> tuple[str, float]:
        text = self.tokenizer.decode(output.response_ids, skip_special_tokens=True)
        return text, float(self._task_obj().reward(text, answer))

    def rollout(self, problems, version: int | None, batch: int | None = None) -> list[dict]:
        """G samples per problem as buffer rows (rewards filled). ``gen_time_s`` is the sample's
        share of the wall time of the engine call that produced it. ``batch`` (the driver's
        rollout-batch number) fixes the sampling seed and the sample ids, so they are reproducible
        across restarts; without it a call counter is used. Staged weights are swapped in first;
        ``version=None`` tags the rows with the version of the weights this actor then holds (the
        driver's choice with run.rollouts_ahead > 1, where that depends on timing)."""
        self._swap_staged()
        version = self.version if version is None else version
        g = self.cfg.samples_per_prompt
        outs, elapsed, params = self._generate(problems, g, greedy=False, batch=batch)
        kv = self.cfg.kv
        policy = KVPolicy(kv.policy).value
        budget = 0 if policy == KVPolicy.dense.value else int(kv.budget)   # 0: unbounded (dense)
        tag = f"b{batch}" if batch is not None else f"c{self._calls - 1}"
        dense = self._dense_sampler_logprobs(outs) if self.cfg.dense_logprobs else None
        evicted = self.adapter.evictions(outs) if self.adapter is not None else None
        rows = []
        for j, out in enumerate(outs):
            prob = problems[j // g]
            group = f"v{version}-a{self.actor_id}-{tag}-p{prob.idx}"
            _, reward = self._reward(out, prob.answer)
            rows.append({
                "sample_id": f"{group}-s{j % g}", "group_id": group, "prompt_idx": int(prob.idx),
                "prompt_ids": list(out.prompt_ids), "response_ids": list(out.response_ids),
                "sampler_logprobs": [float(x) for x in out.logprobs], "reward": reward,
                "policy_version": int(version), "kv_policy": policy, "kv_budget": budget,
                "kept_ratio": float(out.kept_ratio), "prompt_len": len(out.prompt_ids),
                "response_len": len(out.response_ids), "finish_reason": out.finish_reason,
                "gen_time_s": elapsed / max(1, len(outs)), "logprob_mode": params.logprob_mode,
                "peak_kv_bytes": int(out.peak_kv_bytes),
            })
            if dense is not None:
                rows[-1]["dense_sampler_logprobs"] = dense[j]
            if evicted is not None:
                rows[-1]["kv_evictions"] = evicted[j]
        return rows

    def _dense_sampler_logprobs(self, outs) -> list[list[float]]:
        """pi_dense^v: teacher-forced dense log-probs of each response under the weights that just
        generated it (the scorer's code and temperature, so they compare with ``old_logprobs``).
        Runs right after generation, before any ``sync_weights`` can swap the weights."""
        from actors.scorer import dense_logprobs
        from common.tokens import pad_token_id

        model = self.engine.model
        return dense_logprobs(model, [list(o.prompt_ids) for o in outs],
                              [list(o.response_ids) for o in outs], float(self.cfg.temperature),
                              pad_token_id(self.tokenizer), int(self.cfg.dense_micro_batch))

    def evaluate(self, problems, greedy: bool = True, dense: bool = True) -> dict:
        """One sample per problem (greedy, or sampled at the rollout temperature), decoded with a
        dense cache unless ``dense=False`` (then with the rollout KV policy: the sparse sampler,
        with the DistillSparse adapter when there is one; the dense decode never has it)."""
        self._swap_staged()
        if not problems:
            return {"accuracy": 0.0, "num_problems": 0}
        outs, elapsed, _ = self._generate(problems, 1, greedy=greedy, dense=dense)
        rewards = [self._reward(o, p.answer)[1] for o, p in zip(outs, problems)]
        return {"accuracy": sum(r > 0 for r in rewards) / len(rewards),
                "mean_reward": sum(rewards) / len(rewards), "num_problems": len(problems),
                "mean_response_len": sum(len(o.response_ids) for o in outs) / len(outs),
                "kept_ratio": sum(o.kept_ratio for o in outs) / len(outs),
                "peak_kv_bytes": sum(o.peak_kv_bytes for o in outs) / len(outs),
                "gen_time_s": elapsed}

    # ---- weights ---------------------------------------------------------------------------------
    def weight_spec(self):
        from cluster.weight_sync import weight_spec

        extra = self.adapter.spec() if self.adapter is not None else []
        return weight_spec(self.engine.model) + extra

    def init_weight_sync(self, host: str, port: int, rank: int, world_size: int,
                         timeout_s: float = 300.0) -> None:
        """Join (or re-join) the weight-sync group as ``rank``; see actors.weights."""
        from actors.weights import join_weight_sync

        old, self._receiver = self._receiver, None  # a failed join must not leave a closed one
        self._receiver = join_weight_sync(old, host, port, rank, world_size, self.weight_spec(),
                                          timeout_s)

    def sync_weights(self) -> int:
        """Receive one broadcast (a collective with the learner's send) and swap the weights."""
        from actors.weights import receive_weights

        return receive_weights(self._receiver, self.load_weights, self._inplace_params())

    def stage_weights(self, verify: bool = True) -> dict:
        """Receive one broadcast into a staging copy, beside a rollout in progress (the driver
        calls it in the actor's "weights" concurrency group); the next rollout()/evaluate() swaps
        it in, between batches, never mid-sequence. A newer broadcast staged before that replaces
        it. Returns {"version", "checksum"}: the checksum of the staged weights, exactly what the
        model holds after the swap (None unless ``verify``); the swap checks the model against it.
        A failed receive leaves nothing staged (the model keeps its weights)."""
        from common.modeling import checksum

        if self._receiver is None:
            raise RuntimeError("stage_weights called before init_weight_sync")
        with self._stage_lock:
            self._staged_version = self._staged_sum = None
            dest = self._staging_dest()
            version, named = self._receiver.receive(into=dest)
            if dest is None:  # no destinations (vLLM): copy out of the receiver's reused buffers
                self._staged = {n: t.clone() for n, t in named}
            self._staged_sum = checksum(self._staged.items()) if verify else None
            self._staged_version = int(version)
            return {"version": self._staged_version, "checksum": self._staged_sum}

    def _staging_dest(self) -> dict | None:
        """The staging copy a broadcast lands in: one tensor per parameter, allocated once."""
        params = self._inplace_params()
        if params is None:
            return None
        if self._staged is None:
            self._staged = {n: torch.empty_like(p) for n, p in params.items()}
        return self._staged

    def _swap_staged(self) -> None:
        """Load the staged weights, if any, into the model; with a staged checksum, the model's
        must equal it (the weights the next rows are tagged with are the ones the learner sent).
        A receive in progress is waited for (it may be overwriting a staged, not yet swapped
        version): the rollout then starts from the newer one, never from older weights."""
        with self._stage_lock:
            if self._staged_version is None:
                return
            version, want = self._staged_version, self._staged_sum
            self.load_weights(list(self._staged.items()), version)
            got = None if want is None else self.state_checksum()
            if want is not None and got != want:
                raise RuntimeError(f"rollout actor {self.actor_id}: after swapping in version "
                                   f"{version} the model's checksum {got} != staged {want}")
            self._staged_version = self._staged_sum = None
            self.swaps = (self.swaps + [(version, got)])[-64:]

    def load_weights(self, named_tensors, version: int) -> None:
        """Copy named tensors into the model (an empty list: they were received in place); with
        DistillSparse the adapter's go to the sampler, which is then rebuilt."""
        if self.adapter is not None:
            named_tensors = self.adapter.take(named_tensors)
        self.engine.load_weights(named_tensors, version)
        if self.adapter is not None:
            self.adapter.apply(version)
        if self._dense is not None and self._dense is not self.engine:  # same model, own caches
            self._dense.load_weights([], version)
        self.version = int(version)

    def _inplace_params(self) -> dict | None:
        """The parameters a broadcast may land in directly: the native engine's model (vLLM's
        weights live in its own workers and come through its API)."""
        from actors.config import EngineKind

        if EngineKind(self.cfg.engine) != EngineKind.native:
            return None
        extra = self.adapter.tensors if self.adapter is not None else {}
        return {**dict(self.engine.model.named_parameters()), **extra}

    def state_checksum(self) -> float:
        """Checksum of what the broadcast carries: the base weights (and the adapter)."""
        if self.adapter is None:
            return self.engine.state_checksum()
        from common.modeling import checksum

        return checksum(list(self.engine.model.named_parameters())
                        + list(self.adapter.tensors.items()))
