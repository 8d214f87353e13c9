"""The learner and scorer as the driver uses them: Ray actors, 2 data-parallel learners, one weight
broadcast from learner rank 0 to a scorer; every copy of the weights must agree afterwards."""
from __future__ import annotations

import tempfile

import pytest

from common.modeling import load_model
from correction import CorrectionConfig
from learner.config import LearnerConfig
from learner.batch import prepare_batch, shard_batch
from common.testmodels import build_model
from learner.testing import make_batch


@pytest.fixture()
def ray_local(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # Ray 2.60 writes $HOME/.ray/auth_token otherwise
    import ray

    from cluster.ray_setup import worker_env

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=tempfile.mkdtemp(prefix="ray-lrn-", dir="/tmp"),  # fresh: see PLATFORM.md
             runtime_env={"env_vars": worker_env()}, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_two_ray_learners_train_and_broadcast_to_a_scorer(ray_local, tmp_path):
    ray = ray_local
    from actors.scorer import ScorerActor
    from learner.learner import Learner

    model_dir = build_model(tmp_path / "model")
    cfg = LearnerConfig(num_learners=2, zero_stage=1, lr=1e-3, micro_batch_size=4)
    learner_cls = ray.remote(num_cpus=0.5)(Learner)
    # the production rendezvous (cluster.pools): rank 0 holds each socket from the moment it
    # picks the port, so nothing else on the machine can take it in between (a free_port()
    # probe here lost its port to another process once in CI: EADDRINUSE)
    learners = [learner_cls.remote(cfg, CorrectionConfig(), model_dir, rank=r, world_size=2)
                for r in range(2)]
    ds_addr = ray.get(learners[0].listen.remote())
    ray.get([lrn.start.remote(*ds_addr) for lrn in learners])
    try:
        from actors.config import ScorerConfig
        scorer_cfg = ScorerConfig(micro_batch=4)
    except ImportError:
        from types import SimpleNamespace
        scorer_cfg = SimpleNamespace(micro_batch=4, dtype="float32")
    scorer = ray.remote(num_cpus=0.25)(ScorerActor).remote(scorer_cfg, model_dir, 1.0)

    host, port = ray.get(learners[0].open_weight_sync.remote())
    ray.get([learners[0].init_weight_sync.remote(host, port, 2, "gloo", 1),
             scorer.init_weight_sync.remote(host, port, 1, 2)])
    before = ray.get(scorer.state_checksum.remote())

    batch = make_batch(num_groups=4, group_size=4, model=load_model(model_dir))
    shards = shard_batch(prepare_batch(batch, CorrectionConfig(), 0)[0], 2)
    metrics = ray.get([lrn.train_step.remote(sh, 1.0) for lrn, sh in zip(learners, shards)])
    assert [m["version"] for m in metrics] == [1.0, 1.0]

    sent, _, got = ray.get([lrn.broadcast_weights.remote() for lrn in learners]
                           + [scorer.sync_weights.remote()])
    assert sent == got == 1
    sums = ray.get([lrn.state_checksum.remote() for lrn in learners] + [scorer.state_checksum.remote()])
    assert sums[0] == sums[1] == pytest.approx(sums[2], rel=1e-12)
    assert sums[0] != pytest.approx(before, rel=1e-9)
