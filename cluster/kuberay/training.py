"""The training config a KubeRay deployment runs, loaded on this machine: the preset with the
deployment's overrides (``load_training``), or exactly what a RayJob's arguments and overlay give
(``deployed_config``). ``render`` (the overlay, the plan check) and ``validate`` (the job's checks)
both read it, so neither imports the other for it.

cluster/ sits below launch/ (CONTRIBUTING.md, tests/test_imports.py), so the loader that composes
the whole TrainConfig (``launch.config.load_config``) is a parameter, ``load``, here and in every
render/validate function that needs a config; ``python -m launch.kuberay`` (launch/kuberay.py)
passes it in.
"""
from __future__ import annotations

import tempfile
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from cluster.kuberay.options import REPO, DeployConfig

CONFIG_MOUNT, CONFIG_KEY = "/etc/sparse-rl", "deploy.yaml"  # the overlay ConfigMap in the head pod

# launch/train.py's argv (--config FILE ..., key=value ...) -> the TrainConfig it runs; the caller
# passes launch.config.load_config (typed Any: naming TrainConfig would import launch/).
LoadConfig = Callable[[list[str]], Any]


def deployed_config(dc: DeployConfig, args: list[str], overlay_yaml: str, load: LoadConfig):
    """The training config a RayJob with arguments ``args`` runs, loaded here with ``load``: the
    image's preset and the ConfigMap's overlay (``overlay_yaml``) mapped to this checkout and a
    temporary file, without resume= (no checkpoint lives on this machine)."""
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / CONFIG_KEY
        local.write_text(overlay_yaml)
        swap = {str(PurePosixPath(dc.workdir) / dc.preset): str(REPO / dc.preset),
                str(PurePosixPath(CONFIG_MOUNT) / CONFIG_KEY): str(local)}
        return load([swap.get(a, a) for a in args if not a.startswith("resume=")])


def load_training(dc: DeployConfig, extra: list[str], load: LoadConfig):
    """The deployment's preset with its overrides (and ``extra``), as this checkout has it, loaded
    with ``load``."""
    return load(["--config", str(REPO / dc.preset), *dc.overrides, *extra])
