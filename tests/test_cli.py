"""launch/cli.py: how `python launch/train.py` ends, per outcome (the end-to-end runs in
test_bad_input_e2e, test_faults_e2e and test_resume see the same codes from a real run)."""
from __future__ import annotations

import pytest

from common.errors import ConfigError, DataError, TrainingFault
from launch.cli import exit_code
from launch.recovery import BufferLost


def raising(err):
    def main(argv):
        raise err
    return main


@pytest.mark.parametrize("err, code", [
    (ConfigError("rollout.kv.budget", -1, "an integer >= 1"), 2),
    (DataError("data/x.jsonl", "not JSON", line=3), 2),
    (TrainingFault("3 poisoned batches in a row"), 3),
    (BufferLost("buffer lost; resume=runs/x"), 1),
])
def test_each_failure_is_one_error_line_and_its_code(err, code, capsys):
    assert exit_code(raising(err), [], None) == code
    out = capsys.readouterr()
    assert out.err == f"error: {err}\n" and out.out == ""


def test_a_finished_run_exits_0_and_a_stopped_one_143():
    assert exit_code(lambda argv: {"steps": 2}, ["run.steps=2"], None) == 0
    assert exit_code(lambda argv: {"stopped": "SIGTERM", "step": 1}, [], None) == 143


def test_help_runs_nothing(capsys):
    assert exit_code(raising(AssertionError("main must not run")), ["--help"], "usage: x") == 0
    assert capsys.readouterr().out.startswith("usage: x")


def test_an_unexpected_error_is_not_swallowed():
    with pytest.raises(KeyError):
        exit_code(raising(KeyError("bug")), [], None)
