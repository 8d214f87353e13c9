"""Per-pool core sets: validated up front, applied inside the actor process before its constructor."""
from __future__ import annotations

import os

import pytest

from cluster.config import ClusterConfig
from cluster.ray_setup import actor_options, pinned
from common.errors import ConfigError
from launch.config import load_config

LAST = (os.cpu_count() or 1) - 1


def test_core_lists_parse_from_the_command_line():
    cfg = load_config(["cluster.rollout_cores=[0]", f"cluster.learner_cores=[{LAST}]"])
    assert cfg.cluster.rollout_cores == [0] and cfg.cluster.learner_cores == [LAST]
    assert cfg.cluster.scorer_cores == []  # default: no pinning


@pytest.mark.parametrize("key,value", [
    ("rollout_cores", [LAST + 1]),   # a CPU this machine does not have
    ("scorer_cores", [-1]),
    ("learner_cores", [0, 0]),       # duplicates
    ("learner_cores", [True]),       # bools are ints in Python; not CPU ids
])
def test_bad_core_lists_name_their_key(key, value):
    with pytest.raises(ConfigError) as e:
        ClusterConfig(**{key: value}).validate()
    assert e.value.key == f"cluster.{key}"
    assert f"[0, {LAST}]" in str(e.value)


def test_bad_core_list_from_the_command_line_names_its_key():
    with pytest.raises(ConfigError, match="cluster.scorer_cores"):
        load_config([f"cluster.scorer_cores=[{LAST + 5}]"])


def test_no_cores_leaves_the_class_alone():
    assert pinned(dict, []) is dict


@pytest.mark.slow
def test_pinning_applies_inside_the_actor_process(local_ray):
    ray = local_ray
    cores = [LAST]

    class _Probe:
        def __init__(self, tag):
            import torch

            # read in the constructor: pinning must already hold while the model would load
            self.at_init = (sorted(os.sched_getaffinity(0)), torch.get_num_threads())
            self.tag = tag

        def report(self):
            return self.tag, self.at_init

    a = ray.remote(**actor_options(0.1))(pinned(_Probe, cores)).remote("pinned")
    b = ray.remote(**actor_options(0.1))(_Probe).remote("free")
    (tag, (affinity, threads)), (_, (free_affinity, _)) = ray.get([a.report.remote(), b.report.remote()])
    assert tag == "pinned"  # constructor arguments still reach the wrapped class
    assert affinity == cores and threads == 1
    assert free_affinity == list(range(LAST + 1))  # unpinned actors keep every core
