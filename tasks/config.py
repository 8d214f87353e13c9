"""TaskConfig: which task to train and evaluate on (synthetic or a prompt/label dataset file).

Usable as an OmegaConf structured config: plain fields, enums with string values, no Optional
unions beyond what OmegaConf supports. ``validate()`` names the dotted key of anything wrong.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from common.errors import ConfigError
from common.validate import check_enum, check_range


class TaskName(str, enum.Enum):
    """Synthetic tasks (generated from ``seed``) or ``dataset`` (a JSONL/Parquet file)."""

    running_sum = "running_sum"   # write every partial sum of a labelled digit list, then the total
    reverse = "reverse"           # write a digit string backwards
    # a few + and - steps over the prompt's facts, worked in a long, redundant response
    # (task.reasoning.*)
    reasoning = "reasoning"
    dataset = "dataset"           # prompt/answer rows from ``path`` with a math verifier


class DataFormat(str, enum.Enum):
    auto = "auto"        # from the file suffix: .jsonl/.json -> jsonl, .parquet/.pq -> parquet
    jsonl = "jsonl"
    parquet = "parquet"


class AnswerFormat(str, enum.Enum):
    """How the gold answer is stored in ``answer_field``."""

    plain = "plain"      # the answer itself ("118", "\\frac{1}{2}")
    gsm8k = "gsm8k"      # a worked solution ending in "#### N"; the answer is N


@dataclass
class EvalSetConfig:
    """A held-out dataset evaluated beside the task's own held-out problems (dataset tasks: the
    same math-verify reward), e.g. MATH-500 and GSM8K. Its accuracy
    is logged as ``eval/<name>/accuracy`` before RL, every ``run.eval_every`` steps and after."""
    name: str = ""
    path: str = ""                # JSONL or Parquet (``task.format``)
    prompt_field: str = "prompt"
    answer_field: str = "label"
    answer_format: AnswerFormat = AnswerFormat.plain
    # its own, since its raw rows may not look like the training file's (e.g. chat-formatted)
    prompt_template: str = "{prompt}"
    n: int = 0                    # its first n rows (0: all)

    def __post_init__(self) -> None:
        if isinstance(self.answer_format, str) and not isinstance(self.answer_format, AnswerFormat):
            self.answer_format = check_enum("task.eval_sets.answer_format", AnswerFormat,
                                            self.answer_format)

    def validate(self, prefix: str) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"{prefix}.name", self.name, "a name of letters, digits, '-', '_'")
        for key in ("path", "prompt_field", "answer_field"):
            if not getattr(self, key):
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), "a non-empty value")
        check_enum(f"{prefix}.answer_format", AnswerFormat, self.answer_format)
        if "{prompt}" not in self.prompt_template:
            raise ConfigError(f"{prefix}.prompt_template", self.prompt_template,
                              "a string containing '{prompt}'")
        check_range(f"{prefix}.n", self.n, 0)


@dataclass
class ReasoningConfig:
    """The ``reasoning`` task's shape (tasks/reasoning.py); read only when task.name=reasoning."""
    facts: int = 3                # facts in the prompt (a=7 b=3 ...): the computation's steps
    # Target mean response length in tokens (one per character): the notes per gap (the same for
    # every problem) are the count whose mean length comes closest (a note adds 15-35 tokens a gap)
    response_tokens: int = 320
    # Operands of the last far_facts steps appear only in the prompt (never restated): the tokens
    # far back that later steps need; 0: every step needs only its own last gap of notes
    far_facts: int = 1

    def validate(self, prefix: str) -> None:
        from tasks.reasoning import MAX_FACTS, MAX_RESPONSE_TOKENS

        check_range(f"{prefix}.facts", self.facts, 2, MAX_FACTS)
        check_range(f"{prefix}.response_tokens", self.response_tokens, 1, MAX_RESPONSE_TOKENS)
        check_range(f"{prefix}.far_facts", self.far_facts, 0, self.facts - 1)


