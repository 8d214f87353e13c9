"""Process settings vLLM reads at import time: cache directories and in-process mode.

vLLM writes to ``~/.cache/vllm``, an inductor cache and RPC sockets in the system temp folder by
default; ``setup_env`` points them inside the project's ignored cache (``.cache/vllm`` at the repo
root, or ``$SPARSE_RL_VLLM_CACHE``). Variables already set by the caller are kept. It must run before
``import vllm`` (``TMPDIR`` only takes effect if Python has not computed its temp dir yet).
"""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def cache_root() -> Path:
    return Path(os.environ.get("SPARSE_RL_VLLM_CACHE", REPO_ROOT / ".cache" / "vllm"))


def setup_env() -> Path:
    """Set vLLM's environment (idempotent) and return the cache root."""
    root = cache_root()
    (root / "tmp").mkdir(parents=True, exist_ok=True)
    defaults = {
        "VLLM_CACHE_ROOT": str(root),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TMPDIR": str(root / "tmp"),
        # One engine per process, no engine-core subprocess: weights can be handed to the model
        # runner by reference (reload_weights with an iterator) and startup takes ~3 s, not ~17 s.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # No CPU pinning: the engine shares a few cores with the learner and other actors; the
        # thread count is set by VLLMEngine(threads=...) before the engine starts.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise RuntimeError("actors.vllm needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (in-process engine "
                           "core): weight reloads pass tensors to the model runner by reference")
    return root


def vllm_version() -> str | None:
    """The installed vLLM version, or None when vLLM is not installed (checked without importing)."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None
