"""The ``reasoning`` task (issue 28): determinism, disjoint splits, the length and far-facts knobs,
gold responses earn reward 1, config keys validated by name, the preset loads."""
from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import ConfigError
from tasks import ReasoningConfig, TaskConfig, TaskName, make_task
from tasks.reasoning import ReasoningTask, apply, parse_prompt

REPO = Path(__file__).resolve().parent.parent


def _task(**kw):
    r = {k: kw.pop(k) for k in ("facts", "response_tokens", "far_facts") if k in kw}
    return make_task(TaskConfig(name="reasoning", reasoning=ReasoningConfig(**r), **kw))


def test_same_seed_same_problems_and_responses_other_seed_differs():
    a, b = _task(seed=3, n_train=40, n_heldout=10), _task(seed=3, n_train=40, n_heldout=10)
    c = _task(seed=4, n_train=40, n_heldout=10)
    for split in ("train", "heldout"):
        assert a.problems(split) == b.problems(split) != c.problems(split)
    assert [a.solution(p.prompt) for p in a.problems("train")] == \
        [b.solution(p.prompt) for p in b.problems("train")]


def test_splits_disjoint_and_sized():
    t = _task(n_train=500, n_heldout=60)
    train, held = t.problems("train"), t.problems("heldout")
    assert len(train) == 500 and len(held) == 60
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert len({p.prompt for p in train}) == 500


def test_gold_responses_earn_reward_1_and_answers_are_the_computation():
    for facts, far in ((3, 1), (4, 0), (5, 4)):
        t = _task(n_train=50, n_heldout=10, facts=facts, far_facts=far)
        for p in t.problems("train") + t.problems("heldout"):
            sol = t.solution(p.prompt)
            assert t.reward(sol, p.answer) == 1.0
            facts_, order, ops = parse_prompt(p.prompt)
            value = dict(facts_)
            assert sorted(order) == sorted(value) and len(ops) == facts - 1
            r = value[order[0]]
            for k, op in zip(order[1:], ops):
                r = apply(op, r, value[k])
                assert r >= 0
            assert p.answer == str(r) and sol.endswith(f"answer={r}")
            assert t.reward(sol + "0", p.answer) == 0.0


def test_worked_example():
    t = ReasoningTask(n_train=1, n_heldout=1, facts=3, far_facts=1, response_tokens=320)
    sol = t.render("ask a=7 b=5 c=4 do c+a-b\n", notes=3)
    lines = sol.split("\n")
    assert lines[0] == "we have a=7 c=4; do c+a-b."          # the far fact b is not restated
    assert lines[1] == "start r=c=4." and lines[5] == "then r+a=4+7=11."
    assert lines[9] == "then r-b=11-5=6." and lines[-1] == "answer=6"
    assert lines[2] == "(1) r=4, left +a-b, a=7 c=4. we do c+a-b."      # bodies from the end:
    assert lines[3] == "(2) r=4, left +a-b, a=7 c=4. check c=4."        # hesitate, check, goal
    assert lines[4].startswith("(3) r=4, left +a-b, a=7 c=4. ")
    assert lines[-2].startswith("(3) r=6, left none, a=7 c=4. ")
    assert lines[7] == "(2) r=11, left -b, a=7 c=4. check 4+7=11."
    assert " b=5" not in sol                    # the far fact (the last operand): prompt only


def test_far_facts_knob_controls_which_values_are_restated():
    prompt = "ask a=1 b=2 c=3 d=4 do d+b+a+c\n"
    for far in range(4):
        sol = ReasoningTask(n_train=1, n_heldout=1, facts=4, far_facts=far).solution(prompt)
        restated = [k for k, v in (("a", 1), ("b", 2), ("c", 3), ("d", 4)) if f" {k}={v}" in sol]
        # the operands of the last `far` steps (c, then a, then b) are never restated
        assert restated == sorted(set("abcd") - set("cab"[:far]))


