"""Configs of the rollout and scorer actors (``rollout`` and ``scorer`` sections of TrainConfig).

Dataclasses usable as OmegaConf structured configs: method choices are ``enum.Enum``s with string
values, nested sections use ``default_factory``. ``validate(prefix)`` raises
``common.errors.ConfigError`` naming the dotted key (e.g. ``rollout.kv.budget``).
"""
from __future__ import annotations

import enum
from dataclasses import MISSING, dataclass, field, fields

from common.dtypes import Dtype
from common.errors import ConfigError
from common.validate import check_range, check_enum


class EngineKind(str, enum.Enum):
    native = "native"   # actors/native: batched PyTorch engine with compressed KV (default)
    vllm = "vllm"       # actors/vllm: vLLM (every KV policy: window or eviction), needs vLLM


class KVPolicy(str, enum.Enum):
    dense = "dense"           # full cache
    streaming = "streaming"   # StreamingLLM: attention sinks + recent window (Xiao et al. 2024)
    h2o = "h2o"               # heavy hitters by accumulated attention + recent (Zhang et al. 2023)
    snapkv = "snapkv"         # pooled attention of an observation window (Li et al. 2024)
    rkv = "rkv"               # importance + redundancy from key similarity (Cai et al. 2025)


class KVSchedule(str, enum.Enum):
    static = "static"     # the budgets stay as configured (rollout.kv.budget, or kv.budgets per bin)
    dynamic = "dynamic"   # budgets per bin re-planned from probes and a cost model (schedule/)


class KVObjective(str, enum.Enum):
    speed = "speed"     # least predicted decode time (the engine's measured cost model)
    memory = "memory"   # fewest KV slots held per generated token


class KVPlanner(str, enum.Enum):
    # every bin's budget chosen by replaying the probes at the schedule itself (growing schedules
    # allowed: eviction is irreversible, so only a replay of the whole prefix certifies a bin)
    exact = "exact"
    # one replay per candidate budget (that budget at every position); non-increasing schedules
    # only, for which that table is conservative; cheaper per re-plan
    table = "table"


class DistillDivergence(str, enum.Enum):
    k3 = "k3"   # Sparrow: k3 estimate of KL(sparse || dense old) on the sampled tokens
    tv = "tv"   # exact total variation to the current dense base over the vocabulary (1 - alpha)


class LogprobMode(str, enum.Enum):
    processed = "processed"   # log-prob of the distribution sampled from (after top-k / top-p)
    raw = "raw"               # log_softmax(logits / temperature), no truncation


_enum = check_enum  # shared: coerce a string to the Enum or name the key


class OverlongPrompt(str, enum.Enum):
    drop = "drop"                     # left out of the task's problems at start-up (counted)
    truncate_left = "truncate_left"   # keep the last rollout.max_prompt_tokens tokens (counted)
    error = "error"                   # refuse the run, naming how many prompts are too long


def _coerce(obj, prefix: str, fields: dict) -> None:
    """Plain-Python callers may pass enum values as strings (as YAML does): convert them."""
    for key, cls in fields.items():
        value = getattr(obj, key)
        if isinstance(value, str) and not isinstance(value, cls):
            setattr(obj, key, _enum(f"{prefix}.{key}", cls, value))


# policies the adaptive budget (rollout.kv.keep_mass) runs with: it reads the observation
# window's attention
ADAPTIVE_POLICIES = (KVPolicy.snapkv, KVPolicy.rkv)

# rollout.kv keys only the dynamic re-planner reads (schedule/replan.py): with
# schedule=static each must keep its default, or it would validate and do nothing
REPLAN_KEYS = ("probe_budgets", "threshold", "quantile", "margin", "replan_every", "objective",
               "min_budgets", "verify_samples", "planner")


