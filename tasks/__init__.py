"""Tasks: problems with verifiable answers and their rewards (synthetic or from dataset files).

``make_task(cfg)`` is the one entry point; imports stay light (no torch, sympy is loaded lazily).
"""
from __future__ import annotations

from tasks.base import Problem, RewardTimeout, Task
from tasks.config import AnswerFormat, DataFormat, TaskConfig, TaskName


def make_task(cfg: TaskConfig) -> Task:
    """Build the Task that ``cfg`` describes (validated first); with ``task.reward_fn`` its
    reward is that function (a ``ConfigError`` names the key when it cannot be imported)."""
    cfg.validate()
    if cfg.name is TaskName.dataset:
        from tasks.dataset import DatasetTask

        task = DatasetTask(cfg)
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


__all__ = ["AnswerFormat", "DataFormat", "Problem", "RewardTimeout", "Task", "TaskConfig",
           "TaskName", "make_task"]
