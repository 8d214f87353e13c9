"""common/tokens.py: pad rule, eos ids, chat templates, prompt lengths; their config keys and the
start-up checks of launch/preflight.py."""
from __future__ import annotations

import logging

import pytest

from actors.config import RolloutConfig
from common import tokens
from common.errors import ConfigError
from common.modeling import load_tokenizer
from common.testmodels import EOT_ID, build_model
from tasks.base import Problem


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {f: build_model(root / f, f, num_hidden_layers=1) for f in ("tiny", "llama3")}


@pytest.fixture(scope="module")
def toks(dirs):
    return {f: load_tokenizer(d) for f, d in dirs.items()}


def test_pad_rule_uses_pad_else_eos_and_says_so_once(toks, caplog, monkeypatch):
    assert tokens.pad_token_id(toks["tiny"]) == 0 == toks["tiny"].pad_token_id
    assert toks["llama3"].pad_token_id is None
    monkeypatch.setattr(tokens, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="common.tokens"):
        assert tokens.pad_token_id(toks["llama3"]) == 2 == toks["llama3"].eos_token_id
        assert tokens.pad_token_id(toks["llama3"]) == 2
    assert [r.getMessage() for r in caplog.records] == ["no pad token: using eos id 2"]


def test_pad_rule_refuses_a_tokenizer_without_pad_or_eos():
    class Bare:
        pad_token_id = eos_token_id = None

    with pytest.raises(ValueError, match="neither a pad nor an eos"):
        tokens.pad_token_id(Bare())


def test_eos_ids_unite_tokenizer_and_generation_config(dirs, toks):
    assert tokens.eos_token_ids(toks["llama3"], dirs["llama3"]) == (2, EOT_ID)
    assert tokens.eos_token_ids(toks["tiny"], dirs["tiny"]) == (2,)
    assert tokens.eos_token_ids(toks["tiny"]) == (2,)

    class Gen:
        eos_token_id = [7, 2, 9]

    assert tokens.eos_token_ids(toks["tiny"], Gen()) == (2, 7, 9)


def test_chat_template_settings(dirs, toks, tmp_path):
    plain = tokens.PromptEncoder(toks["llama3"], None, 100, "error")
    assert plain.ids("sum a1") == toks["llama3"]("sum a1")["input_ids"]
    own = tokens.chat_template("tokenizer", toks["llama3"])
    chat = tokens.PromptEncoder(toks["llama3"], own, 100, "error").ids("sum a1")
    assert toks["llama3"].decode(chat) == "<bos><|user|>\nsum a1<eot><|assistant|>\n"
    assert chat[0] == 1 and EOT_ID in chat
    path = tmp_path / "t.jinja"
    path.write_text("Q: {{ messages[0]['content'] }}\nA:")
    ids = tokens.PromptEncoder(toks["tiny"], tokens.chat_template(str(path), toks["tiny"]), 100,
                               "error").ids("2+2")
    assert toks["tiny"].decode(ids) == "Q: 2+2\nA:"
    assert tokens.chat_template("none", toks["tiny"]) is None
    with pytest.raises(ConfigError, match="rollout.chat_template.*no chat template"):
        tokens.chat_template("tokenizer", toks["tiny"])          # the tiny family ships none
    with pytest.raises(ConfigError, match="rollout.chat_template.*nope.jinja"):
        tokens.chat_template(str(tmp_path / "nope.jinja"), toks["tiny"])


def test_prompt_budget_and_the_max_position_error():
    assert tokens.prompt_budget(0, 24, 512) == 488
    assert tokens.prompt_budget(100, 24, 512) == 100
    with pytest.raises(ConfigError) as err:
        tokens.prompt_budget(500, 24, 512)
    msg = str(err.value)
    assert "rollout.max_prompt_tokens" in msg and "rollout.max_new_tokens" in msg and "512" in msg
    with pytest.raises(ConfigError, match="rollout.max_new_tokens.*512"):
        tokens.prompt_budget(0, 512, 512)


def test_overlong_prompts_dropped_truncated_or_refused(toks):
    tok = toks["tiny"]
    probs = [Problem(0, "abc", "x"), Problem(1, "abcdefgh", "y"), Problem(2, "abcd", "z")]
    drop = tokens.PromptEncoder(tok, None, 4, "drop")
    kept, n = drop.fit(probs)
    assert n == 1 and [p.idx for p in kept] == [0, 2]
    with pytest.raises(ValueError, match="rollout.max_prompt_tokens"):
        drop.encode("abcdefgh")
    trunc = tokens.PromptEncoder(tok, None, 4, "truncate_left")
    kept, n = trunc.fit(probs)
    assert n == 1 and kept == probs
    assert trunc.encode("abcdefgh") == tok("efgh")["input_ids"]     # the end of the prompt stays
    assert trunc.encode("ab") == tok("ab")["input_ids"]
    with pytest.raises(ConfigError, match="rollout.overlong_prompt.*1 of 3 train.*problem 1"):
        tokens.PromptEncoder(tok, None, 4, "error").fit(probs)


@pytest.mark.parametrize("key,value,match", [
    ("overlong_prompt", "cut", "rollout.overlong_prompt"),
    ("max_prompt_tokens", -1, "rollout.max_prompt_tokens"),
    ("chat_template", "", "rollout.chat_template"),
])
def test_new_rollout_keys_are_validated(key, value, match):
    with pytest.raises(ConfigError, match=match):
        RolloutConfig(**{key: value}).validate("rollout")


def test_preflight_checks_the_model_and_counts_prompts(dirs):
    from launch.config import load_config
    from launch.preflight import check_model, task_prompts

    def cfg(*kv):
        return load_config([f"rollout.model_path={dirs['llama3']}", *kv])

    tok, enc = check_model(cfg("rollout.max_new_tokens=24", "rollout.chat_template=tokenizer"))
    assert enc.max_tokens == 512 - 24 and enc.template and tok.pad_token_id is None
    with pytest.raises(ConfigError, match="rollout.max_prompt_tokens.*max_new_tokens.*512"):
        check_model(cfg("rollout.max_new_tokens=24", "rollout.max_prompt_tokens=500"))
    with pytest.raises(ConfigError, match="rollout.max_new_tokens.*512"):
        check_model(cfg("rollout.max_new_tokens=600"))
    with pytest.raises(ConfigError, match="rollout.chat_template"):
        check_model(load_config([f"rollout.model_path={dirs['tiny']}",
                                 "rollout.chat_template=tokenizer"]))

    class Task:
        def problems(self, split):
            return [Problem(i, "x" * (3 + 4 * i), "") for i in range(4)]

    train, held, counts = task_prompts(Task(), tokens.PromptEncoder(tok, None, 10, "drop"), 1)
    assert [p.idx for p in train] == [0, 1] and [p.idx for p in held["heldout"]] == [0]
    assert counts == {"prompts/overlong_train": 2, "prompts/overlong_heldout": 2}
    with pytest.raises(ConfigError, match="rollout.max_prompt_tokens"):
        task_prompts(Task(), tokens.PromptEncoder(tok, None, 2, "drop"), 0)
