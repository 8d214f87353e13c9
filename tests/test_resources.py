"""The resource plan against the cluster: a local Ray that can never place the pools stops before
any actor exists, naming the key, resource, need and total; a joined (possibly autoscaling) cluster
only warns; an actor never placed ends in an error after cluster.placement_timeout_s."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.resources import check_plan, shortfalls, wait_placed
from common.errors import ConfigError
from launch.config import load_config


def _ray(**total):
    return SimpleNamespace(cluster_resources=lambda: total)


def test_default_plan_fits_two_cpus_and_needs_no_gpu():
    cfg = load_config(["rollout.num_actors=2"])   # 0.5 + 2 x 0.5 + 0.25 + 0.1 = 1.85 CPUs
    assert shortfalls(cfg, {"CPU": 2.0}) == []
    check_plan(cfg, _ray(CPU=2.0))


def test_num_cpus_one_is_refused_with_need_and_total():
    cfg = load_config(["cluster.num_cpus=1", "rollout.num_actors=2"])
    with pytest.raises(ConfigError, match=r"'cluster.num_cpus': got 1;.* CPU 1.85 in all "
                                          r"\(learner 1 x 0.5, rollout 2 x 0.5, scorer 1 x 0.25, "
                                          r"buffer 1 x 0.1\); the cluster has 1 in total"):
        check_plan(cfg, _ray(CPU=1.0))


def test_missing_gpus_name_the_pool_key():
    cfg = load_config(["cluster.rollout_gpus=1", "rollout.num_actors=2", "cluster.learner_gpus=1"])
    with pytest.raises(ConfigError, match=r"'cluster.rollout_gpus': got 1.0;.* GPU 3 in all "
                                          r"\(learner 1 x 1, rollout 2 x 1\); the cluster has 1"):
        check_plan(cfg, _ray(CPU=16.0, GPU=1.0))
    cfg = load_config(["cluster.rollout_resources={rollout_pool: 1}"])
    with pytest.raises(ConfigError, match=r"'cluster.rollout_resources': got 1.0;.*rollout_pool"):
        check_plan(cfg, _ray(CPU=16.0))


def test_joined_cluster_only_warns(capsys):
    """An existing cluster may autoscale (KubeRay): its total now is not its total ever."""
    cfg = load_config(["cluster.address=auto", "cluster.rollout_gpus=1"])
    check_plan(cfg, _ray(CPU=4.0))
    out = capsys.readouterr().out
    assert "GPU 1 in all (rollout 1 x 1); the cluster has 0 in total" in out
    assert "cluster.placement_timeout_s=900" in out


def test_an_actor_never_placed_is_an_error_not_a_hang(local_ray):
    ray = local_ray

    @ray.remote(num_cpus=0.1)
    class A:
        pass

    ok = A.remote()
    never = A.options(resources={"no_such_pool": 1}).remote()
    with pytest.raises(ConfigError, match=r"cluster.placement_timeout_s.*still not placed: "
                                          r"scorer 0 \(free now: \{'CPU'"):
        wait_placed([("learner 0", ok), ("scorer 0", never)], timeout_s=2.0)
    ray.kill(never)


def test_buffer_resources_pin_the_buffer_and_name_their_key():
    """cluster.buffer_resources (KubeRay: buffer_pool, which only the head offers) enters the plan;
    a cluster without it names the key."""
    from cluster.resources import plan

    cfg = load_config(["cluster.buffer_resources={buffer_pool: 1}"])
    assert plan(cfg)["buffer"] == (1, {"CPU": 0.1, "buffer_pool": 1.0})
    assert shortfalls(cfg, {"CPU": 2.0})[0][:4] == ("cluster.buffer_resources", "buffer_pool", 1.0, 0.0)
