"""launch/report.py on a small recorded run (tests/data/report_run: a 2-step Sparse-RL run of the
tiny model, R-KV budget 16, recorded by `bench/compare.py --quick`)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from launch.report import PANELS, load_run, markdown, render, series

REPO = Path(__file__).resolve().parent.parent
RECORDED = REPO / "tests" / "data" / "report_run"


def test_recorded_run_has_the_plotted_metrics():
    run = load_run(RECORDED)
    drawn = [key for _, keys in PANELS for key, _ in keys if series(run["records"], key)[0]]
    assert len(drawn) == sum(len(keys) for _, keys in PANELS)  # every panel has data here


def test_render_two_runs_side_by_side(tmp_path):
    other = tmp_path / "other"
    shutil.copytree(RECORDED, other)
    paths = render([RECORDED, other], tmp_path / "out", labels=["a", "b"])
    png = Image.open(paths["png"])
    assert png.size[0] > 800 and png.size[1] > 600
    titles = json.loads(png.info["Description"])["panels"]
    assert titles == [t for t, _ in PANELS]
    assert "held-out accuracy" in titles and "mismatch k3" in titles
    assert any("vetoed" in t for t in titles) and any("buffer depth" in t for t in titles)
    sidecar = json.loads(paths["json"].read_text())
    assert [p["title"] for p in sidecar["panels"]] == titles
    assert [r["label"] for r in sidecar["runs"]] == ["a", "b"]
    md = paths["md"].read_text()
    rows = [x for x in md.splitlines() if x.startswith("| a ") or x.startswith("| b ")]
    assert len(rows) == 2 and rows[0].split("|")[2:] == rows[1].split("|")[2:]


def test_markdown_values_come_from_the_metrics():
    run = load_run(RECORDED)
    train = [r for r in run["records"] if "reward" in r]
    row = markdown([run]).splitlines()[2].split("|")
    summ = run["summary"]
    assert row[2].strip() == str(len(train))
    assert row[3].strip() == f"{summ['accuracy_before']:.3g} -> {summ['accuracy_after']:.3g}"
    p5 = sum(r["mismatch/agreement_p5"] for r in train) / len(train)
    assert row[5].strip() == f"{p5:.3g}"


def test_cli_writes_files_and_refuses_a_non_run(tmp_path):
    run = tmp_path / "r"
    shutil.copytree(RECORDED, run)
    proc = subprocess.run([sys.executable, "launch/report.py", str(run)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (run / "report.png").is_file() and (run / "report.md").is_file()
    bad = subprocess.run([sys.executable, "launch/report.py", str(tmp_path / "nope")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no metrics.jsonl" in bad.stderr


def test_labels_must_match_runs(tmp_path):
    with pytest.raises(ValueError, match="2 labels for 1 runs"):
        render([RECORDED], tmp_path, labels=["a", "b"])
