"""Tasks: problems with verifiable answers and their rewards (synthetic or from dataset files).

``make_task(cfg)`` is the one entry point; imports stay light (no torch, sympy is loaded lazily).
"""
from __future__ import annotations

from tasks.base import Problem, RewardTimeout, Task
from tasks.config import AnswerFormat, DataFormat, ReasoningConfig, TaskConfig, TaskName


def make_task(cfg: TaskConfig) -> Task:
    """Build the Task that ``cfg`` describes (validated first); with ``task.reward_fn`` its
    reward is that function (a ``ConfigError`` names the key when it cannot be imported)."""
    cfg.validate()
    if cfg.name is TaskName.dataset:
        from tasks.dataset import DatasetTask

        task = DatasetTask(cfg)
    elif cfg.name is TaskName.reasoning:
        from tasks.reasoning import ReasoningTask

        r = cfg.reasoning
        task = ReasoningTask(seed=cfg.seed, n_train=cfg.n_train, n_heldout=cfg.n_heldout,
                             facts=r.facts, response_tokens=r.response_tokens,
                             far_facts=r.far_facts)
    else:
        from tasks.synthetic import ReverseTask, RunningSumTask

        cls = {TaskName.running_sum: RunningSumTask, TaskName.reverse: ReverseTask}[cfg.name]
        task = cls(seed=cfg.seed, n_train=cfg.n_train, n_heldout=cfg.n_heldout,
                   min_terms=cfg.min_terms, max_terms=cfg.max_terms, max_digit=cfg.max_digit)
    if cfg.reward_fn:
        task.reward = _import_reward(cfg.reward_fn)
    return task


def _import_reward(spec: str):
    import importlib

    from common.errors import ConfigError

    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError("task.reward_fn", spec, f"an importable function ({err})") from None
    if not callable(fn):
        raise ConfigError("task.reward_fn", spec, "a callable (response, answer) -> float")
    return fn


__all__ = ["AnswerFormat", "DataFormat", "Problem", "ReasoningConfig", "RewardTimeout", "Task",
           "TaskConfig", "TaskName", "make_task"]