@dataclass
class KVConfig:
    """KV-cache compression. Per sequence and layer at most ``budget + compress_every`` tokens are
    stored: the cache is compressed to ``budget`` tokens whenever it fills (every ``compress_every``
    decode steps once the budget is reached) and after prefill when the prompt exceeds the budget."""
    policy: KVPolicy = KVPolicy.dense
    budget: int = 512              # tokens kept per sequence, layer and KV head after compression
    compress_every: int = 128      # N: decode steps between compressions (paper's runs: 128)
    sink_tokens: int = 4           # streaming: first tokens always kept (attention sinks)
    recent_ratio: float = 0.5      # h2o: share of the budget for the most recent tokens
    obs_window: int = 8            # snapkv / rkv: last queries whose attention scores the keys
    pool_kernel: int = 7           # snapkv / rkv: 1-D pooling kernel over attention scores (odd)
    rkv_lambda: float = 0.1        # rkv: score = lambda * importance - (1 - lambda) * redundancy
    # Budget schedule (Sparrow): static keeps the configured budgets; dynamic re-plans them every
    # replan_every steps (the cheapest budgets whose probe agreement p5 stays >= threshold +
    # margin in every position bin; schedule/plan.py).
    schedule: KVSchedule = KVSchedule.static
    # Positions (prompt included) per bin; a row compresses to the budget of the bin of the next
    # position it writes.
    bin_tokens: int = 16
    # Budget of each bin, the last also for every later position; empty: ``budget`` everywhere
    # (dynamic: the starting schedule; the driver keeps the current one here).
    budgets: list[int] = field(default_factory=list)
    # Share of each rollout call's sequences replayed teacher-forced with a dense cache: exact
    # per-token agreement 1 - TV (row column ``kv_agreement``, per-bin metrics); dynamic: also
    # replayed at candidate schedules built from probe_budgets, the re-planner's evidence.
    probe_share: float = 0.0
    # Candidate budgets (dynamic); empty: every half bin up to the longest sequence.
    probe_budgets: list[int] = field(default_factory=list)
    threshold: float = 0.86         # min per-bin p5 of probe agreement (Sparrow: 0.85-0.90 stable)
    # The per-bin tail statistic's quantile (Sparrow's: 0.05, the p5 above); smaller looks at the
    # rarer tokens where a sparse sampler goes wrong (dynamic; ``schedule.plan.tail``).
    quantile: float = 0.05
    margin: float = 0.0             # added to threshold when planning (probes are a sample)
    replan_every: int = 5           # training steps between re-plans (dynamic)
    protect_prompt: bool = False    # compression never evicts prompt tokens (they count in budget)
    objective: KVObjective = KVObjective.speed   # what the re-planner minimises (dynamic)
    # Lower bound on each bin's budget (0: none; bins past the end: none), both planners. The
    # driver raises it when a bin's probes fail at the schedule in use and keeps it for the run
    # (``schedule.plan.raise_floors``; kept here, like ``budgets``, so checkpoints carry it).
    min_budgets: list[int] = field(default_factory=list)
    # Sequences sampled under a re-plan that lowers any bin below the schedule in use, to check
    # it on its own samples before it is adopted (dynamic, as replan_every and threshold:
    # ``schedule.plan.verify``); 0: adopt on the replays alone.
    verify_samples: int = 0
    planner: KVPlanner = KVPlanner.exact         # how it searches (dynamic; schedule/plan.py)
    # Per-row adaptive budget (snapkv / rkv; 0: off): at each compression a row keeps the fewest
    # slots, between min_budget and its bin's budget, whose kept set holds at least this share of
    # the observation window's attention (averaged over layers and KV heads), and compresses
    # again compress_every steps later (``policies.mass_budgets``).
    keep_mass: float = 0.0
    min_budget: int = 0             # the least a row keeps with keep_mass > 0

    def __post_init__(self) -> None:
        _coerce(self, "rollout.kv", {"policy": KVPolicy, "schedule": KVSchedule,
                                     "objective": KVObjective, "planner": KVPlanner})

    def bin_budgets(self) -> list[int]:
        """The configured budget of each bin (``budgets``, else ``[budget]``)."""
        return [int(b) for b in self.budgets] or [int(self.budget)]

    def validate(self, prefix: str = "rollout.kv") -> None:
        _enum(f"{prefix}.policy", KVPolicy, self.policy)
        check_range(f"{prefix}.budget", self.budget, lo=1)
        check_range(f"{prefix}.compress_every", self.compress_every, lo=1)
        check_range(f"{prefix}.sink_tokens", self.sink_tokens, lo=0)
        check_range(f"{prefix}.recent_ratio", self.recent_ratio, lo=0.0, hi=1.0)
        check_range(f"{prefix}.obs_window", self.obs_window, lo=1)
        check_range(f"{prefix}.pool_kernel", self.pool_kernel, lo=1)
        if self.pool_kernel % 2 == 0:
            raise ConfigError(f"{prefix}.pool_kernel", self.pool_kernel, "an odd integer >= 1")
        check_range(f"{prefix}.rkv_lambda", self.rkv_lambda, lo=0.0, hi=1.0)
        policy = _enum(f"{prefix}.policy", KVPolicy, self.policy)
        self._validate_schedule(prefix, policy)
        self._validate_adaptive(prefix, policy)
        smallest = min(self.bin_budgets() + [int(b) for b in self.probe_budgets])
        if policy == KVPolicy.streaming and self.sink_tokens >= smallest:
            raise ConfigError(f"{prefix}.sink_tokens", self.sink_tokens,
                              f"fewer than the smallest budget ({smallest}) tokens")
        if policy in (KVPolicy.snapkv, KVPolicy.rkv) and self.obs_window > smallest:
            raise ConfigError(f"{prefix}.obs_window", self.obs_window,
                              f"at most the smallest budget ({smallest}) tokens")

    def _validate_adaptive(self, prefix: str, policy: KVPolicy) -> None:
        check_range(f"{prefix}.keep_mass", self.keep_mass, lo=0.0, hi=1.0, hi_open=True)
        check_range(f"{prefix}.min_budget", self.min_budget, lo=0)
        if self.keep_mass == 0:
            if self.min_budget != 0:
                raise ConfigError(f"{prefix}.min_budget", self.min_budget,
                                  f"0 with {prefix}.keep_mass=0 (only the adaptive budget reads "
                                  "it)")
            return
        if policy not in ADAPTIVE_POLICIES:
            raise ConfigError(f"{prefix}.keep_mass", self.keep_mass,
                              f"0 with {prefix}.policy={policy.value} (the adaptive budget reads "
                              "the observation window's attention: snapkv or rkv)")
        if KVSchedule(self.schedule) == KVSchedule.dynamic:
            raise ConfigError(f"{prefix}.keep_mass", self.keep_mass,
                              f"0 with {prefix}.schedule=dynamic (the re-planner's replays "
                              "assume every row keeps its bin's budget)")
        smallest = min(self.bin_budgets() + [int(b) for b in self.probe_budgets])
        if not self.obs_window <= self.min_budget <= smallest:
            raise ConfigError(f"{prefix}.min_budget", self.min_budget,
                              f"between {prefix}.obs_window ({self.obs_window}) and the smallest "
                              f"budget ({smallest}) with {prefix}.keep_mass > 0")

    def _validate_schedule(self, prefix: str, policy: KVPolicy) -> None:
        schedule = _enum(f"{prefix}.schedule", KVSchedule, self.schedule)
        check_range(f"{prefix}.bin_tokens", self.bin_tokens, lo=1)
        for key, lo in (("budgets", 1), ("probe_budgets", 1), ("min_budgets", 0)):
            value = getattr(self, key)
            if not isinstance(value, (list, tuple)) or not all(
                    isinstance(b, int) and not isinstance(b, bool) and b >= lo for b in value):
                raise ConfigError(f"{prefix}.{key}", value, f"a list of integers >= {lo}")
        if schedule != KVSchedule.dynamic:
            plain = lambda v: getattr(v, "value", v)  # noqa: E731  (an enum member: its value)
            for f in fields(self):
                default = f.default_factory() if f.default is MISSING else f.default
                if f.name in REPLAN_KEYS and plain(getattr(self, f.name)) != plain(default):
                    raise ConfigError(f"{prefix}.{f.name}", plain(getattr(self, f.name)),
                                      f"its default ({plain(default)}) with {prefix}.schedule="
                                      f"{schedule.value} (only the dynamic re-planner reads it)")
        check_range(f"{prefix}.verify_samples", self.verify_samples, lo=0)
        check_range(f"{prefix}.probe_share", self.probe_share, lo=0.0, hi=1.0)
        check_range(f"{prefix}.threshold", self.threshold, lo=0.0, hi=1.0, lo_open=True)
        check_range(f"{prefix}.quantile", self.quantile, lo=0.0, hi=0.5, lo_open=True)
        check_range(f"{prefix}.margin", self.margin, lo=0.0, hi=1.0)
        check_range(f"{prefix}.replan_every", self.replan_every, lo=1)
        _enum(f"{prefix}.objective", KVObjective, self.objective)
        _enum(f"{prefix}.planner", KVPlanner, self.planner)
        if policy == KVPolicy.dense and self.probe_share > 0:
            raise ConfigError(f"{prefix}.probe_share", self.probe_share,
                              f"0 with {prefix}.policy=dense (a dense cache agrees exactly)")
        if schedule == KVSchedule.dynamic:
            if policy == KVPolicy.dense:
                raise ConfigError(f"{prefix}.schedule", schedule.value,
                                  f"static with {prefix}.policy=dense (nothing to schedule)")
            if self.probe_share <= 0:
                raise ConfigError(f"{prefix}.probe_share", self.probe_share,
                                  f"> 0 with {prefix}.schedule=dynamic (re-planning needs probes)")


