"""The training config a KubeRay deployment runs, loaded on this machine: the preset with the
deployment's overrides (``load_training``), or exactly what a RayJob's arguments and overlay give
(``deployed_config``). ``render`` (the overlay, the plan check) and ``validate`` (the job's checks)
both read it, so neither imports the other for it. It is the one place cluster/ reads launch/
(``launch.config.load_config``: the composed training config; tests/test_imports.py KNOWN_UPWARD).
"""
from __future__ import annotations

from pathlib import Path, PurePosixPath

from cluster.kuberay.options import REPO, DeployConfig

CONFIG_MOUNT, CONFIG_KEY = "/etc/sparse-rl", "deploy.yaml"  # the overlay ConfigMap in the head pod


def deployed_config(dc: DeployConfig, args: list[str], overlay_yaml: str):
    """The training config a RayJob with arguments ``args`` runs, loaded here: the image's preset
    and the ConfigMap's overlay (``overlay_yaml``) mapped to this checkout and a temporary file,
    without resume= (no checkpoint lives on this machine)."""
    import tempfile

    from launch.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / CONFIG_KEY
        local.write_text(overlay_yaml)
        swap = {str(PurePosixPath(dc.workdir) / dc.preset): str(REPO / dc.preset),
                str(PurePosixPath(CONFIG_MOUNT) / CONFIG_KEY): str(local)}
        return load_config([swap.get(a, a) for a in args if not a.startswith("resume=")])


def load_training(dc: DeployConfig, extra: list[str]):
    """The deployment's preset with its overrides (and ``extra``), as this checkout has it."""
    from launch.config import load_config

    return load_config(["--config", str(REPO / dc.preset), *dc.overrides, *extra])
