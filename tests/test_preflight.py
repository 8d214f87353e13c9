"""launch/preflight.py on broken model directories and KV budgets: each a ConfigError naming the
key and the file or value (launch/train.py turns it into exit 2 before Ray and the run folder)."""
from __future__ import annotations

import json
import shutil

import pytest

from common.errors import ConfigError
from launch.config import load_config
from launch.preflight import check_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from common.testmodels import build_model

    return build_model(tmp_path_factory.mktemp("pre") / "model")


@pytest.fixture()
def broken(model_dir, tmp_path):
    """A copy of the model directory to break."""
    out = tmp_path / "m"
    shutil.copytree(model_dir, out)
    return out


def _check(path, *kv):
    return check_model(load_config([f"rollout.model_path={path}", *kv]))


def test_intact_model_passes(model_dir):
    tok, enc = _check(model_dir)
    assert enc.max_tokens > 0 and len(tok) == 260


def test_garbage_config_json_names_the_file_and_position(broken):
    (broken / "config.json").write_text('{"model_type": "qwen2",\n  oops}')
    with pytest.raises(ConfigError, match=r"rollout.model_path.*config\.json:2:3 is JSON"):
        _check(broken)
    (broken / "config.json").write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ConfigError, match=r"rollout.model_path.*config\.json is JSON"):
        _check(broken)
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(ConfigError, match=r"rollout.model_path.*a config.json transformers can read"):
        _check(broken)
    (broken / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config\.json is a JSON object"):
        _check(broken)


def test_config_without_weights(broken):
    for f in broken.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ConfigError, match=r"rollout.model_path.*a model directory with safetensors weights"):
        _check(broken)
    (broken / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ConfigError, match=r"missing \['model-00001-of-00002.safetensors'\]"):
        _check(broken)


def test_tokenizer_beyond_the_model_vocabulary(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["vocab_size"] = 131
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"rollout.model_path.*vocab_size \(131\); the tokenizer "
                                          r"has 260 ids"):
        _check(broken)


def test_missing_tokenizer(broken):
    for f in broken.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ConfigError, match=r"rollout.model_path.*a model directory with a tokenizer"):
        _check(broken)


def test_kv_budget_against_the_context(model_dir):
    max_pos = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ConfigError, match=rf"rollout.kv.budget.*max_position_embeddings \({max_pos}\)"
                                          r" with rollout.kv.policy=rkv"):
        _check(model_dir, "rollout.kv.policy=rkv", f"rollout.kv.budget={max_pos}",
               "rollout.max_new_tokens=16")
    _check(model_dir, "rollout.kv.policy=dense", f"rollout.kv.budget={max_pos}",
           "rollout.max_new_tokens=16")            # dense keeps everything: the budget is unused
    _check(model_dir, "rollout.kv.policy=rkv", f"rollout.kv.budget={max_pos - 1}",
           "rollout.max_new_tokens=16", "rollout.kv.obs_window=8")


@pytest.mark.parametrize("kv, key", [
    (["rollout.kv.policy=streaming", "rollout.kv.budget=4", "rollout.kv.sink_tokens=4"],
     "rollout.kv.sink_tokens"),
    (["rollout.kv.policy=snapkv", "rollout.kv.budget=4", "rollout.kv.obs_window=8"],
     "rollout.kv.obs_window"),
    (["rollout.kv.policy=rkv", "rollout.kv.budget=4", "rollout.kv.obs_window=8"],
     "rollout.kv.obs_window"),
])
def test_kv_budget_below_sinks_or_window(kv, key):
    """Already refused by KVConfig.validate at load: a budget must hold the sinks (streaming) or
    the observation window (snapkv, rkv) and more."""
    with pytest.raises(ConfigError, match=key):
        load_config(kv)
