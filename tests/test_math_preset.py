"""The math preset's task section loads the real MATH file (from ../shared/data, not the repo)."""


def test_math_preset_task_loads_real_data(preset_task):
    _, task = preset_task("math")
    train, held = task.problems("train"), task.problems("heldout")
    assert len(held) == 500 and len(train) > 5000
    assert not {p.prompt for p in held} & {p.prompt for p in train[:2000]}
    p = held[0]
    assert task.reward(f"so the answer is \\boxed{{{p.answer}}}", p.answer) == 1.0
