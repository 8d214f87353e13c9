"""Tasks: problems with verifiable answers and their rewards (synthetic or from dataset files).

``make_task(cfg)`` is the one entry point; imports stay light (no torch, sympy is loaded lazily).
"""
from __future__ import annotations

from tasks.base import Problem, Task
from tasks.config import AnswerFormat, DataFormat, TaskConfig, TaskName


def make_task(cfg: TaskConfig) -> Task:
    """Build the Task that ``cfg`` describes (validated first)."""
    cfg.validate()
    if cfg.name is TaskName.dataset:
        from tasks.dataset import DatasetTask

        return DatasetTask(cfg)
    from tasks.synthetic import ReverseTask, RunningSumTask

    cls = {TaskName.running_sum: RunningSumTask, TaskName.reverse: ReverseTask}[cfg.name]
    return cls(seed=cfg.seed, n_train=cfg.n_train, n_heldout=cfg.n_heldout, min_terms=cfg.min_terms,
               max_terms=cfg.max_terms, max_digit=cfg.max_digit)


__all__ = ["AnswerFormat", "DataFormat", "Problem", "Task", "TaskConfig", "TaskName", "make_task"]