def longest_prompt(cfg) -> int:
    """``rollout.max_prompt_tokens``: the longest prompt allowed, in tokens; 0 when it is left to
    the model (``max_position_embeddings - max_new_tokens``, ``common.tokens.prompt_budget``)."""
    return int(cfg.max_prompt_tokens)


@dataclass
class VLLMConfig:
    """Settings only the vLLM engine reads (``rollout.vllm``; ``VLLMEngine.from_config``).
    Non-default values with ``rollout.engine=native`` are refused (they would do nothing)."""
    # GPU: share of the GPU's memory this engine may take (weights, activations, KV pool). With a
    # fractional cluster.rollout_gpus it must fit the actor's share. Ignored on CPU.
    gpu_memory_utilization: float = 0.9
    # GPUs one engine shards the model over (vLLM tensor parallelism); needs as many GPUs per
    # rollout actor (cluster.rollout_gpus) and must divide the model's attention heads. 1 on CPU.
    tensor_parallel_size: int = 1
    # Longest sequence (prompt + response) vLLM plans for. 0: derived, the longest prompt allowed
    # plus rollout.max_new_tokens (``actors.vllm.engine.derive_max_model_len``).
    max_model_len: int = 0
    # Bytes of the KV block pool. 0: on CPU room for rollout.batch_size sequences of max_model_len
    # tokens (16 MiB - 1 GiB); on GPU whatever gpu_memory_utilization leaves. > 0: exactly this.
    kv_cache_bytes: int = 0

    def validate(self, prefix: str = "rollout.vllm") -> None:
        check_range(f"{prefix}.gpu_memory_utilization", self.gpu_memory_utilization,
                    lo=0.0, hi=1.0, lo_open=True)
        check_range(f"{prefix}.tensor_parallel_size", self.tensor_parallel_size, lo=1, hi=64)
        check_range(f"{prefix}.max_model_len", self.max_model_len, lo=0)
        check_range(f"{prefix}.kv_cache_bytes", self.kv_cache_bytes, lo=0)

    def check_resources(self, prefix: str, gpus: float) -> None:
        """Against the GPUs Ray gives each rollout actor (``cluster.rollout_gpus``): vLLM inside
        the actor sees only those, so tensor parallelism needs that many, and a fractional GPU
        shared with other actors bounds the memory share."""
        tp = self.tensor_parallel_size
        if tp > 1 and gpus < tp:
            raise ConfigError(f"{prefix}.tensor_parallel_size", tp,
                              f"<= cluster.rollout_gpus ({gpus}): each rollout actor needs "
                              "one whole GPU per tensor-parallel rank (1 on CPU)")
        if 0 < gpus < 1 and self.gpu_memory_utilization > gpus:
            raise ConfigError(f"{prefix}.gpu_memory_utilization", self.gpu_memory_utilization,
                              f"<= cluster.rollout_gpus ({gpus}): the actor's share of the GPU")

    def check_unused(self, prefix: str, engine: "EngineKind") -> None:
        """With another engine every key must keep its default: a set key would be ignored."""
        if engine == EngineKind.vllm:
            return
        for f in fields(self):
            if getattr(self, f.name) != f.default:
                raise ConfigError(f"{prefix}.{f.name}", getattr(self, f.name),
                                  f"the default ({f.default}) with rollout.engine="
                                  f"{engine.value} (a vLLM-only key)")


