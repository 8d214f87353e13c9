"""Fuzzing the two places user input enters: config overrides (``load_config`` with arbitrary
``key=value`` strings) and dataset files (arbitrary bytes as a .jsonl). Every input ends in a result
or a ConfigError / DataError, never another exception. Example counts stay small for CI."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.errors import ConfigError, DataError
from launch.config import load_config
from tasks import TaskConfig, make_task
from test_config_keys_used import walk

KEYS = [k.replace(".*.", ".0.") for k in walk()]
VALUES = st.one_of(st.text(max_size=12), st.integers(-10**6, 10**6).map(str),
                   st.floats(allow_nan=True).map(str),
                   st.sampled_from(["true", "null", "[]", "{}", "[1, 2]", "{a: 1}", "''", "-1",
                                    "0", "1e309", "nan", "${oops}", "[", "auto", "rkv", "bfloat16"]))
ITEMS = st.one_of(
    st.tuples(st.sampled_from(KEYS), VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.text(max_size=30),                                   # anything at all
    st.tuples(st.text(max_size=10), VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"))
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.lists(ITEMS, max_size=3))
def test_config_overrides_end_in_a_config_or_a_config_error(items):
    try:
        cfg = load_config(items)
    except ConfigError:
        return
    assert cfg.run.steps >= 0


ROW = st.fixed_dictionaries({}, optional={
    "prompt": st.one_of(st.text(max_size=8), st.integers(), st.none(), st.lists(st.integers())),
    "label": st.one_of(st.text(max_size=8), st.floats(), st.booleans())}).map(json.dumps)
LINE = st.one_of(ROW.map(str.encode), st.binary(max_size=40),
                 st.sampled_from([b"", b"[1]", b'{"prompt": "a", "label": "1"}', b"\xff\xfe",
                                  b'{"prompt": "a", "label": "#### 4"}', b"[" * 5000,
                                  b'{"prompt": "a", "label": 1' + b"1" * 5000 + b"}"]))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LINE, max_size=6), st.sampled_from(["plain", "gsm8k"]), st.booleans())
def test_dataset_bytes_end_in_problems_or_a_data_error(lines, answer_format, skip):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzz.jsonl"
        path.write_bytes(b"\n".join(lines))
        task = make_task(TaskConfig(name="dataset", path=str(path), n_heldout=1,
                                    answer_format=answer_format, skip_malformed=skip))
        try:
            train, held = task.problems("train"), task.problems("heldout")
        except DataError as e:
            assert str(path) in str(e)
            return
        assert all(isinstance(p.prompt, str) and p.answer for p in train + held)


def test_overrides_fuzzing_found():
    """Overrides that once ended in yaml.ReaderError / TypeError / IndexError tracebacks."""
    import pytest

    with pytest.raises(ConfigError, match=r"'run.name': got '\\x1f'; allowed: a YAML value"):
        load_config(["run.name=\x1f"])
    with pytest.raises(ConfigError, match=r"'task.eval_sets.0.name'.*command line"):
        load_config(["task.eval_sets.0.name="])
    with pytest.raises(ConfigError, match=r"'\[': got '1'; allowed: a dotted key"):
        load_config(["[=1"])
