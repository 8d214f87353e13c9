"""Placement groups per pool (cluster/placement.py) on a local Ray: one group per pool with a bundle
per actor and cluster.placement's strategy, the learners of the DeepSpeed group in one; a pool
that can never be reserved is an error naming it; NCCL members need whole GPUs (config)."""
from __future__ import annotations

import pytest

from cluster import placement
from common.errors import ConfigError
from launch.config import load_config


def _table(ray) -> dict:
    """{group name: (strategy, bundles)} of the groups alive now."""
    from ray.util.placement_group import placement_group_table

    return {t["name"]: (t["strategy"], list(t["bundles"].values()))
            for t in placement_group_table().values() if t["state"] != "REMOVED"}


def test_one_group_per_pool_with_a_bundle_per_actor(local_ray):
    ray = local_ray
    cfg = load_config(["learner.num_learners=2", "run.prompts_per_step=4", "rollout.num_actors=2",
                       "cluster.placement=spread", "cluster.learner_cpus=0.25",
                       "cluster.rollout_cpus=0.25"])
    slots = placement.reserve(cfg, timeout_s=30)
    assert {pool: len(s) for pool, s in slots.items()} == {"learner": 2, "rollout": 2, "scorer": 1}
    # both learners (one DeepSpeed group) in one placement group, bundle i for rank i
    assert slots["learner"][0].group == slots["learner"][1].group
    assert [s.index for s in slots["learner"]] == [0, 1]
    table = _table(ray)
    assert table["sparse-rl-learner"] == ("SPREAD", [{"CPU": 0.25}, {"CPU": 0.25}])
    assert table["sparse-rl-scorer"] == ("SPREAD", [{"CPU": 0.25}])

    @ray.remote(num_cpus=0.25)
    class Probe:
        def bundle(self):
            return ray.get_runtime_context().get_placement_group_id()

    a = Probe.options(**placement.options(slots["rollout"][1])).remote()
    assert ray.get(a.bundle.remote()) == slots["rollout"][1].group.id.hex()
    extra = placement.reserve_one(cfg, "rollout", timeout_s=30)  # a resize beyond the pool
    assert extra.owned and _table(ray)["sparse-rl-rollout-extra"] == ("SPREAD", [{"CPU": 0.25}])
    placement.release(extra)
    assert "sparse-rl-rollout-extra" not in _table(ray)
    ray.kill(a)


def test_a_pool_that_cannot_be_reserved_is_named(local_ray):
    cfg = load_config(["cluster.scorer_resources={nowhere: 1}"])
    with pytest.raises(ConfigError, match=r"cluster.placement_timeout_s.*cluster.placement=pack.*"
                                          r"still waiting: scorer pool \(1 x \{'CPU': 0.25, "
                                          r"'nowhere': 1.0\}\) \(free now: \{'CPU'"):
        placement.reserve(cfg, timeout_s=2)
    assert not _table(local_ray)  # nothing half-reserved stays behind


def test_pack_is_the_default_and_maps_to_ray():
    assert placement.strategy(load_config([])) == "PACK"
    assert placement.strategy(load_config(["cluster.placement=spread"])) == "SPREAD"
    with pytest.raises(ConfigError, match="cluster.placement"):
        load_config(["cluster.placement=strict"])


@pytest.mark.parametrize("override, key", [
    (["cluster.scorer_gpus=0.5"], "cluster.scorer_gpus"),     # shares a GPU: not an NCCL rank
    (["cluster.scorer_gpus=0"], "cluster.scorer_gpus"),       # no GPU at all
    (["cluster.rollout_gpus=1.5"], "cluster.rollout_gpus"),
    (["cluster.learner_gpus=0"], "cluster.learner_gpus"),
])
def test_nccl_members_need_whole_gpus(override, key):
    gpus = ["cluster.weight_sync_backend=nccl", "cluster.learner_gpus=1", "cluster.rollout_gpus=1",
            "cluster.scorer_gpus=1"]
    assert load_config(gpus).cluster.weight_sync_backend.value == "nccl"
    with pytest.raises(ConfigError, match=rf"'{key}'.*whole GPUs \(1, 2, ...\) with "
                                          r"cluster.weight_sync_backend=nccl"):
        load_config(gpus + override)


def test_a_learner_is_one_rank_on_one_gpu():
    with pytest.raises(ConfigError, match=r"'cluster.learner_gpus': got 0.5.*0 \(CPU\) or 1"):
        load_config(["cluster.learner_gpus=0.5"])
    assert load_config(["cluster.scorer_gpus=0.5"]).cluster.scorer_gpus == 0.5  # gloo: may share
