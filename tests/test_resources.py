"""The resource plan against the cluster: a local Ray, or a joined cluster without an autoscaler,
that can never place the pools stops before any actor exists, naming the key, resource, need and
total; a joined cluster whose autoscaler can grow enough only warns (beyond its published limits:
an error); an actor never placed ends in an error after cluster.placement_timeout_s."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from cluster import resources
from cluster.resources import autoscaling_limits, check_plan, shortfalls, wait_placed
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


def test_joined_cluster_without_an_autoscaler_is_refused(monkeypatch):
    """Its total counts every node, busy or not: beyond it nothing is ever placed."""
    monkeypatch.setattr(resources, "autoscaling_limits", lambda: None)
    cfg = load_config(["cluster.address=auto", "cluster.rollout_gpus=1"])
    with pytest.raises(ConfigError, match=r"'cluster.rollout_gpus': got 1.0;.*this cluster \(no "
                                          r"autoscaler advertises itself\).*GPU 1 in all \(rollout "
                                          r"1 x 1\); the cluster has 0 in total"):
        check_plan(cfg, _ray(CPU=4.0))
    check_plan(load_config(["cluster.address=auto"]), _ray(CPU=4.0))  # fits: nothing said


def test_joined_autoscaling_cluster_warns_within_its_limits(monkeypatch, capsys):
    """An autoscaler may add what is missing now (KubeRay): a warning, the placement timeout as
    the backstop; beyond the limits it publishes, an error."""
    cfg = load_config(["cluster.address=auto", "cluster.rollout_gpus=1"])
    for limits in ({}, {"CPU": 64.0, "GPU": 8.0}):  # v1: no limits published; v2: its maximum
        monkeypatch.setattr(resources, "autoscaling_limits", lambda: limits)
        check_plan(cfg, _ray(CPU=4.0))
        out = capsys.readouterr().out
        assert "GPU 1 in all (rollout 1 x 1); the cluster has 0 in total" in out
        assert "cluster.placement_timeout_s=900" in out
    monkeypatch.setattr(resources, "autoscaling_limits", lambda: {"CPU": 64.0, "GPU": 2.0})
    cfg = load_config(["cluster.address=auto", "cluster.rollout_gpus=1", "rollout.num_actors=3"])
    with pytest.raises(ConfigError, match=r"'cluster.rollout_gpus'.*GPU 3 in all \(rollout 3 x "
                                          r"1\); its autoscaler reaches 2 at most"):
        check_plan(cfg, _ray(CPU=4.0))


def test_autoscaling_limits_as_the_gcs_advertises_them(local_ray):
    """Read from the cluster itself: nothing on a plain Ray; v1's status; v2's cluster config."""
    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray._raylet import (GCS_AUTOSCALER_CLUSTER_CONFIG_KEY, GCS_AUTOSCALER_STATE_NAMESPACE,
                             GCS_AUTOSCALER_V2_ENABLED_KEY)
    from ray.core.generated import autoscaler_pb2
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_put

    def report():
        status = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
        return status and json.loads(status).get("autoscaler_report")

    # the head's v1 monitor writes its status every few seconds; its first ones carry no report yet
    deadline = time.time() + 60
    while not report() and time.time() < deadline:
        time.sleep(0.2)
    assert report()
    assert autoscaling_limits() is None  # the read-only provider: this Ray adds no node
    status = {"autoscaler_report": {"node_type_mapping": {"ab12": "gpu-workers"}}}
    for value in (status, {}):  # v1 with an autoscaling config (its node groups), or early on
        _internal_kv_put(DEBUG_AUTOSCALING_STATUS, json.dumps(value))
        assert autoscaling_limits() == {}
    _internal_kv_del(DEBUG_AUTOSCALING_STATUS)
    _internal_kv_put(GCS_AUTOSCALER_V2_ENABLED_KEY, "1", namespace=GCS_AUTOSCALER_STATE_NAMESPACE)
    assert autoscaling_limits() == {}  # v2, before it reported its cluster config
    config = autoscaler_pb2.ClusterConfig()
    group = config.node_group_configs.add(name="gpu", max_count=4)
    group.resources.update({"CPU": 8, "GPU": 2})
    _internal_kv_put(GCS_AUTOSCALER_CLUSTER_CONFIG_KEY, config.SerializeToString(),
                     namespace=GCS_AUTOSCALER_STATE_NAMESPACE)
    assert autoscaling_limits() == {"CPU": 32.0, "GPU": 8.0}


def test_an_actor_never_placed_is_an_error_not_a_hang(local_ray):
    ray = local_ray

    @ray.remote(num_cpus=0.1)
    class A:
        pass

    ok = A.remote()
    never = A.options(resources={"no_such_pool": 1}).remote()
    # the placeable one is started first (however slow a loaded machine is), so the 2 s timeout
    # below is spent on the never-placeable actor alone and the message names it only
    ray.get(ok.__ray_ready__.remote(), timeout=120)
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
