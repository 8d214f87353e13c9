"""docker/Dockerfile.cpu and docker/Dockerfile.gpu, read as text (no Docker daemon here): pinned
base images, the right lock file, every package of the project, a non-root user, no secrets."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
IMAGES = {"Dockerfile.cpu": "requirements.lock", "Dockerfile.gpu": "requirements-gpu.lock"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        word, _, args = buf.strip().partition(" ")
        out.append((word.upper(), args.strip()))
        buf = ""
    assert not buf, f"{path}: a continuation line at the end"
    return out


@pytest.mark.parametrize("name", list(IMAGES))
def test_dockerfile_installs_its_lock_and_the_project(name):
    ins = instructions(REPO / "docker" / name)
    froms = [a for w, a in ins if w == "FROM"]
    assert froms and all(re.fullmatch(r"[\w./-]+:[\w.-]*\d[\w.-]*(@sha256:[0-9a-f]{64})?", f)
                         and not f.endswith(":latest") for f in froms), froms
    copies = [a.split() for w, a in ins if w == "COPY"]
    sources = {s for c in copies for s in c[:-1] if not s.startswith("--")}
    for src in sources:
        assert (REPO / src).exists(), f"{name} copies {src}, which is not in the repository"
    lock = IMAGES[name]
    other = ({"requirements.lock", "requirements-gpu.lock"} - {lock}).pop()
    runs = " ".join(a for w, a in ins if w == "RUN")
    assert f"-r {lock}" in runs and lock in sources and other not in sources and other not in runs
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["include"]
    for pkg in packages:
        assert pkg.rstrip("*") in sources, f"{name} does not copy the {pkg} package"
    assert "pip install --no-cache-dir --no-deps -e ." in runs
    users = [a for w, a in ins if w == "USER"]
    assert users and users[-1] not in ("root", "0")
    env = " ".join(a for w, a in ins if w in ("ENV", "ARG"))
    assert not re.search(r"(?i)(token|secret|password|api_key)\s*=", env)
    assert "RAY_AUTH_MODE=disabled" in env  # what ray_setup.worker_env passes on, not a secret


def test_dockerignore_keeps_build_outputs_and_caches_out():
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".venv", ".cache", "runs", ".git"} <= ignored
