"""One CPU instruction set for every kernel (common/cpu_isa.py): the pin takes, a value already in
the environment wins, a pin after torch's first operation is refused, actors inherit it, and every
script whose figures are compared across machines pins before it does anything."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.cpu_isa import PIN, has_avx2

REPO = Path(__file__).resolve().parent.parent
needs_avx2 = pytest.mark.skipif(not has_avx2(), reason="a CPU without AVX2")
# The scripts that pin when run (speed benchmarks measure the machine and do not).
PINNED_SCRIPTS = ["launch/make_base_model.py", "launch/train.py", "bench/compare.py",
                  "bench/heldout.py", "bench/attention.py", "bench/lookups.py",
                  "bench/schedule.py", "bench/distill.py", "bench/mismatch.py"]


def _python(code: str, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in PIN}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={**clean, "PYTHONPATH": str(REPO), **env})


@needs_avx2
def test_pin_takes_and_a_value_in_the_environment_wins():
    pin = "from common.cpu_isa import pin_cpu_isa; import os; print(pin_cpu_isa(), os.environ['MKL_CBWR'])"
    assert _python(pin).stdout.split() == ["AVX2", "AVX2"]
    assert _python(pin, ATEN_CPU_CAPABILITY="default").stdout.split() == ["DEFAULT", "AVX2"]


@needs_avx2
def test_pin_after_the_first_operation_is_refused():
    late = "import torch; torch.randn(64).softmax(0); from common.cpu_isa import pin_cpu_isa; pin_cpu_isa()"
    proc = _python(late)
    assert proc.returncode != 0 and "ATEN_CPU_CAPABILITY=avx2 did not take" in proc.stderr


def test_actors_inherit_the_pin(monkeypatch):
    from cluster.ray_setup import worker_env

    for key in PIN:
        monkeypatch.delenv(key, raising=False)
    assert not set(PIN) & set(worker_env())
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert worker_env()["ATEN_CPU_CAPABILITY"] == "avx2"


@needs_avx2
@pytest.mark.parametrize("script", PINNED_SCRIPTS)
def test_scripts_pin_before_anything_else(script):
    # A value torch does not know makes the pin refuse: a script that pins stops there, before
    # its argument parser; one that did not pin would print its --help.
    proc = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "ATEN_CPU_CAPABILITY": "nonsense"})
    assert proc.returncode != 0 and "ATEN_CPU_CAPABILITY=nonsense did not take" in proc.stderr


@needs_avx2
def test_a_script_built_model_records_the_pinned_kernels(tiny_model):
    import json

    assert json.loads((tiny_model / "sft_metrics.json").read_text())["cpu_capability"] == "AVX2"
