"""The math preset's task section loads the real MATH file (from ../shared/data, not the repo)."""
from pathlib import Path

import pytest

from launch.config import CONFIG_DIR, load_config
from tasks import make_task

REPO = Path(__file__).resolve().parent.parent


def test_math_preset_task_loads_real_data(monkeypatch):
    cfg = load_config(["--config", str(CONFIG_DIR / "math.yaml")])
    if not (REPO / cfg.task.path).is_file():
        pytest.skip(f"{cfg.task.path} is not beside this checkout")
    monkeypatch.chdir(REPO)
    task = make_task(cfg.task)
    train, held = task.problems("train"), task.problems("heldout")
    assert len(held) == 500 and len(train) > 5000
    assert not {p.prompt for p in held} & {p.prompt for p in train[:2000]}
    p = held[0]
    assert task.reward(f"so the answer is \\boxed{{{p.answer}}}", p.answer) == 1.0
