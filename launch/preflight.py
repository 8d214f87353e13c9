"""Start-up checks of the model and the prompts against the config, before Ray and the run folder.

``check_model``: the model directory holds a readable config.json, weights and a tokenizer whose ids
fit the model's vocabulary; ``rollout.chat_template`` resolves; a prompt of
``rollout.max_prompt_tokens`` plus ``rollout.max_new_tokens`` fits ``max_position_embeddings``, and
a compressing KV budget is below it. Each failure is a ConfigError naming the key and the file.
``check_shared_paths``: under ``ray job submit`` the paths every node uses are absolute.
``task_prompts``: the task's prompts encoded once with the rollout's rule (common/tokens.py), so the
over-long ones are dropped, truncated or refused (``rollout.overlong_prompt``) and counted.
"""
from __future__ import annotations

import json
from pathlib import Path

from common.errors import ConfigError

KEY = "rollout.model_path"
# What from_pretrained loads weights from (safetensors only: common.modeling.HF_WEIGHTS); an index
# names shard files that must exist too.
WEIGHT_FILES = ("model.safetensors",)
WEIGHT_INDEXES = ("model.safetensors.index.json",)
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def check_model(cfg):
    """(tokenizer, PromptEncoder) of ``cfg.rollout.model_path``; ConfigError naming the key when the
    directory, the chat template or the lengths do not fit the config."""
    from common.tokens import PromptEncoder, max_positions

    path = Path(cfg.rollout.model_path)
    if not (path / "config.json").is_file():
        raise ConfigError(KEY, cfg.rollout.model_path,
                          "an HF model directory with config.json (`make model` builds the tiny base)")
    model_cfg = _model_config(path)
    _check_weights(path)
    tokenizer = _tokenizer(path)
    _check_vocab(path, tokenizer, model_cfg)
    max_pos = max_positions(path)
    _check_kv_budget(cfg.rollout.kv, max_pos)
    return tokenizer, PromptEncoder.from_config(tokenizer, cfg.rollout, max_pos)


# Set by Ray's job supervisor in the environment of a `ray job submit` entrypoint.
JOB_SUBMIT_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
SHARED_PATHS = ("run.out_dir", "rollout.model_path", "buffer.root")


def check_shared_paths(cfg, environ=None) -> None:
    """Under ``ray job submit`` every path the actors read or write must be absolute.

    The job's driver and every worker node run in their own unpacked copy of the working dir, so a
    relative path names a different folder on each node: a checkpoint's learner parts would land on
    the learners' node and the rest on the head's, each half useless. An absolute path on storage
    every node mounts is one place."""
    import os

    environ = os.environ if environ is None else environ
    if JOB_SUBMIT_ENV not in environ:
        return
    for key in SHARED_PATHS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and not Path(str(value)).is_absolute():
            raise ConfigError(key, value, "an absolute path on storage every node shares: under "
                              "`ray job submit` each node resolves a relative path against its "
                              "own unpacked copy of the working dir, so the driver and the actors "
                              "on other nodes would read and write different folders")


def _model_config(path: Path):
    """The directory's config as transformers reads it; a file that is not JSON or that
    transformers cannot read (no or unknown model_type) names the file, not a traceback."""
    from transformers import AutoConfig

    from common.modeling import HF_LOAD

    file = path / "config.json"
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f":{e.lineno}:{e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise ConfigError(KEY, str(path), f"a model whose {file}{where} is JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(KEY, str(path), f"a model whose {file} is a JSON object")
    try:
        return AutoConfig.from_pretrained(str(path), **HF_LOAD)
    except Exception as e:  # transformers raises ValueError/KeyError/OSError for a config it rejects
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "auto_map" in raw:
            msg = (f"{file} names its own code (auto_map: {sorted(raw['auto_map'])}), which is "
                   "never run (trust_remote_code is off); a model_type transformers knows")
        raise ConfigError(KEY, str(path), f"a config.json transformers can read: {msg}") from None


def _check_weights(path: Path) -> None:
    """Weights are loaded inside the actors; without them every actor dies after Ray started."""
    for name in WEIGHT_INDEXES:
        index = path / name
        if index.is_file():
            try:
                shards = set(json.loads(index.read_text())["weight_map"].values())
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(KEY, str(path), f"a readable {index} ({e})") from None
            missing = sorted(s for s in shards if not (path / s).is_file())
            if missing:
                raise ConfigError(KEY, str(path), f"every shard {index} names; missing {missing}")
            return
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        pickled = [n for n in PICKLED if (path / n).is_file()]
        why = f"; {pickled[0]} is a pickle, never loaded: save the model with " \
              "save_pretrained (safetensors)" if pickled else ""
        raise ConfigError(KEY, str(path), "a model directory with safetensors weights (one of "
                          f"{', '.join(WEIGHT_FILES + WEIGHT_INDEXES)}){why}")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _tokenizer(path: Path):
    from common.modeling import load_tokenizer

    # without its files transformers builds an empty tokenizer (every prompt -> no ids), silently
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(KEY, str(path), "a model directory with a tokenizer (one of "
                          f"{', '.join(TOKENIZER_FILES)})")
    try:
        return load_tokenizer(path)
    except Exception as e:  # missing or unreadable tokenizer files: several exception types
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(KEY, str(path), f"a model directory with a tokenizer: {msg}") from None


def _check_vocab(path: Path, tokenizer, model_cfg) -> None:
    """An id >= vocab_size indexes past the embedding: a crash in every actor, or garbage."""
    text_cfg = getattr(model_cfg, "text_config", None) or model_cfg
    vocab = getattr(text_cfg, "vocab_size", None)
    if vocab is not None and len(tokenizer) > int(vocab):
        raise ConfigError(KEY, str(path), f"a tokenizer whose ids fit the model's vocab_size "
                          f"({vocab}); the tokenizer has {len(tokenizer)} ids")


def _check_kv_budget(kv, max_pos: int) -> None:
    """A compressing policy's budget must be below the context, or the cache never fills and the
    run is silently dense. (budget > sink_tokens / obs_window: ``KVConfig.validate``.)"""
    policy = getattr(kv.policy, "value", kv.policy)
    if policy != "dense" and kv.budget >= max_pos:
        raise ConfigError("rollout.kv.budget", kv.budget,
                          f"< the model's max_position_embeddings ({max_pos}) with "
                          f"rollout.kv.policy={policy} (a larger cache never compresses)")


def task_prompts(task, encoder, eval_problems: int, eval_sets=()) -> tuple[list, dict, dict]:
    """(training problems, evaluation sets {"heldout": the task's held-out problems (the first
    ``eval_problems``; 0: all), name: problems of each ``eval_sets`` (``task.eval_sets``) entry},
    counts of over-long prompts per split for the metrics log and the summary)."""
    train, n_train = encoder.fit(task.problems("train"), "train")
    heldout, n_held = encoder.fit(task.problems("heldout"), "heldout")
    evals = {"heldout": heldout[:eval_problems] if eval_problems else heldout}
    counts = {"prompts/overlong_train": n_train, "prompts/overlong_heldout": n_held}
    for es in eval_sets:
        evals[es.name], counts[f"prompts/overlong_{es.name}"] = encoder.fit(
            task.eval_set(es.name), es.name)
    if any(counts.values()):
        print(f"[prompts] longer than {encoder.max_tokens} tokens: {counts}; "
              f"rollout.overlong_prompt={encoder.overlong}", flush=True)
    if n_train and not train:
        raise ConfigError("rollout.max_prompt_tokens", encoder.max_tokens,
                          f"a limit some training prompt fits: all {n_train} are longer")
    return train, evals, counts
