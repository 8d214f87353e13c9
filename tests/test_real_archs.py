"""Real architecture families (common/testmodels.py: Qwen2.5, Qwen3, Llama-3, GQA 4) through the
whole pipeline: the rollout's sampler log-probs, the scorer's and the learner's agree on the same
tokens; 2 RL steps of launch/train.py run on each. (Dense logits == HF forward per family:
tests/test_engine_dense.py.)"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SMALL_JOB, train_env

from actors.config import KVConfig, RolloutConfig, ScorerConfig
from actors.rollout import RolloutActor
from actors.scorer import ScorerActor
from buffer.schema import rows_to_batch
from buffer.tensors import to_tensors
from common.modeling import load_model, token_logprobs
from common.testmodels import EOT_ID, build_model
from common.tokens import pad_token_id
from tasks.base import Problem

REPO = Path(__file__).resolve().parent.parent
REAL = ["qwen2.5", "qwen3", "llama3", "gqa"]
# float32 throughout; the three paths differ only in summation order (decode step vs full forward)
LOGP_TOL = 1e-4
PROBLEMS = [Problem(0, "sum a3b1c4", "8"), Problem(1, "sum a1b2", "3")]
torch.set_num_threads(1)


class Never:
    name = "never"

    def reward(self, response: str, answer: str) -> float:
        return 0.0


@pytest.fixture(scope="module", params=REAL)
def family_dir(request, tmp_path_factory):
    return request.param, str(build_model(tmp_path_factory.mktemp(request.param), request.param))


def test_rollout_scorer_and_learner_logprobs_agree(family_dir):
    family, path = family_dir
    t = 0.7
    chat = "tokenizer" if family == "llama3" else "none"
    cfg = RolloutConfig(model_path=path, samples_per_prompt=3, max_new_tokens=12, temperature=t,
                        logprob_mode="raw", kv=KVConfig(policy="dense"), chat_template=chat)
    actor = RolloutActor(cfg, task_cfg=None, model_path=path)
    actor._task = Never()
    rows = actor.rollout(PROBLEMS, version=0, batch=1)
    if family == "llama3":   # its chat template and its generation_config's second eos id
        assert actor.stop_ids == (2, EOT_ID) and all(r["prompt_ids"][0] == 1 for r in rows)
        assert all(EOT_ID in r["prompt_ids"] for r in rows)
    batch = rows_to_batch(rows)
    _, old, _ = ScorerActor(ScorerConfig(micro_batch=2), path, t).score(batch)
    pad = pad_token_id(actor.tokenizer)
    tensors = to_tensors(batch, pad)
    with torch.no_grad():
        learner = token_logprobs(load_model(path), tensors["input_ids"],
                                 tensors["attention_mask"], t)
    mask = tensors["response_mask"].bool()
    sampler = tensors["sampler_logprobs"][mask]
    assert sampler.numel() == sum(len(r["response_ids"]) for r in rows) > 0
    assert torch.allclose(learner[mask], sampler, atol=LOGP_TOL)
    assert torch.allclose(torch.tensor([x for lp in old for x in lp]), sampler, atol=LOGP_TOL)
    assert (tensors["input_ids"][~tensors["attention_mask"].bool()] == pad).all()


def test_max_position_error_stops_train_before_anything(tmp_path):
    path = build_model(tmp_path / "m", "llama3", num_hidden_layers=1)   # 512 positions
    proc = subprocess.run([sys.executable, "launch/train.py", f"rollout.model_path={path}",
                           "rollout.max_new_tokens=64", "rollout.max_prompt_tokens=500",
                           f"run.out_dir={tmp_path / 'runs'}"], cwd=REPO, env=train_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr
    assert "rollout.max_prompt_tokens" in err and "rollout.max_new_tokens" in err and "512" in err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("family", REAL)
def test_two_rl_steps(family, tmp_path):
    model = build_model(tmp_path / "model", family)
    chat = ["rollout.chat_template=tokenizer"] if family == "llama3" else []
    proc = subprocess.run([sys.executable, "launch/train.py", f"rollout.model_path={model}",
                           "run.steps=2", *SMALL_JOB, "run.eval_problems=4", *chat,
                           f"run.out_dir={tmp_path / 'runs'}"], cwd=REPO, env=train_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    syncs = [r for r in records if "weights/checksum" in r]
    assert len(syncs) == 3 and all(r["weights/max_rel_diff"] == 0.0 for r in syncs)
    assert syncs[0]["weights/checksum"] != syncs[-1]["weights/checksum"]
    train = [r for r in records if "reward" in r]
    assert [r["version"] for r in train] == [1, 2]
    assert all(r["batch/logprob_lengths_match"] for r in train)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["version"] == 2 and summary["prompts/overlong_train"] == 0
    assert (run_dir / "final" / "config.json").is_file()
    if family == "llama3":
        assert "no pad token: using eos id 2" in proc.stderr
