"""Start-up checks of the model and the prompts against the config, before Ray and the run folder.

``check_model``: the model directory exists, ``rollout.chat_template`` resolves, and a prompt of
``rollout.max_prompt_tokens`` plus ``rollout.max_new_tokens`` fits ``max_position_embeddings``.
``task_prompts``: the task's prompts encoded once with the rollout's rule (common/tokens.py), so the
over-long ones are dropped, truncated or refused (``rollout.overlong_prompt``) and counted.
"""
from __future__ import annotations

from pathlib import Path

from common.errors import ConfigError


def check_model(cfg):
    """(tokenizer, PromptEncoder) of ``cfg.rollout.model_path``; ConfigError naming the key when the
    directory, the chat template or the lengths do not fit the config."""
    from common.modeling import load_tokenizer
    from common.tokens import PromptEncoder, max_positions

    path = Path(cfg.rollout.model_path)
    if not (path / "config.json").is_file():
        raise ConfigError("rollout.model_path", cfg.rollout.model_path,
                          "an HF model directory with config.json (`make model` builds the tiny base)")
    tokenizer = load_tokenizer(path)
    return tokenizer, PromptEncoder.from_config(tokenizer, cfg.rollout, max_positions(path))


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
