"""Shared fixtures: a tiny SFT'd model for the end-to-end runs of launch/train.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.hookimpl(trylast=True)  # after -m / -k deselect: a deselected test starts nothing
def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests need CUDA: skipped where torch sees no GPU (``make test-gpu``
    runs them on a GPU machine). A selected ``registry`` test whose module has
    ``start_in_background()`` (tests/test_locks.py) starts its network wait now, beside the suite."""
    import torch

    for item in items:
        start = getattr(getattr(item, "module", None), "start_in_background", None)
        if "registry" in item.keywords and start is not None:
            start()
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer, 64-wide model trained for 40 SFT steps (seconds): enough for the pipeline."""
    out = tmp_path_factory.mktemp("model") / "tiny"
    subprocess.run([sys.executable, str(REPO / "launch/make_base_model.py"), "--out", str(out),
                    "--max-steps", "40", "--eval-every", "40", "--n-eval", "4", "--hidden", "64",
                    "--layers", "2", "--n-train", "256", "--n-heldout", "8"],
                   check=True, cwd=REPO, capture_output=True, text=True)
    return out


def train_env(home: Path) -> dict:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "HOME": str(home),
            "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions")}


# A few-second job on the tiny model: 2 rollout actors, R-KV evicting, an entropy bonus so the
# weights move even when every reward of the untrained model is 0 (zero advantages).
SMALL_JOB = ["run.eval_problems=8", "run.prompts_per_step=4", "rollout.samples_per_prompt=4",
             "rollout.max_new_tokens=24", "rollout.kv.budget=16", "rollout.kv.compress_every=4",
             "scorer.num_actors=1", "rollout.num_actors=2", "correction.loss.entropy_coef=0.01"]


@pytest.fixture(scope="session")
def learner_model_dir(tmp_path_factory) -> Path:
    """The "tiny" test-model family (common/testmodels.py), for learner tests (built once)."""
    from common.testmodels import build_model

    return str(build_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def learner_batch(learner_model_dir) -> dict:
    """3 groups of 4 rows, padded tensors as the learner takes them, scored by that model."""
    from common.modeling import load_model
    from learner.testing import make_batch

    return make_batch(num_groups=3, group_size=4, model=load_model(learner_model_dir))


@pytest.fixture()
def local_ray(tmp_path, monkeypatch):
    """Ray started the way launch/train.py starts it (local, loopback only), shut down after."""
    from cluster.config import ClusterConfig
    from cluster.ray_setup import start_ray

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("HOME", str(tmp_path))
    ray = start_ray(ClusterConfig(), tmp_path)
    yield ray
    ray.shutdown()


@pytest.fixture()
def preset_task(monkeypatch):
    """``load(name) -> (cfg, task)`` for a preset of ``launch/configs`` whose data file lies in
    ../shared/data (read from the repo root, as train.py does); skipped where it is absent."""
    from launch.config import CONFIG_DIR, load_config
    from tasks import make_task

    def load(name: str):
        cfg = load_config(["--config", str(CONFIG_DIR / f"{name}.yaml")])
        if not (REPO / cfg.task.path).is_file():
            pytest.skip(f"{cfg.task.path} is not beside this checkout")
        monkeypatch.chdir(REPO)
        return cfg, make_task(cfg.task)
    return load


class ContainsAnswer:
    """A task whose reward is 1 when the answer appears in the response: rollout-actor tests set
    it as the actor's in-process ``_task``."""
    name = "contains"

    def reward(self, response: str, answer: str) -> float:
        return 1.0 if answer in response else 0.0