# Linear layers of a decoder block a LoRA adapter may wrap (Qwen2/2.5, Qwen3, Llama names)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class DistillSparseConfig:
    """DistillSparse (Sparrow, Zhou et al. 2026; issue 14): a LoRA adapter used only by the sparse
    sampler. The learner trains it on the sparse rollouts (PPO loss on the sparse log-probs,
    recomputed under each sample's recorded kept sets, plus ``kl_coef`` x k3 KL(sparse || dense)),
    the broadcast carries it, and rollout actors apply it in their sampler only
    (``actors/sampler_adapter.py``); the scorer, the learner's main loss and dense evaluation
    never use it (``learner/distill.py``)."""
    enabled: bool = False          # train and sample with the sparse sampler's LoRA adapter
    rank: int = 8                  # LoRA rank r
    alpha: float = 16.0            # LoRA alpha: the update is (alpha / r) * B @ A
    # linear layers of every decoder block that get an adapter (names in LORA_TARGETS)
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj",
                                                               "o_proj"])
    lr: float = 1e-4               # AdamW learning rate of the adapter (its own optimiser)
    kl_coef: float = 0.001         # lambda of the divergence term (Sparrow: 0.001, with k3)
    # the divergence to dense that kl_coef weighs (DistillDivergence): k3 (Sparrow) or tv
    divergence: DistillDivergence = DistillDivergence.k3

    def __post_init__(self) -> None:
        _coerce(self, "rollout.distill_sparse", {"divergence": DistillDivergence})

    def validate(self, prefix: str = "rollout.distill_sparse") -> None:
        check_range(f"{prefix}.rank", self.rank, lo=1, hi=4096)
        check_range(f"{prefix}.alpha", self.alpha, lo=0.0, lo_open=True)
        check_range(f"{prefix}.lr", self.lr, lo=0.0, hi=1.0, lo_open=True)
        check_range(f"{prefix}.kl_coef", self.kl_coef, lo=0.0)
        targets = list(self.target_modules)
        if not targets or any(t not in LORA_TARGETS for t in targets) or \
                len(set(targets)) != len(targets):
            raise ConfigError(f"{prefix}.target_modules", targets,
                              f"a non-empty list of distinct names from {list(LORA_TARGETS)}")


