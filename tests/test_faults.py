"""Poisoned batches (learner/screen.py, launch/faults.py) without Ray: each non-finite input is
found and named with its sample ids; the driver skips the batch without calling a learner, retires
the poisoned groups and gives the clean ones back, counts and names it, and stops the run after
run.max_consecutive_skips in a row; a learner step whose optimiser steps were all refused counts
as skipped too; failed rewards are counted. (End to end: test_faults_e2e.py.)"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from common.errors import ConfigError, TrainingFault
from launch.config import load_config
from launch.faults import Faults
from learner.screen import DERIVED, INPUTS, find_poison
from learner.testing import make_batch

IDS = [f"g{i // 4}-s{i % 4}" for i in range(12)]


def _batch():
    b = make_batch(num_groups=3, group_size=4)
    b["ref_logprobs"] = b["old_logprobs"].clone()
    b["dense_sampler_logprobs"] = b["sampler_logprobs"].clone()
    return b


@pytest.mark.parametrize("key", INPUTS + DERIVED)
def test_each_input_is_screened_and_names_its_samples(key):
    b = _batch()
    b["advantages"], b["is_weights"] = torch.zeros(12), b["response_mask"].float()
    row, x = 5, b[key].clone()
    if x.dim() == 1:
        x[row] = float("nan")
    else:
        x[row, b["response_mask"][row].nonzero()[-1]] = float("-inf")
    b[key] = x
    p = find_poison(b, IDS)
    assert (p.cause, p.sample_ids, p.values) == (key, (IDS[row],), 1)
    assert f"non-finite {key}" in str(p) and IDS[row] in str(p)


def test_padding_is_not_screened_and_a_clean_batch_passes():
    b = _batch()
    assert find_poison(b, IDS) is None
    pad = (~b["response_mask"]).nonzero()[0]
    b["old_logprobs"][tuple(pad)] = float("nan")  # outside the response: never used
    assert find_poison(b, IDS) is None


class _Remote:
    def __init__(self, log, name, result=None):
        self.log, self.name, self.result = log, name, result

    def remote(self, *args):
        self.log.append((self.name, args))
        return self.result(*args) if callable(self.result) else self.result


def _pools(learner_metrics=None):
    """The parts of ``cluster.pools.Pools`` that ``Faults.train`` touches, recording calls
    (ray.get is the identity here: see the fixture)."""
    log = []
    buffer = SimpleNamespace(mark_consumed=_Remote(log, "consumed", lambda ids: len(ids)),
                             release=_Remote(log, "released", lambda ids: len(ids)))
    learner = SimpleNamespace(train_step=_Remote(log, "train_step", lambda sh, t: dict(
        {"loss": 0.5, "learner/loss_units": 1.0, "learner/optimizer_steps": 1.0,
         "learner/skipped_steps": 0.0}, **(learner_metrics or {}))))
    return SimpleNamespace(buffer=buffer, learners=[learner]), log


@pytest.fixture
def no_ray(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda x: x)


def _arrow(ids):
    import pyarrow as pa

    return pa.record_batch({"sample_id": ids, "group_id": [s.split("-")[0] for s in ids]})


def test_poisoned_batches_are_skipped_counted_and_stop_the_run(tmp_path, no_ray, capsys):
    cfg = load_config([])
    faults = Faults(tmp_path, max_consecutive_skips=2)
    pools, log = _pools()
    b = make_batch(num_groups=3, group_size=4)
    b["rewards"][5] = float("nan")
    metrics, trained = faults.train(pools, cfg, _arrow(IDS), b, step=1, version=0)
    assert trained == [] and metrics["faults/step_skipped"] == 1
    assert [n for n, _ in log] == ["consumed", "released"]  # never reached a learner
    assert log[0][1][0] == IDS[4:8] and log[1][1][0] == IDS[:4] + IDS[8:]
    m = faults.metrics()
    assert m["faults/skipped_steps"] == 1 and m["faults/skipped/rewards"] == 1
    assert m["faults/dropped_samples"] == 4 and m["faults/released_samples"] == 8
    assert m["faults/consecutive_skips"] == 1
    out = capsys.readouterr().out
    assert "[faults] step 1: batch skipped: non-finite rewards" in out and IDS[5] in out
    (event,) = [json.loads(x) for x in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert event["sample_ids"] == [IDS[5]] and event["dropped"] == IDS[4:8]

    # a clean step resets the run of skips; then two poisoned ones in a row stop the run
    good = make_batch(num_groups=3, group_size=4)
    metrics, trained = faults.train(pools, cfg, _arrow(IDS), good, step=2, version=0)
    assert trained == IDS and metrics["faults/step_skipped"] == 0
    assert faults.metrics()["faults/consecutive_skips"] == 0
    bad = make_batch(num_groups=3, group_size=4)
    bad["old_logprobs"][0, bad["response_mask"][0].nonzero()[0]] = float("inf")
    faults.train(pools, cfg, _arrow(IDS), bad, step=3, version=1)
    with pytest.raises(TrainingFault, match=r"2 consecutive training steps skipped "
                       r"\(run.max_consecutive_skips=2\), the last at step 4: non-finite "
                       r"old_logprobs .* g0-s0"):
        faults.train(pools, cfg, _arrow(IDS), bad, step=4, version=1)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["faults/skipped_steps"] == 3 and "consecutive" in summary["error"]


def test_a_learner_step_refused_entirely_is_a_skipped_step(tmp_path, no_ray):
    cfg = load_config([])
    faults = Faults(tmp_path, max_consecutive_skips=3)
    refused = {"learner/optimizer_steps": 0.0, "learner/skipped_steps": 1.0,
               "learner/skipped_loss": 0.0, "learner/skipped_grad": 1.0}
    pools, log = _pools(refused)
    _, trained = faults.train(pools, cfg, _arrow(IDS), make_batch(3, 4), step=1, version=0)
    assert trained == [] and ("consumed", (IDS,)) in log
    m = faults.metrics()
    assert m["faults/skipped/learner_grad"] == 1 and m["faults/skipped_optimizer_steps"] == 1
    partly = {"learner/optimizer_steps": 1.0, "learner/skipped_steps": 1.0}
    pools, _ = _pools(partly)
    _, trained = faults.train(pools, cfg, _arrow(IDS), make_batch(3, 4), step=2, version=1)
    assert trained == IDS and faults.metrics()["faults/skipped_steps"] == 1
    assert faults.metrics()["faults/skipped_optimizer_steps"] == 2


def test_reward_faults_are_counted(tmp_path, capsys):
    faults = Faults(tmp_path, 3)
    rows = [{"sample_id": "a", "reward_fault": None}, {"sample_id": "b", "reward_fault": "timeout"},
            {"sample_id": "c", "reward_fault": "error: ValueError: x"},
            {"sample_id": "d", "reward_fault": "error: KeyError: y"}]
    faults.note_rewards(7, rows)
    m = faults.metrics()
    assert (m["faults/reward_timeouts"], m["faults/reward_errors"]) == (1, 2)
    assert "reward errors (reward 0): error: ValueError: x (2 samples: c, d)" in capsys.readouterr().out


def test_max_consecutive_skips_is_validated():
    assert load_config([]).run.max_consecutive_skips == 3
    with pytest.raises(ConfigError, match="run.max_consecutive_skips"):
        load_config(["run.max_consecutive_skips=0"])


def test_rows_landed_before_a_checkpoint_are_counted_and_counts_survive_a_resume(
        tmp_path, no_ray, capsys):
    """Rows that land in the buffer outside step 6a (before a checkpoint, a resize) are seen by
    ``note_rewards`` too; a resumed run starts from the checkpoint's counts, not from 0."""
    from launch.rollouts import land_rollouts

    faults = Faults(tmp_path, 3)
    appended = []
    pools = SimpleNamespace(buffer=SimpleNamespace(append=_Remote([], "append", appended.extend)))
    rows = [{"sample_id": "s0", "reward_fault": "timeout"}, {"sample_id": "s1", "reward_fault": None}]
    in_flight = [[(0, None, 4, rows)]]  # (actor, chunk, batch, ref): ray.get(ref) is the rows here
    cfg = SimpleNamespace(scorer=SimpleNamespace(num_actors=1))  # rows go to the scorers
    assert land_rollouts(in_flight, pools, cfg, 1, faults.rewards_of(4)) == 1
    assert in_flight == [[]] and appended == rows
    assert faults.metrics()["faults/reward_timeouts"] == 1
    faults.survived["faults/buffer_restarts"] = 1  # counted by launch/recovery.py
    saved = {"faults": faults.state()}  # trainer_state.json, as launch.checkpoint.save writes it
    survived = {"faults/buffer_restarts": 0}  # the resumed run's fresh Pools.faults
    resumed = Faults(tmp_path, 3, survived)
    resumed.restore(json.loads(json.dumps(saved)))
    assert resumed.metrics()["faults/reward_timeouts"] == 1
    assert survived["faults/buffer_restarts"] == 1 == resumed.metrics()["faults/buffer_restarts"]
    resumed.restore({})  # a checkpoint written before counts were kept
    assert resumed.metrics()["faults/reward_timeouts"] == 1
