"""Dataset loader and math verifier, on the real files in ../shared/data and on broken ones."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import ConfigError, DataError
from tasks import TaskConfig, make_task
from tasks.verify import gsm8k_answer, math_reward

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _real(name: str) -> Path:
    path = DATA / name
    if not path.is_file():
        pytest.skip(f"real dataset {path} is absent (the shared data folder is not mounted here)")
    return path


def _cfg(path, **kw) -> TaskConfig:
    return TaskConfig(name="dataset", path=str(path), **kw)


def test_real_math_train_has_empty_labels():
    # The shipped MATH train file has two rows with an empty label (lines 5055 and 5159).
    with pytest.raises(DataError, match=r"math_level3to5_train\.jsonl:5055: field 'label' is empty"):
        make_task(_cfg(_real("math_level3to5_train.jsonl"))).problems("train")


def test_math_train_prompt_label():
    t = make_task(_cfg(_real("math_level3to5_train.jsonl"), n_heldout=50, skip_malformed=True,
                       n_train=0))
    train, held = t.problems("train"), t.problems("heldout")
    assert t.n_skipped == 2 and ":5159:" in t.skipped[1]
    assert len(held) == 50 and len(train) == 8523 - 2 - 50
    assert not {p.prompt for p in held} & {p.prompt for p in train}
    p = train[0]
    assert "<|im_start|>" in p.prompt and p.answer
    assert t.reward(f"... so the answer is \\boxed{{{p.answer}}}", p.answer) == 1.0
    assert t.reward("I give up", p.answer) == 0.0


def test_gsm8k_question_answer_hashes():
    cfg = _cfg(_real("gsm8k_test.jsonl"), prompt_field="question", answer_field="answer",
               answer_format="gsm8k", n_heldout=10, n_train=100,
               prompt_template="Question: {prompt}\nAnswer:")
    t = make_task(cfg)
    assert len(t.problems("train")) == 100
    by_prompt = {p.prompt: p for p in t.problems("train") + t.problems("heldout")}
    janet = next(p for s, p in by_prompt.items() if "Janet" in s and "ducks" in s)
    assert janet.answer == "18" and janet.prompt.startswith("Question: Janet")
    assert t.reward("She makes 9 * 2 = 18 dollars. #### 18", "18") == 1.0


def test_math500_problem_answer():
    t500 = make_task(_cfg(_real("math500_test.jsonl"), prompt_field="problem", answer_field="answer",
                          n_heldout=500, n_train=0))
    held = t500.problems("heldout")
    assert len(held) == 500 and t500.problems("train") == []
    first = next(p for p in held if p.prompt.startswith("Convert the point $(0,3)$"))
    assert first.answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert t500.reward("\\boxed{(3, \\frac{\\pi}{2})}", first.answer) == 1.0


@pytest.mark.parametrize("response,answer,expected", [
    ("\\boxed{118}", "118", 1.0),
    ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1000}", "1,000", 1.0),
    ("the answer is 72", "72", 1.0),
    ("\\boxed{4}", "3", 0.0),
    ("", "3", 0.0),
    ("no numbers here", "3", 0.0),
])
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_gsm8k_answer_extraction():
    assert gsm8k_answer("blah\n#### 1,234") == "1234"
    assert gsm8k_answer("#### -5 ") == "-5"
    assert gsm8k_answer("no final answer") is None


def _write_broken(tmp_path) -> Path:
    rows = [json.dumps({"prompt": "1+1?", "label": "2"}),
            "{not json",
            json.dumps({"prompt": "2+2?"}),
            json.dumps(["a", "list"]),
            "",
            json.dumps({"prompt": "", "label": "3"}),
            json.dumps({"prompt": "3+3?", "label": 6})]
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_malformed_row_names_file_and_line(tmp_path):
    path = _write_broken(tmp_path)
    with pytest.raises(DataError, match=r"broken\.jsonl:2: invalid JSON") as e:
        make_task(_cfg(path, n_heldout=0)).problems("train")
    assert e.value.line == 2


@pytest.mark.parametrize("bad_line,match", [(3, "missing field 'label'"), (4, "row is a list"),
                                            (6, "field 'prompt' is empty")])
def test_each_malformed_kind(tmp_path, bad_line, match):
    lines = _write_broken(tmp_path).read_text().splitlines()
    path = tmp_path / "one.jsonl"
    path.write_text(lines[0] + "\n" + lines[bad_line - 1] + "\n")
    with pytest.raises(DataError, match=rf"one\.jsonl:2: {match}"):
        make_task(_cfg(path, n_heldout=0)).problems("train")


def test_skip_malformed_counts(tmp_path):
    t = make_task(_cfg(_write_broken(tmp_path), n_heldout=0, skip_malformed=True))
    train = t.problems("train")
    assert [(p.prompt, p.answer) for p in train] == [("1+1?", "2"), ("3+3?", "6")]
    assert t.n_skipped == 4 and ":2:" in t.skipped[0]


def test_gsm8k_without_hashes_is_malformed(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "no hashes"}) + "\n")
    cfg = _cfg(path, prompt_field="question", answer_field="answer", answer_format="gsm8k",
               n_heldout=0)
    with pytest.raises(DataError, match="g.jsonl:1: .*####"):
        make_task(cfg).problems("train")


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"problem": ["1+1", "2+2", None], "answer": ["2", "4", "x"]}), path)
    cfg = _cfg(path, prompt_field="problem", answer_field="answer", n_heldout=1)
    with pytest.raises(DataError, match=r"d\.parquet:3: field 'problem' is NoneType"):
        make_task(cfg).problems("train")
    cfg.skip_malformed = True
    t = make_task(cfg)
    assert len(t.problems("train")) == 1 and len(t.problems("heldout")) == 1 and t.n_skipped == 1


def test_missing_file_and_missing_path(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        make_task(_cfg(tmp_path / "nope.jsonl")).problems("train")
    with pytest.raises(ConfigError, match="task.path"):
        make_task(TaskConfig(name="dataset"))
    with pytest.raises(DataError, match="suffix"):
        (tmp_path / "x.csv").write_text("a")
        make_task(_cfg(tmp_path / "x.csv")).problems("train")


def test_separate_heldout_file(tmp_path):
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"t{i}", "label": str(i)}) + "\n" for i in range(5)))
    held.write_text("".join(json.dumps({"prompt": f"h{i}", "label": str(i)}) + "\n" for i in range(4)))
    t = make_task(_cfg(train, heldout_path=str(held), n_heldout=3, n_train=0))
    assert [p.prompt for p in t.problems("train")] == [f"t{i}" for i in range(5)]
    assert [p.prompt for p in t.problems("heldout")] == ["h0", "h1", "h2"]


def test_eval_sets_read_their_own_fields_format_and_template(tmp_path):
    """task.eval_sets: extra held-out files (MATH-500, GSM8K) with their own fields, answer format
    and prompt template, counted by the prompt-length rule like the task's own splits."""
    import json

    from common.errors import ConfigError
    from launch.preflight import task_prompts
    from tasks.config import EvalSetConfig

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"q{i}\n", "label": str(i)}) + "\n"
                             for i in range(6)))
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "two plus two", "answer": "2+2=4\n#### 4"}) + "\n" +
                   json.dumps({"question": "x" * 50, "answer": "#### 7"}) + "\n")
    es = EvalSetConfig(name="gsm8k", path=str(gsm), prompt_field="question", answer_field="answer",
                       answer_format="gsm8k", prompt_template="Q: {prompt} A:")
    task = make_task(TaskConfig(name="dataset", path=str(train), n_heldout=2, eval_sets=[es]))
    assert task.problems("train")[0].prompt.endswith("\n")   # prompts keep their whitespace
    got = task.eval_set("gsm8k")
    assert [(p.prompt[:17], p.answer) for p in got] == [("Q: two plus two A", "4"), ("Q: " + "x" * 14, "7")]

    class Encoder:   # the length rule: prompts over 20 characters are dropped and counted
        max_tokens, overlong = 20, "drop"

        def fit(self, problems, split):
            keep = [p for p in problems if len(p.prompt) <= 20]
            return keep, len(problems) - len(keep)

    _, evals, counts = task_prompts(task, Encoder(), 0, [es])
    assert set(evals) == {"heldout", "gsm8k"} and len(evals["gsm8k"]) == 1
    assert counts["prompts/overlong_gsm8k"] == 1
    for bad, key in (({"eval_sets": [es]}, "task.eval_sets"),):   # synthetic tasks: no eval sets
        with pytest.raises(ConfigError) as e:
            make_task(TaskConfig(**bad))
        assert e.value.key == key
    with pytest.raises(ConfigError) as e:
        make_task(TaskConfig(name="dataset", path=str(train), eval_sets=[es, es]))
    assert e.value.key == "task.eval_sets"
    with pytest.raises(ConfigError) as e:
        make_task(TaskConfig(name="dataset", path=str(train),
                             eval_sets=[EvalSetConfig(name="m", path="p", prompt_template="x")]))
    assert e.value.key == "task.eval_sets.0.prompt_template"


def test_invalid_utf8_names_file_and_line_and_is_skippable(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "1+1", "label": "2"}).encode()
    path.write_bytes(good + b"\n" + b'{"prompt": "caf\xe9", "label": "3"}\n' + good + b"\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid UTF-8 \(byte 0xe9 at byte column 16"):
        make_task(_cfg(path, n_heldout=0)).problems("train")
    task = make_task(_cfg(path, n_heldout=0, skip_malformed=True))
    assert len(task.problems("train")) == 2 and task.n_skipped == 1
    assert "bad.jsonl:2: invalid UTF-8" in task.skipped[0]


@pytest.mark.parametrize("newline", ["\n", "\r\n", ""])
def test_malformed_json_column_is_within_the_line(tmp_path, newline):
    path = tmp_path / "cut.jsonl"
    line = '{"prompt": "1+1", "label": "2"'   # 30 characters, the closing brace missing
    path.write_text(json.dumps({"prompt": "a", "label": "b"}) + "\n" + line + newline)
    with pytest.raises(DataError, match=r"cut\.jsonl:2: invalid JSON \(Expecting ',' delimiter "
                                        r"at column 31\)"):
        make_task(_cfg(path, n_heldout=0)).problems("train")
