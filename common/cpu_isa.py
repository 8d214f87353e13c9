"""One CPU instruction set for every kernel, so a seed gives the same weights on AVX2 and AVX-512 CPUs.

torch picks its vectorised CPU kernels (ATen's softmax, reductions, elementwise ops) by the CPU it
runs on: AVX-512 where the CPU has it, else AVX2. The two round differently, so the same command
and seed built one base model on an AVX2 machine and another on an AVX-512 one, and every figure
measured on a base held only on the machine that built it (docs/RESULTS.md, "Why the rebuild
differs"). Capping ATen (``ATEN_CPU_CAPABILITY``), MKL (``MKL_CBWR``, its conditional numerical
reproducibility switch) and oneDNN (``ONEDNN_MAX_CPU_ISA``) at AVX2 made an AVX-512 machine rebuild
an AVX2-only machine's base bit for bit (two AMD EPYCs; docs/RESULTS.md, "One instruction set for
every machine"); an Intel CPU, whose MKL path differs, has not been checked.

The scripts whose figures are compared across machines (base builds, training, the comparison and
the held-out decodes) call ``pin_cpu_isa`` first thing when run as scripts; Ray actors get the same
variables through ``cluster.ray_setup.worker_env``. Speed benchmarks do not pin (they measure the
machine). A value already in the environment wins (``ATEN_CPU_CAPABILITY=avx512`` trades the
reproducibility for speed); a CPU without AVX2 is left as it is. Imports torch only to check.
"""
from __future__ import annotations

import os

# AVX2 because every x86-64 server CPU of the last decade has it: the lowest common level.
PIN = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def pinned_env() -> dict[str, str]:
    """The pinning variables in this process's environment, set by ``pin_cpu_isa`` or by the
    user, for the actors it starts (``cluster.ray_setup.worker_env``)."""
    return {k: os.environ[k] for k in PIN if k in os.environ}


def has_avx2() -> bool:
    """Whether this CPU can run the pinned kernels (where it cannot, ``pin_cpu_isa`` leaves the
    process as it is); reads the CPU's flags, so it does not fix torch's capability."""
    import torch

    return torch.cpu._is_avx2_supported()


def cpu_capability() -> str:
    """The kernel set torch runs in this process (``AVX2``, ``AVX512``, ``DEFAULT``, ...), as
    recorded beside a build or a comparison; calling it fixes the capability like any operation."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def pin_cpu_isa() -> str:
    """Cap this process's CPU kernels at AVX2 (unless the environment already says otherwise);
    returns the capability torch uses. Must run before torch's first operation, which fixes the
    capability for the life of the process: a later call raises instead of pinning nothing."""
    if not has_avx2():
        return cpu_capability()
    for key, value in PIN.items():
        os.environ.setdefault(key, value)
    asked = os.environ["ATEN_CPU_CAPABILITY"].upper()
    got = cpu_capability()
    if got != asked:
        raise RuntimeError(f"ATEN_CPU_CAPABILITY={asked.lower()} did not take: torch runs {got} "
                           "kernels (a value torch does not know, or pin_cpu_isa ran after "
                           "torch's first operation, which fixes the capability)")
    return got