@dataclass
class RolloutConfig:
    engine: EngineKind = EngineKind.native
    model_path: str = ".cache/models/tiny-base"
    samples_per_prompt: int = 8           # G: samples per problem (one GRPO group)
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                        # 0 = off
    # stop strings (besides the tokenizer's EOS): a response ends with the token completing one
    stop: list[str] = field(default_factory=list)
    logprob_mode: LogprobMode = LogprobMode.processed
    seed: int = 0
    num_actors: int = 1
    batch_size: int = 64                  # sequences generated together by one engine call
    dtype: Dtype = Dtype.float32
    kv: KVConfig = field(default_factory=KVConfig)
    # Also record pi_dense^v, the dense teacher-forced log-probs of each sample under the weights
    # that generated it (row key ``dense_sampler_logprobs``), for the staleness split
    # (``correction.staleness.enabled``), or as the old log-probs themselves when there is no
    # scorer pool (``scorer.num_actors: 0``). Costs one dense forward over prompt + response per
    # sample, in forwards of ``dense_micro_batch`` rows, on the rollout actor after generation.
    dense_logprobs: bool = False
    dense_micro_batch: int = 16
    vllm: VLLMConfig = field(default_factory=VLLMConfig)   # rollout.engine=vllm only
    # Prompt encoding (common/tokens.py): "none" (the task's text as is), "tokenizer" (the
    # tokenizer's own chat template) or a path to a .jinja template; one user turn + the
    # generation prompt, through tokenizer.apply_chat_template.
    chat_template: str = "none"
    # Longest prompt in tokens; 0: the model's max_position_embeddings - max_new_tokens. Prompt +
    # max_new_tokens beyond max_position_embeddings is refused at start-up.
    max_prompt_tokens: int = 0
    overlong_prompt: OverlongPrompt = OverlongPrompt.drop
    distill_sparse: DistillSparseConfig = field(default_factory=DistillSparseConfig)

    def __post_init__(self) -> None:
        _coerce(self, "rollout", {"engine": EngineKind, "logprob_mode": LogprobMode, "dtype": Dtype,
                                  "overlong_prompt": OverlongPrompt})

    def validate(self, prefix: str = "rollout") -> None:
        _enum(f"{prefix}.engine", EngineKind, self.engine)
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ConfigError(f"{prefix}.model_path", self.model_path, "a model directory path")
        check_range(f"{prefix}.samples_per_prompt", self.samples_per_prompt, lo=1)
        check_range(f"{prefix}.max_new_tokens", self.max_new_tokens, lo=1)
        check_range(f"{prefix}.temperature", self.temperature, lo=0.0, lo_open=True)
        check_range(f"{prefix}.top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        check_range(f"{prefix}.top_k", self.top_k, lo=0)
        stop = self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise ConfigError(f"{prefix}.stop", stop, "a list of non-empty strings")
        _enum(f"{prefix}.logprob_mode", LogprobMode, self.logprob_mode)
        check_range(f"{prefix}.num_actors", self.num_actors, lo=1)
        check_range(f"{prefix}.batch_size", self.batch_size, lo=1)
        _enum(f"{prefix}.dtype", Dtype, self.dtype)
        check_range(f"{prefix}.dense_micro_batch", self.dense_micro_batch, lo=1)
        if not isinstance(self.chat_template, str) or not self.chat_template:
            raise ConfigError(f"{prefix}.chat_template", self.chat_template,
                              "'none', 'tokenizer' or a path to a .jinja file")
        check_range(f"{prefix}.max_prompt_tokens", self.max_prompt_tokens, lo=0)
        _enum(f"{prefix}.overlong_prompt", OverlongPrompt, self.overlong_prompt)
        self.kv.validate(f"{prefix}.kv")
        engine = _enum(f"{prefix}.engine", EngineKind, self.engine)
        self.vllm.validate(f"{prefix}.vllm")
        self._validate_distill(prefix, engine)
        self.vllm.check_unused(f"{prefix}.vllm", engine)
        if engine == EngineKind.vllm:
            need = max(longest_prompt(self), 1) + self.max_new_tokens
            if 0 < self.vllm.max_model_len < need:
                raise ConfigError(f"{prefix}.vllm.max_model_len", self.vllm.max_model_len,
                                  f"0 (derived) or >= {need} (longest prompt + "
                                  f"{prefix}.max_new_tokens)")
            kv = self.kv
            for key, off in (("schedule", KVSchedule(kv.schedule) == KVSchedule.static),
                             ("probe_share", kv.probe_share == 0),
                             ("keep_mass", kv.keep_mass == 0)):
                # probes replay on the native engine (dynamic schedules need them), and the
                # adaptive budget is the native engine's
                if not off:
                    raise ConfigError(f"{prefix}.kv.{key}", getattr(kv, key),
                                      f"its default with {prefix}.engine=vllm (native engine only)")
            # vLLM runs every policy (actors.vllm.kv.SUPPORTED; the engine checks it at build)
            policy = KVPolicy(getattr(kv.policy, "value", kv.policy))
            if policy == KVPolicy.streaming and (kv.budgets or kv.protect_prompt):
                key = "budgets" if kv.budgets else "protect_prompt"
                raise ConfigError(f"{prefix}.kv.{key}", getattr(kv, key),
                                  f"its default with {prefix}.engine=vllm and policy streaming "
                                  "(vLLM's sliding window has one width and no prompt "
                                  "protection; h2o, snapkv and rkv support both)")
            if policy in (KVPolicy.h2o, KVPolicy.snapkv, KVPolicy.rkv) and \
                    self.vllm.tensor_parallel_size > 1:
                raise ConfigError(f"{prefix}.vllm.tensor_parallel_size",
                                  self.vllm.tensor_parallel_size,
                                  f"1 with {prefix}.kv.policy={policy.value} (KV eviction keeps "
                                  "one set of kept tokens per engine: not implemented across "
                                  "tensor-parallel workers)")


    def _validate_distill(self, prefix: str, engine: EngineKind) -> None:
        """The adapter needs a compressing policy (a dense sampler has nothing to distil: its
        log-probs are the dense ones) whose kept sets the engine records (the learner recomputes
        the sparse log-probs under them): any on the native engine; on vLLM the score-based
        ones (its sliding window records none), with a LoRA rank vLLM allows."""
        d = self.distill_sparse
        d.validate(f"{prefix}.distill_sparse")
        if not d.enabled:
            return
        policy = KVPolicy(self.kv.policy)
        if policy == KVPolicy.dense:
            raise ConfigError(f"{prefix}.distill_sparse.enabled", True,
                              f"false with {prefix}.kv.policy=dense (no sparse sampler to adapt)")
        if engine == EngineKind.vllm:
            from actors.vllm.limits import lora_slots  # imports no vLLM, nor this module

            if policy == KVPolicy.streaming:
                raise ConfigError(f"{prefix}.distill_sparse.enabled", True,
                                  f"false with {prefix}.engine=vllm and {prefix}.kv.policy="
                                  "streaming (vLLM's sliding window records no kept sets; "
                                  "h2o, snapkv and rkv do)")
            lora_slots(d.rank, f"{prefix}.distill_sparse.rank")


@dataclass
class ScorerConfig:
    # 0: no scorer pool; each rollout actor's dense pass over its own samples
    # (rollout.dense_logprobs) gives the old log-probs, at the sampler's policy version
    # (docs/CORRECTION.md, "Old log-probs without a scorer pool").
    num_actors: int = 1
    micro_batch: int = 16
    dtype: Dtype = Dtype.float32

    def __post_init__(self) -> None:
        _coerce(self, "scorer", {"dtype": Dtype})

    def validate(self, prefix: str = "scorer") -> None:
        check_range(f"{prefix}.num_actors", self.num_actors, lo=0)
        check_range(f"{prefix}.micro_batch", self.micro_batch, lo=1)
        _enum(f"{prefix}.dtype", Dtype, self.dtype)