@dataclass
class TaskConfig:
    name: TaskName = TaskName.running_sum
    seed: int = 0                 # problems and the train/held-out split are a function of this
    n_train: int = 4096           # synthetic: problems generated; dataset: cap (0 = all rows left)
    n_heldout: int = 256          # held-out problems (dataset without heldout_path: rows set aside)
    # Difficulty of the synthetic tasks: number of terms (digits) per problem, drawn uniformly.
    min_terms: int = 8
    max_terms: int = 16
    max_digit: int = 9            # running_sum: terms are drawn from 1..max_digit
    reasoning: ReasoningConfig = field(default_factory=ReasoningConfig)
    # Dataset kind: one file, optionally a second file for held-out problems.
    path: str = ""
    heldout_path: str = ""        # empty: hold out n_heldout rows of ``path`` (seeded shuffle)
    format: DataFormat = DataFormat.auto
    prompt_field: str = "prompt"
    answer_field: str = "label"
    answer_format: AnswerFormat = AnswerFormat.plain
    # Applied to the raw prompt field; "{prompt}" keeps it as is (e.g. already chat-formatted).
    prompt_template: str = "{prompt}"
    skip_malformed: bool = False  # False: a malformed row stops with file:line; True: skip and count
    eval_sets: list[EvalSetConfig] = field(default_factory=list)   # dataset tasks only
    # A reward call that raises or runs past this many seconds gives its sample reward 0, marked
    # in the row (reward_fault) and counted (faults/reward_errors, faults/reward_timeouts); the
    # rewards then run in a child process of each rollout actor (0: in-process, no timeout)
    reward_timeout_s: float = 30.0
    # empty: the task's own reward; else "module:function", called as function(response, answer)
    # instead (tasks/faulty.py holds rewards that fail on purpose, for fault-injection runs)
    reward_fn: str = ""

    def __post_init__(self) -> None:
        # Plain-Python callers (tests, scripts) may pass enum values as strings, as YAML does.
        for key, enum_cls in (("name", TaskName), ("format", DataFormat),
                              ("answer_format", AnswerFormat)):
            value = getattr(self, key)
            if isinstance(value, str) and not isinstance(value, enum_cls):
                setattr(self, key, check_enum(f"task.{key}", enum_cls, value))

    def validate(self, prefix: str = "task") -> None:
        """Raise ConfigError naming ``prefix.key`` for any value out of range."""
        k = f"{prefix}."
        check_range(k + "n_train", self.n_train, 0)
        check_range(k + "n_heldout", self.n_heldout, 0)
        check_range(k + "min_terms", self.min_terms, 1, 26)
        check_range(k + "max_terms", self.max_terms, self.min_terms, 26)
        check_range(k + "max_digit", self.max_digit, 1, 9)
        check_range(k + "reward_timeout_s", self.reward_timeout_s, 0.0)
        self.reasoning.validate(k + "reasoning")
        if self.reward_fn and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.reward_fn):
            raise ConfigError(k + "reward_fn", self.reward_fn,
                              "empty or 'module:function' (e.g. tasks.faulty:flaky)")
        if self.name is TaskName.dataset:
            if not self.path:
                raise ConfigError(k + "path", self.path, "a JSONL or Parquet file when name=dataset")
            for key in ("prompt_field", "answer_field"):
                if not getattr(self, key):
                    raise ConfigError(k + key, getattr(self, key), "a non-empty field name")
            if "{prompt}" not in self.prompt_template:
                raise ConfigError(k + "prompt_template", self.prompt_template,
                                  "a string containing '{prompt}'")
        elif self.n_train + self.n_heldout == 0:
            raise ConfigError(k + "n_train", self.n_train, "n_train + n_heldout > 0")
        if self.eval_sets and self.name is not TaskName.dataset:
            raise ConfigError(k + "eval_sets", [e.name for e in self.eval_sets],
                              "empty unless task.name=dataset (their rewards are math-verify's)")
        for i, e in enumerate(self.eval_sets):
            e.validate(f"{k}eval_sets.{i}")
        names = [e.name for e in self.eval_sets]
        if len(set(names)) != len(names) or "heldout" in names:
            raise ConfigError(k + "eval_sets", names, "distinct names other than 'heldout'")
