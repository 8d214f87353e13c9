"""A run without a scorer pool (``scorer.num_actors=0``): the rollout actors' dense pass over their
own samples (``rollout.dense_logprobs``) gives the old log-probs, at the sampler's version. The
config cross-checks, the rows as the buffer takes them, the anchor lag the step metrics report, a
resize that would add scorers, and the KubeRay plan. End to end: tests/test_train_e2e.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from buffer import BufferConfig, ReplayBuffer
from buffer.synth import synthetic_rows
from buffer.tensors import to_tensors
from common.errors import ConfigError
from launch.config import load_config
from launch.rollouts import own_scores

REPO = Path(__file__).resolve().parent.parent
OWN = ["scorer.num_actors=0", "rollout.dense_logprobs=true"]


def test_config_cross_checks_name_the_key():
    cfg = load_config(OWN)
    assert cfg.scorer.num_actors == 0 and not cfg.correction.staleness.enabled
    for argv, key in (
            (OWN[:1], "rollout.dense_logprobs"),                  # no dense pass: no old log-probs
            (OWN + ["correction.staleness.enabled=true"], "correction.staleness.enabled"),
            (OWN + ["correction.loss.kl_coef=0.01"], "scorer.num_actors"),  # who holds the ref?
            (OWN + ["learner.dtype=bfloat16", "scorer.dtype=bfloat16"], "rollout.dtype"),
            (["scorer.num_actors=-1"], "scorer.num_actors")):
        with pytest.raises(ConfigError) as e:
            load_config(argv)
        assert e.value.key == key, argv
    # the anchor's precision is the rollout's there, not the (unused) scorer's
    load_config(OWN + ["learner.dtype=bfloat16", "rollout.dtype=bfloat16"])
    with pytest.raises(ConfigError) as e:   # with scorers, dense_logprobs is the split's alone
        load_config(OWN[1:])
    assert e.value.key == "rollout.dense_logprobs"


def _rows(version: int):
    rows = synthetic_rows(2, 3, response_len=(2, 6), version=version)
    for i, r in enumerate(rows):
        r["dense_sampler_logprobs"] = [-0.1 * (i + 1)] * len(r["response_ids"])
    return rows


def test_rows_arrive_scored_at_their_own_version():
    rows = own_scores(_rows(version=4))
    dense = [r["old_logprobs"] for r in rows]
    assert all("dense_sampler_logprobs" not in r and r["scorer_version"] == 4 for r in rows)
    buf = ReplayBuffer(BufferConfig(fsync=False, max_staleness=1))
    buf.append(rows)
    assert buf.pending_scoring(100).num_rows == 0          # nothing for a scorer to do
    batch = buf.sample_batch(2, learner_version=5)         # one version behind: async
    assert batch is not None and batch.num_rows == 6
    assert batch.column("scorer_version").to_pylist() == [4] * 6
    got = dict(zip(batch.column("sample_id").to_pylist(), batch.column("old_logprobs").to_pylist()))
    for r, want in zip(rows, dense):                       # stored as float32
        assert got[r["sample_id"]] == pytest.approx(want, rel=1e-6)
    t = to_tensors(batch, pad_id=0)
    assert "dense_sampler_logprobs" not in t               # one copy: the old log-probs


def test_anchor_lag_is_reported():
    from buffer.schema import rows_to_batch
    from launch.metrics import batch_metrics

    own = rows_to_batch(own_scores(_rows(version=4)))
    # trained from version 5 (the record's version is the one after the step): samples and
    # anchor both one version behind without scorers
    m = batch_metrics(own, 6)
    assert m["batch/staleness_max"] == 1 and m["batch/anchor_lag_max"] == 1
    scored = _rows(version=4)
    for r in scored:                                       # a scorer at the learner's version
        r["old_logprobs"], r["scorer_version"] = r.pop("dense_sampler_logprobs"), 5
    m = batch_metrics(rows_to_batch(scored), 6)
    assert m["batch/staleness_max"] == 1 and m["batch/anchor_lag_max"] == 0


def test_a_resize_cannot_add_scorers_to_a_run_without_them(tmp_path, capsys):
    from launch.resize import REQUEST, apply_requested, request

    (tmp_path / "config.yaml").write_text("{}")
    request(tmp_path, {"scorer": 2})
    in_flight = [["a batch"]]
    assert apply_requested(tmp_path, in_flight, None, load_config(OWN), 3) == {}
    assert (tmp_path / (REQUEST + ".rejected")).is_file() and not (tmp_path / REQUEST).exists()
    assert "no scorer pool (scorer.num_actors=0" in capsys.readouterr().out
    assert in_flight == [["a batch"]]                      # nothing landed, nothing resized


def test_kuberay_plans_no_scorer_group_slot():
    from cluster.kuberay import render, validate
    from cluster.kuberay.options import load_deploy
    from cluster.kuberay.training import load_training
    from cluster.resources import plan

    over = "overrides=[scorer.num_actors=0,rollout.dense_logprobs=true," \
           "correction.staleness.enabled=false,correction.loss.kl_coef=0]"
    dc = load_deploy(REPO / "cluster" / "kuberay" / "deploy.yaml", [over])
    parsed = {n: list(yaml.safe_load_all(t)) for n, t in render.render(dc, load_config).items()}
    assert validate.problems(parsed, dc, load_config) == []
    cfg = load_training(dc, [], load_config)
    assert plan(cfg)["scorer"][0] == 0                     # no scorer asks for a GPU


def test_a_resume_keeps_where_the_old_logprobs_come_from(tmp_path):
    from launch.checkpoint import check_same_scoring

    own, scored = load_config(OWN), load_config([])
    check_same_scoring(own, load_config(OWN + ["rollout.num_actors=2"]), tmp_path)
    check_same_scoring(scored, load_config(["scorer.num_actors=3"]), tmp_path)  # a size may change
    for saved, now in ((scored, own), (own, load_config(["rollout.dense_logprobs=false"]))):
        with pytest.raises(ConfigError) as e:
            check_same_scoring(saved, now, tmp_path)
        assert e.value.key == "scorer.num_actors" and str(tmp_path) in str(e.value)
