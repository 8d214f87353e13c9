"""Synthetic tasks: determinism, disjoint splits, worked solutions and exact-match rewards."""
from __future__ import annotations

import pytest

from common.errors import ConfigError
from tasks import TaskConfig, TaskName, make_task
from tasks.synthetic import RunningSumTask, exact_match_reward, final_answer


def test_same_seed_same_problems_other_seed_differs():
    a = make_task(TaskConfig(seed=3, n_train=50, n_heldout=20))
    b = make_task(TaskConfig(seed=3, n_train=50, n_heldout=20))
    c = make_task(TaskConfig(seed=4, n_train=50, n_heldout=20))
    for split in ("train", "heldout"):
        assert a.problems(split) == b.problems(split)
        assert a.problems(split) != c.problems(split)


@pytest.mark.parametrize("name", [TaskName.running_sum, TaskName.reverse])
def test_splits_disjoint_and_sized(name):
    t = make_task(TaskConfig(name=name, n_train=400, n_heldout=100, min_terms=6, max_terms=10))
    train, held = t.problems("train"), t.problems("heldout")
    assert len(train) == 400 and len(held) == 100
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert len({p.prompt for p in train}) == 400          # no duplicates within a split
    assert [p.idx for p in train] == list(range(400))


def test_train_split_does_not_move_with_heldout_size():
    a = make_task(TaskConfig(n_train=30, n_heldout=5)).problems("train")
    b = make_task(TaskConfig(n_train=30, n_heldout=50)).problems("train")
    assert a == b


def test_running_sum_solution_and_answer():
    sol = RunningSumTask.solution("sum a3b1c4d1e5\n")
    assert sol == "a3b4c8d9e14=14"
    t = make_task(TaskConfig(n_train=20, n_heldout=5, min_terms=4, max_terms=12))
    for p in t.problems("train"):
        digits = [int(ch) for ch in p.prompt.split()[1][1::2]]
        assert p.answer == str(sum(digits))
        assert 4 <= len(digits) <= 12
        assert t.reward(t.solution(p.prompt), p.answer) == 1.0


def test_reverse_solution():
    t = make_task(TaskConfig(name="reverse", n_train=5, n_heldout=2))
    p = t.problems("train")[0]
    assert p.answer == p.prompt.split()[1][::-1]
    assert t.reward(t.solution(p.prompt), p.answer) == 1.0


@pytest.mark.parametrize("response,answer,expected", [
    ("a3b4=4", "4", 1.0),
    ("a3b4= 4 ", "4", 1.0),          # spaces around the answer are not the model's mistake
    ("a3b4=5", "4", 0.0),
    ("a3b4=04", "4", 0.0),           # exact match: a leading zero is wrong
    ("a3b4=4=5", "4", 0.0),          # the last '=' counts
    ("", "4", 0.0),
    ("4", "4", 1.0),                 # no '=': the whole response is the answer (reverse task)
    ("a3b4=", "4", 0.0),
    ("a3b4=4junk", "4", 0.0),        # a response cut at max length does not pass
])
def test_exact_match_reward_edge_cases(response, answer, expected):
    assert exact_match_reward(response, answer) == expected


def test_final_answer():
    assert final_answer("x=1=23\n") == "23"


def test_too_few_distinct_problems_is_an_error():
    with pytest.raises(ValueError, match="distinct"):
        make_task(TaskConfig(name="reverse", min_terms=1, max_terms=1, n_train=100)).problems("train")


@pytest.mark.parametrize("key,value", [("n_train", -1), ("min_terms", 0), ("max_terms", 27),
                                       ("max_digit", 10)])
def test_validate_names_key(key, value):
    cfg = TaskConfig(**{key: value})
    with pytest.raises(ConfigError, match=f"task.{key}"):
        cfg.validate()


def test_max_below_min_terms_rejected():
    with pytest.raises(ConfigError, match="x.max_terms"):
        TaskConfig(min_terms=10, max_terms=5).validate("x")


def test_structured_config_round_trip():
    from omegaconf import OmegaConf

    base = OmegaConf.structured(TaskConfig)
    cfg = OmegaConf.to_object(OmegaConf.merge(base, {"name": "reverse", "skip_malformed": True}))
    assert cfg.name is TaskName.reverse and cfg.skip_malformed is True
    with pytest.raises(Exception, match="running_sum"):
        OmegaConf.merge(base, {"name": "nope"})
    with pytest.raises(Exception):
        OmegaConf.merge(base, {"n_train": "many"})