def test_length_knob():
    lens = []
    for target in (200, 320, 640, 1280, 2048):
        t = _task(n_train=30, n_heldout=5, response_tokens=target)
        mean = sum(len(t.solution(p.prompt)) for p in t.problems("train")) / 30
        assert abs(mean - target) < 0.25 * target + 60, (target, mean, t.notes)
        lens.append((t.notes, mean))
    assert [n for n, _ in lens] == sorted({n for n, _ in lens})       # strictly more notes
    assert lens[-1][1] > 1800
    # the default: a few hundred tokens, with recaps, restated facts and filler in every gap
    t = _task(n_train=20, n_heldout=5)
    assert t.notes >= 2 and 250 < t.mean_response_len(t.notes) < 400
    sol = t.solution(t.problems("train")[0].prompt)
    assert sol.count(", left ") == 3 * t.notes and sol.count("check ") == 3


def test_vocabulary_is_one_token_per_character():
    from tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    t = _task(n_train=5, n_heldout=2, response_tokens=640)
    text = t.problems("train")[0].prompt + t.solution(t.problems("train")[0].prompt)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    assert tok.decode(ids) == text


@pytest.mark.parametrize("key,value", [("facts", 1), ("facts", 9), ("response_tokens", 0),
                                       ("response_tokens", 5000), ("far_facts", -1),
                                       ("far_facts", 3)])
def test_validate_names_key(key, value):
    cfg = TaskConfig(name="reasoning", reasoning=ReasoningConfig(**{key: value}))
    with pytest.raises(ConfigError, match=rf"task\.reasoning\.{key}"):
        make_task(cfg)


def test_keys_from_the_command_line():
    from launch.config import load_config

    cfg = load_config(["task.name=reasoning", "task.reasoning.facts=4",
                       "task.reasoning.response_tokens=512"])
    assert cfg.task.name is TaskName.reasoning and cfg.task.reasoning.facts == 4
    with pytest.raises(ConfigError, match=r"task\.reasoning\.far_facts"):
        load_config(["task.name=reasoning", "task.reasoning.far_facts=7"])
    with pytest.raises(ConfigError, match=r"task\.reasoning\.nosuch"):
        load_config(["task.reasoning.nosuch=1"])


def test_preset_loads_and_matches_its_task():
    from launch.config import CONFIG_DIR, load_config

    cfg = load_config(["--config", str(CONFIG_DIR / "reasoning.yaml")])
    assert cfg.task.name is TaskName.reasoning and cfg.run.steps == 40
    t = make_task(cfg.task)
    longest = max(len(t.solution(p.prompt)) for p in t.problems("heldout"))
    assert cfg.rollout.max_new_tokens >= longest + 1                    # + EOS
    assert "reasoning" in cfg.rollout.model_path
    # issue 28's bar 1: a budget of 25% of the mean sequence, its peak (budget + the tokens decoded
    # between compressions) <= 0.35 of a dense cache, the prompt kept
    held = t.problems("heldout")
    mean_seq = sum(len(p.prompt) + len(t.solution(p.prompt)) + 1 for p in held) / len(held)
    kv = cfg.rollout.kv
    assert round(kv.budget / mean_seq, 2) == 0.25 and kv.protect_prompt
    assert (kv.budget + kv.compress_every) / mean_seq <= 0.35


def test_quick_preset_fits_its_task_and_the_makefile_build():
    """reasoning-quick.yaml, the job `make train` runs after building its base, runs on the model
    the Makefile's quick-model target builds: the same task shape, room for the longest gold
    response, and a budget that holds under half of the mean sequence."""
    import re

    from launch.config import CONFIG_DIR, load_config

    cfg = load_config(["--config", str(CONFIG_DIR / "reasoning-quick.yaml")])
    make = (REPO / "Makefile").read_text()
    quick = re.search(r"^QUICK\s*:=\s*(\S+)", make, re.M).group(1)
    assert cfg.rollout.model_path == quick
    train = re.search(r"^train:(.*)\n\t(.*)$", make, re.M)
    assert train.group(1).split() == ["quick-model"]
    assert "launch/train.py --config launch/configs/reasoning-quick.yaml $(ARGS)" in train.group(2)
    # the recipe's commands, continuation lines joined; stage 2 builds $(QUICK) from $(QUICK)-short
    recipe = re.search(r"^quick-model:.*\n((?:\t.*\n)+)", make, re.M).group(1)
    commands = [c.split() for c in recipe.replace("\\\n", " ").splitlines()]
    stage2 = [c for c in commands if "--init-from" in c and c[c.index("--init-from") + 1]
              == "$(QUICK)-short"]
    assert len(stage2) == 1 and stage2[0][stage2[0].index("--out") + 1] == "$(QUICK)"
    opts = stage2[0]
    assert int(opts[opts.index("--response-tokens") + 1]) == cfg.task.reasoning.response_tokens
    t = make_task(cfg.task)
    held = t.problems("heldout")
    longest = max(len(t.solution(p.prompt)) for p in held)
    assert cfg.rollout.max_new_tokens >= longest + 1                    # + EOS
    mean_seq = sum(len(p.prompt) + len(t.solution(p.prompt)) + 1 for p in held) / len(held)
    assert cfg.rollout.kv.budget + cfg.rollout.kv.compress_every < mean_seq / 2


