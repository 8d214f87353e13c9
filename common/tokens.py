"""Tokenizer rules shared by the rollout, scorer, buffer and learner (no Ray, no model weights).

- Pad id: ``tokenizer.pad_token_id``, else the first eos id (Llama-3 ships no pad token). Padding is
  masked out everywhere, so any id works, but every part pads with the same one.
- Stop ids: the tokenizer's eos id united with every id of ``generation_config.eos_token_id``
  (Llama-3-Instruct ends a turn with ``<|eot_id|>``, which only the generation config lists).
- Prompts: ``rollout.chat_template`` = "none" (the task's text as is), "tokenizer" (the tokenizer's
  own template) or a path to a ``.jinja`` file, applied to one user turn with the generation prompt.
- Lengths: prompt + ``rollout.max_new_tokens`` must fit ``max_position_embeddings``; a prompt longer
  than ``rollout.max_prompt_tokens`` is dropped, left-truncated or refused
  (``rollout.overlong_prompt``).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from common.errors import ConfigError

log = logging.getLogger(__name__)
_warned: set[int] = set()


def pad_token_id(tokenizer) -> int:
    """The pad id every part uses: the tokenizer's, else its eos id (logged once per process)."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has neither a pad "
                         "nor an eos token: nothing to pad with")
    if int(eos) not in _warned:
        _warned.add(int(eos))
        log.warning("no pad token: using eos id %d", int(eos))
    return int(eos)


def _generation_eos(source) -> list[int]:
    """eos ids of a generation config object, or of a model directory's ``generation_config.json``
    (``config.json`` when it has none, as transformers falls back)."""
    if source is None:
        return []
    if isinstance(source, (str, Path)):
        for name in ("generation_config.json", "config.json"):
            path = Path(source) / name
            if path.is_file():
                value = json.loads(path.read_text()).get("eos_token_id")
                break
        else:
            value = None
    else:
        value = getattr(source, "eos_token_id", None)
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def eos_token_ids(tokenizer, generation_config=None) -> tuple[int, ...]:
    """Every id that ends a response: ``tokenizer.eos_token_id`` first, then the ids of
    ``generation_config`` (an object with ``eos_token_id`` or a model directory) not yet listed."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    for i in _generation_eos(generation_config):
        if i not in ids:
            ids.append(i)
    return tuple(ids)


def max_positions(model_path) -> int:
    """``max_position_embeddings`` of the model directory's config.json."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)     # multimodal wrappers nest the language model's config
    if "max_position_embeddings" not in cfg:
        raise ConfigError("rollout.model_path", str(model_path),
                          "a model whose config.json has max_position_embeddings")
    return int(cfg["max_position_embeddings"])


def prompt_budget(max_prompt_tokens: int, max_new_tokens: int, max_pos: int,
                  prefix: str = "rollout") -> int:
    """Longest prompt allowed: ``max_prompt_tokens`` (0: ``max_pos - max_new_tokens``). Raises
    ConfigError when prompt + ``max_new_tokens`` cannot fit the model's ``max_pos`` positions."""
    if max_prompt_tokens == 0:
        if max_new_tokens >= max_pos:
            raise ConfigError(f"{prefix}.max_new_tokens", max_new_tokens,
                              f"< the model's max_position_embeddings ({max_pos}), leaving room "
                              "for a prompt")
        return max_pos - max_new_tokens
    if max_prompt_tokens + max_new_tokens > max_pos:
        raise ConfigError(f"{prefix}.max_prompt_tokens", max_prompt_tokens,
                          f"{prefix}.max_prompt_tokens + {prefix}.max_new_tokens ({max_new_tokens})"
                          f" <= the model's max_position_embeddings ({max_pos})")
    return max_prompt_tokens


def chat_template(setting: str, tokenizer, key: str = "rollout.chat_template") -> str | None:
    """The Jinja template ``setting`` names: None for "none", the tokenizer's own for "tokenizer",
    else the text of that file. A missing template or file is a ConfigError naming ``key``."""
    if setting == "none":
        return None
    if setting == "tokenizer":
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(key, setting, "'none' or a .jinja file: the tokenizer at "
                              f"{getattr(tokenizer, 'name_or_path', '?')} has no chat template")
        return tokenizer.chat_template
    path = Path(setting)
    if not path.is_file():
        raise ConfigError(key, setting, "'none', 'tokenizer' or an existing .jinja file")
    return path.read_text()


class PromptEncoder:
    """Task text -> prompt ids: the chat template (if any), then the length rule."""

    def __init__(self, tokenizer, template: str | None, max_tokens: int, overlong: str):
        self.tokenizer, self.template = tokenizer, template
        self.max_tokens, self.overlong = int(max_tokens), str(getattr(overlong, "value", overlong))

    @classmethod
    def from_config(cls, tokenizer, cfg, max_pos: int, prefix: str = "rollout") -> "PromptEncoder":
        """From a ``RolloutConfig`` and the model's ``max_position_embeddings``."""
        limit = prompt_budget(cfg.max_prompt_tokens, cfg.max_new_tokens, max_pos, prefix)
        return cls(tokenizer, chat_template(cfg.chat_template, tokenizer, f"{prefix}.chat_template"),
                   limit, cfg.overlong_prompt)

    def ids(self, text: str) -> list[int]:
        """The full (never truncated) prompt ids of ``text``."""
        if self.template is None:
            return list(self.tokenizer(text)["input_ids"])
        out = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 chat_template=self.template,
                                                 add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, Mapping) else out)

    def encode(self, text: str) -> list[int]:
        """Prompt ids within ``max_tokens``: the last ``max_tokens`` ids with truncate_left;
        otherwise an over-long prompt raises (``fit`` removed or refused those at start-up)."""
        ids = self.ids(text)
        if len(ids) <= self.max_tokens:
            return ids
        if self.overlong == "truncate_left":
            return ids[-self.max_tokens:]
        raise ValueError(f"prompt of {len(ids)} tokens > rollout.max_prompt_tokens "
                         f"({self.max_tokens}) with rollout.overlong_prompt={self.overlong}")

    def fit(self, problems: list, split: str = "train") -> tuple[list, int]:
        """(problems to use, how many were over-long): drop leaves them out, truncate_left keeps
        them (``encode`` truncates), error raises a ConfigError naming the key and the count."""
        over = [len(self.ids(p.prompt)) > self.max_tokens for p in problems]
        long = [p for p, o in zip(problems, over) if o]
        if long and self.overlong == "error":
            raise ConfigError("rollout.overlong_prompt", "error",
                              f"'drop' or 'truncate_left': {len(long)} of {len(problems)} {split} "
                              f"prompts (first: problem {long[0].idx}) are longer than "
                              f"{self.max_tokens} tokens (rollout.max_prompt_tokens)")
        if self.overlong == "drop":
            problems = [p for p, o in zip(problems, over) if not o]
        return problems, len(long)
