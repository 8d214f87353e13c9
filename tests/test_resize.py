"""Resizing a running job's pools (``python -m launch.resize``): the request file, its checks, and
the driver side that applies it (with Ray: tests/test_elastic.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launch.resize import REQUEST, apply_requested, main, parse_request, request

from conftest import REPO


def test_parse_request_names_the_bad_entry():
    assert parse_request({"rollout": 8, "scorer": 2}) == {"rollout": 8, "scorer": 2}
    for bad, match in (({"learner": 2}, "unknown pool 'learner'"), ({"rollout": 0}, "rollout=0"),
                       ({"rollout": 2.5}, "rollout=2.5"), ({"rollout": True}, "rollout=True"),
                       ({}, "an object like"), ([4], "an object like")):
        with pytest.raises(ValueError, match=match):
            parse_request(bad)


def test_cli_writes_the_request_atomically_and_refuses_bad_input(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    assert main([str(run), "rollout=4"]) == 2  # not a run folder
    assert "no config.yaml" in capsys.readouterr().err
    (run / "config.yaml").write_text("{}")
    for args in (["rollout=-1"], ["rollout"], ["learner=2"], ["scorer=0"]):
        assert main([str(run), *args]) == 2
        assert "error:" in capsys.readouterr().err and not (run / REQUEST).exists()
    assert main([str(run), "rollout=4", "scorer=2"]) == 0
    assert json.loads((run / REQUEST).read_text()) == {"rollout": 4, "scorer": 2}
    assert [p.name for p in run.iterdir() if p.name.startswith(".")] == []  # no tmp file left
    out = subprocess.run([sys.executable, "-m", "launch.resize", "--help"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0 and "rollout=8" in out.stdout


def test_a_bad_request_is_set_aside_and_the_run_goes_on(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("{}")
    (tmp_path / REQUEST).write_text('{"rollout": "many"}')
    in_flight = [["a batch"]]
    assert apply_requested(tmp_path, in_flight, pools=None, cfg=None, version=3) == {}
    assert not (tmp_path / REQUEST).exists() and (tmp_path / (REQUEST + ".rejected")).is_file()
    assert "rejected: rollout='many'" in capsys.readouterr().out
    assert in_flight == [["a batch"]]  # nothing landed, nothing resized
    assert apply_requested(tmp_path, in_flight, None, None, 3) == {}  # no request: nothing to do
    request(tmp_path, {"rollout": 2})
    assert json.loads((tmp_path / REQUEST).read_text()) == {"rollout": 2}