def test_base_model_builder_takes_the_task(tmp_path):
    import json

    from launch import make_base_model as mbm

    args = mbm.parse_args(["--task", "reasoning", "--out", str(tmp_path / "m"), "--hidden", "32",
                           "--layers", "1", "--heads", "2", "--batch-size", "4", "--max-steps", "2",
                           "--eval-every", "2", "--n-eval", "2", "--n-train", "16",
                           "--n-heldout", "4", "--response-tokens", "100", "--far-facts", "2",
                           "--threads", "1", "--target-acc", "1.1"])
    assert args.lr == mbm.TASK_DEFAULTS["reasoning"]["lr"]      # unset options: the task's
    assert args.kept_share == 0.5 and args.drill == 4
    # No second stage by default (the settled base is above the 0.3-0.6 band).
    assert args.settle_target == 0.0 and args.settle_lr == args.lr / 2
    out = mbm.build(args, log=lambda s: None)
    metrics = json.loads((out / mbm.METRICS).read_text())
    assert metrics["task"]["name"] == "reasoning" and metrics["task"]["seed"] == 0
    assert metrics["steps"] == 2 and "settle" not in metrics
    assert metrics["task"]["reasoning"] == {"facts": 3, "response_tokens": 100, "far_facts": 2}
    default = mbm.parse_args([])
    assert default.out == ".cache/models/tiny-base" and default.target_acc == 0.35
    assert default.settle_target == 0.0
    assert mbm.parse_args(["--task", "reasoning"]).out == ".cache/models/reasoning-base"


def test_attention_concentration_of_a_uniform_head():
    import torch

    from bench.attention import concentration

    t = 8
    causal = torch.tril(torch.ones(t, t))
    attn = [(causal / causal.sum(-1, keepdim=True)).unsqueeze(0)]       # 1 layer, 1 head
    m = concentration(attn, 3, share=0.25, budget=2, far=2, prompt_len=3, sinks=1)
    top_share, top_budget, far = m["top_share"], m["top_budget"], m["far_mass"]
    seen = torch.arange(3, t) + 1
    assert torch.allclose(top_share[0, 0], torch.ceil(0.25 * seen) / seen)
    assert torch.allclose(top_budget[0, 0], 2 / seen)
    assert torch.allclose(far[0, 0], (seen - 3).clamp(min=0) / seen)   # keys more than 2 back
    one_hot = torch.zeros(1, t, t)
    one_hot[0, :, 0] = 1.0                                               # all mass on the sink
    assert torch.allclose(concentration([one_hot], 3, 0.25, 2, 2)["top_share"], torch.ones(1, 1, t - 3))
    assert torch.allclose(m["sink_mass"][0, 0], 1 / seen) and torch.allclose(m["prompt_mass"][0, 0], 3 / seen)


def test_drill_is_the_tasks_arithmetic_with_loss_on_results_only():
    import random

    from launch.make_base_model import encode_drill
    from tasks.tokenizer import build_char_tokenizer

    t = ReasoningTask(n_train=1, n_heldout=1, facts=4)
    pairs = t.drill(random.Random(0), lines=200)
    for question, answer in pairs:
        x, op, y = int(question[:-3]), question[-3], int(question[-2])
        assert question[-1] == "=" and 0 <= x <= 27 and 1 <= y <= 9
        assert int(answer) == apply(op, x, y) >= 0
    assert {q[-3] for q, _ in pairs} == {"+", "-"}
    tok = build_char_tokenizer()
    ids, labels = encode_drill(tok, pairs[:2])
    assert tok.decode(ids) == "".join(f"{q}{a}.\n" for q, a in pairs[:2])
    assert tok.decode([i for i in labels if i != -100]) == pairs[0][1] + pairs[1][1]
