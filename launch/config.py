"""The whole run's config: one typed dataclass per component, merged with OmegaConf.

``load_config(["--config", "launch/configs/default.yaml", "rollout.kv.budget=64"])`` merges, in order,
the dataclass defaults, the YAML preset and ``key=value`` overrides, then validates every section.
Anything wrong (an unknown key, a wrong type, a value out of range) raises ``ConfigError`` naming the
dotted key and what is allowed, before Ray or any model starts.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from actors.config import EngineKind, RolloutConfig, ScorerConfig
from buffer.config import BufferConfig
from cluster.config import ClusterConfig
from common import secrets
from common.configfile import as_config_error, merge, parse_override
from common.dtypes import Dtype
from common.errors import ConfigError
from common.validate import check_range
from correction.config import CorrectionConfig
from learner.config import LearnerConfig
from tasks.config import TaskConfig

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class RunMode(str, Enum):
    """sync: generate, then train. async: launch the next rollouts before training on the current
    batch (generation overlaps the learner step; samples lag the learner by one version)."""
    sync = "sync"
    async_ = "async"


@dataclass
class RunConfig:
    name: str = "default"          # the run folder is out_dir/<name>-<date>-<time>
    seed: int = 0                   # order of the training prompts
    steps: int = 20                 # learner steps (policy versions) to train
    prompts_per_step: int = 16      # groups per learner step; each group holds rollout.samples_per_prompt
    out_dir: str = "runs"           # metrics, checkpoints and logs go to out_dir/name
    eval_problems: int = 256        # held-out problems scored before and after RL (0: all)
    eval_greedy: bool = False       # False: mean accuracy of one sample at the rollout temperature
    eval_every: int = 0             # also evaluate every N steps (0: only before and after)
    log_every: int = 1              # print the compact metrics line every N steps
    mode: RunMode = RunMode.sync
    checkpoint_every: int = 0       # checkpoint every N steps and after the last (0: only on SIGTERM)
    checkpoint_keep: int = 2        # newest checkpoints kept (0: all)
    # async only: rollout batches in flight while the learner trains (versions k+1 .. k+s are
    # generated while it trains on k); 1 is deterministic, >1 tags each batch with the version its
    # actor held when it started, which depends on timing (lag <= s <= buffer.max_staleness)
    rollouts_ahead: int = 1
    tensorboard: bool = True        # TensorBoard event files in <run dir>/tensorboard (every metric)
    wandb: bool = False             # also log to Weights & Biases (optional: pip install wandb)
    progress: bool = True           # progress bars for steps and evaluation (only on a terminal)
    # stop with an error after this many training steps in a row were skipped (a non-finite
    # input, loss or gradient; launch/faults.py)
    max_consecutive_skips: int = 3

    def validate(self, prefix: str = "run") -> None:
        if not self.name or "/" in self.name:
            raise ConfigError(f"{prefix}.name", self.name, "a non-empty name without '/'")
        check_range(f"{prefix}.steps", self.steps, 0)
        check_range(f"{prefix}.prompts_per_step", self.prompts_per_step, 1)
        check_range(f"{prefix}.eval_problems", self.eval_problems, 0)
        check_range(f"{prefix}.eval_every", self.eval_every, 0)
        check_range(f"{prefix}.log_every", self.log_every, 1)
        check_range(f"{prefix}.checkpoint_every", self.checkpoint_every, 0)
        check_range(f"{prefix}.checkpoint_keep", self.checkpoint_keep, 0)
        check_range(f"{prefix}.rollouts_ahead", self.rollouts_ahead, 1)
        check_range(f"{prefix}.max_consecutive_skips", self.max_consecutive_skips, 1)
        if self.wandb and importlib.util.find_spec("wandb") is None:  # optional, never in the lock
            raise ConfigError(f"{prefix}.wandb", self.wandb,
                              "false, or install wandb first (pip install wandb): it is optional")


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def _check_scoring(self) -> None:
        """Where the old log-probs come from: the scorer pool, or with ``scorer.num_actors=0``
        the rollout actors' dense pass over their own samples (at the sampler's version)."""
        split, dense = self.correction.staleness.enabled, self.rollout.dense_logprobs
        if self.scorer.num_actors == 0:
            if not dense:
                raise ConfigError("rollout.dense_logprobs", dense, "true when scorer.num_actors=0 "
                                  "(without scorers the rollout actors' dense pass gives the old "
                                  "log-probs)")
            if split:
                raise ConfigError("correction.staleness.enabled", split, "false when "
                                  "scorer.num_actors=0 (the old log-probs are then at the "
                                  "sampler's version: no staleness to split off)")
            if self.correction.loss.kl_coef > 0:
                raise ConfigError("scorer.num_actors", 0, ">= 1 when correction.loss.kl_coef > 0 "
                                  "(the scorers hold the reference policy)")
            key, dtype = "rollout.dtype", self.rollout.dtype
        else:
            # The staleness split needs pi_dense at the sampler's version, which only the
            # rollout computes (a dense forward per sample): both on, or both off.
            if split != dense:
                raise ConfigError("rollout.dense_logprobs", dense,
                                  f"{str(split).lower()} when correction.staleness.enabled="
                                  f"{str(split).lower()} (the split needs the rollout's dense "
                                  "log-probs; without it they are a wasted forward)")
            key, dtype = "scorer.dtype", self.scorer.dtype
        # The old log-probs anchor the learner's PPO ratio: in another precision the ratio
        # starts away from 1 (measured: max 1.29 at step 1 for bf16 vs float32).
        if Dtype(dtype) != Dtype(self.learner.dtype):
            raise ConfigError(key, Dtype(dtype).value,
                              f"learner.dtype ({Dtype(self.learner.dtype).value}): the old "
                              "log-probs must come from the precision the learner trains in")

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(f.name)
        self._check_scoring()
        # mini-batches and learners both take whole GRPO groups (prompts) of a step's batch
        for key in ("mini_batches", "num_learners"):
            if getattr(self.learner, key) > self.run.prompts_per_step:
                raise ConfigError(f"learner.{key}", getattr(self.learner, key),
                                  f"at most run.prompts_per_step ({self.run.prompts_per_step}): "
                                  "each takes whole groups of a step's batch")
        # async samples lag the learner by one version: a buffer that drops them would starve
        if self.run.mode == RunMode.async_ and self.buffer.max_staleness < 1:
            raise ConfigError("buffer.max_staleness", self.buffer.max_staleness,
                              ">= 1 with run.mode=async (its samples lag the learner by one version)")
        ahead = self.run.rollouts_ahead
        if ahead > 1 and self.run.mode != RunMode.async_:
            raise ConfigError("run.rollouts_ahead", ahead, "1 with run.mode=sync (rollouts ahead of "
                              "the learner need run.mode=async)")
        if self.rollout.engine == EngineKind.vllm:  # vLLM sees only the actor's GPUs
            self.rollout.vllm.check_resources("rollout.vllm", self.cluster.rollout_gpus)
        if self.run.mode == RunMode.async_ and ahead > self.buffer.max_staleness:
            raise ConfigError("run.rollouts_ahead", ahead,
                              f"<= buffer.max_staleness ({self.buffer.max_staleness}): a batch "
                              f"generated s versions ahead lags the learner by up to s")


def parse_args(argv: list[str]) -> tuple[list[Path], list[str]]:
    """Split argv into ``--config FILE`` presets and ``key=value`` overrides."""
    files, overrides = [], []
    it = iter(argv)
    for arg in it:
        if arg in ("--config", "-c"):
            path = next(it, None)
            if path is None:
                raise ConfigError("--config", None, "a YAML file path after --config")
            files.append(Path(path))
        elif arg.startswith("--config="):
            files.append(Path(arg.split("=", 1)[1]))
        elif "=" in arg and not arg.startswith("-"):
            overrides.append(arg)
        else:
            raise ConfigError(arg, arg, "--config FILE.yaml or key=value overrides")
    return files, overrides


def load_config(argv: list[str] | None = None, *, default: bool = True) -> TrainConfig:
    """Defaults ← ``launch/configs/default.yaml`` (unless other presets are given) ← presets ← overrides."""
    files, overrides = parse_args(list(argv or []))
    if not files and default:
        files = [CONFIG_DIR / "default.yaml"]
    schema = OmegaConf.structured(TrainConfig)
    merged = schema
    for path in files:
        if not path.is_file():
            raise ConfigError("--config", str(path), "an existing YAML file")
        merged = merge(merged, OmegaConf.load(path), str(path))
    if overrides:
        for item in overrides:
            key, _, value = item.partition("=")
            if not key:
                raise ConfigError(item, item, "key=value")
        for item in overrides:  # one at a time, so an error names the item's key
            merged = merge(merged, parse_override(item), "command line", item)
    try:
        cfg: TrainConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise as_config_error(err, schema, "config") from None
    cfg.validate()
    secrets.check_config(OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))
    return cfg


def to_yaml(cfg: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
