"""Security defaults: no code from a model directory ever runs (``trust_remote_code`` is off in the
one place every load takes its options from, ``common.modeling.HF_LOAD``), weights are read from
safetensors only (a pickled ``pytorch_model.bin`` is refused unread), ``torch.load`` only with
``weights_only=True``, and no secret reaches the saved config. (That a local Ray listens on
127.0.0.1 only, without a dashboard: tests/test_ray_setup.py. That no secret from the environment
reaches a run's folder or output: tests/test_resume.py's buffer-kill run.)"""
from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

import pytest

from common.errors import ConfigError
from common.modeling import HF_LOAD, HF_WEIGHTS, load_model, load_tokenizer
from common.secrets import check_config, secret_env
from common.testmodels import build_model
from launch.config import TrainConfig, load_config
from launch.preflight import check_model

REPO = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("actors", "buffer", "cluster", "common", "correction", "launch", "learner",
                       "tasks", "bench") for p in (REPO / d).rglob("*.py")]


def _calls(name: str):
    """(file, call node) of every call of ``<anything>.name(...)`` or ``name(...)`` in the code."""
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                if (isinstance(f, ast.Attribute) and f.attr == name) or \
                        (isinstance(f, ast.Name) and f.id == name):
                    yield path.relative_to(REPO), node


def test_every_hf_load_takes_the_one_set_of_options():
    assert HF_LOAD["trust_remote_code"] is False and HF_WEIGHTS["use_safetensors"] is True
    found = list(_calls("from_pretrained"))
    assert len(found) >= 5
    for path, call in found:
        spread = {k.value.id for k in call.keywords if k.arg is None and isinstance(k.value, ast.Name)}
        assert spread & {"HF_LOAD", "HF_WEIGHTS"}, f"{path}:{call.lineno} loads without HF_LOAD"
        assert "trust_remote_code" not in {k.arg for k in call.keywords}, f"{path}:{call.lineno}"
    # vLLM's LLM(**kwargs): the same setting, safetensors only
    (engine,) = [c for p, c in _calls("dict") if p.name == "engine.py" and p.parent.name == "vllm"
                 and "model" in {k.arg for k in c.keywords}]
    kw = {k.arg: ast.unparse(k.value) for k in engine.keywords}
    assert kw["trust_remote_code"] == "HF_LOAD['trust_remote_code']"
    assert kw["load_format"] == "'safetensors'"


# Modules that pickle only between a process and the child it started itself (same trust domain),
# never model weights or anything read from disk or the network.
PICKLE_IPC = {"tasks/rewards.py": "reward inputs (strings) and results to its own child process"}


def test_torch_load_and_pickle_are_not_used_for_weights():
    for path, call in _calls("load"):
        if ast.unparse(call.func) == "torch.load":
            kw = {k.arg: ast.unparse(k.value) for k in call.keywords}
            assert kw.get("weights_only") == "True", f"{path}:{call.lineno}"
    for path in SOURCES:
        if path.relative_to(REPO).as_posix() in PICKLE_IPC:
            continue
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                 for a in n.names} | {n.module for n in ast.walk(tree)
                                      if isinstance(n, ast.ImportFrom)}
        assert not names & {"pickle", "cloudpickle", "dill"}, path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("sec") / "model", "tiny", seed=0)


def _cfg(path: Path):
    return load_config([f"rollout.model_path={path}", "rollout.max_new_tokens=8"])


def test_a_model_that_needs_its_own_code_is_refused_and_the_code_never_runs(model_dir, tmp_path):
    import shutil

    custom = tmp_path / "custom"
    shutil.copytree(model_dir, custom)
    marker = tmp_path / "ran"
    (custom / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                    "from transformers import PretrainedConfig\n"
                                    "class EvilConfig(PretrainedConfig):\n"
                                    "    model_type = 'evil'\n")
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig",
                                               "AutoModelForCausalLM": "evil.EvilConfig"})
    (custom / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="rollout.model_path.*trust_remote_code"):
        check_model(_cfg(custom))
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(custom)
    tok_cfg = json.loads((custom / "tokenizer_config.json").read_text())
    tok_cfg["auto_map"] = {"AutoTokenizer": ["evil.EvilConfig", None]}
    (custom / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    tok = load_tokenizer(custom)  # its tokenizer_class is one transformers has: that one
    assert type(tok).__module__.startswith("transformers.")
    assert not marker.exists()


class _Bomb:
    """What a hostile pytorch_model.bin can hold: unpickling it runs code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickled_weights_are_refused_unread(model_dir, tmp_path):
    import shutil

    pickled = tmp_path / "pickled"
    shutil.copytree(model_dir, pickled)
    for f in pickled.glob("*.safetensors"):
        f.unlink()
    marker = tmp_path / "unpickled"
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps({"w": _Bomb(marker)}))
    with pytest.raises(ConfigError, match=r"safetensors weights .*pytorch_model.bin is a pickle"):
        check_model(_cfg(pickled))
    with pytest.raises(OSError):
        load_model(pickled)
    assert not marker.exists()


def test_no_secret_in_the_config(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-0123456789abcdef")
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-9876543210")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false-but-long")   # not a secret's name
    monkeypatch.setenv("HF_TOKEN_PATH", "/work/main")                # names a file, not a secret
    assert set(secret_env()) >= {"WANDB_API_KEY", "MY_SERVICE_TOKEN"}
    assert not {"TOKENIZERS_PARALLELISM", "HF_TOKEN_PATH"} & set(secret_env())
    load_config(["run.out_dir=/work/main/runs"])                     # nothing secret: loads
    for arg, name in (("run.name=x-wandb-0123456789abcdef", "WANDB_API_KEY"),
                      ("task.path=/data/tok-9876543210.jsonl", "MY_SERVICE_TOKEN")):
        with pytest.raises(ConfigError) as err:
            load_config([arg])
        assert f"<the value of ${name}>" in str(err.value) and arg.split("=")[0] in str(err.value)
        assert "0123456789abcdef" not in str(err.value) and "9876543210" not in str(err.value)
    with pytest.raises(ConfigError, match=r"'cluster.rollout_resources.api_key': got '<not shown>'"):
        load_config(["cluster.rollout_resources={api_key: 1}"])


def test_no_key_of_the_schema_is_named_like_a_secret():
    from omegaconf import OmegaConf

    check_config(OmegaConf.to_container(OmegaConf.structured(TrainConfig), enum_to_str=True),
                 environ={})
