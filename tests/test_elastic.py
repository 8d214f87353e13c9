"""Elastic pools (issue #6): the weight-sync group re-forms after an actor dies, after Ray
restarts one, and when a pool is resized; every receiver then holds exactly the learner's weights
and version.
A missing peer makes weight sync fail within its timeout instead of hanging.

Real Ray on CPU with a tiny model; a plain-model ``WeightSource`` stands in for learner rank 0
(DeepSpeed's start-up would dominate the test time).
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from actors.config import RolloutConfig, ScorerConfig
from cluster.config import ClusterConfig
from correction.config import CorrectionConfig, LossConfig
from cluster.weight_sync import WeightReceiver, WeightSender, free_port
from common.testmodels import build_model
from tasks.base import Problem
from tasks.config import TaskConfig

SPEC = [("w", (64,), torch.float32)]


# ---- timeouts, without Ray -------------------------------------------------------------------

def test_receiver_without_a_sender_fails_within_its_timeout():
    t0 = time.monotonic()
    with pytest.raises(Exception):  # TCPStore: no server ever listens on the port
        WeightReceiver("127.0.0.1", free_port(), 1, 2, SPEC, timeout_s=2.0)
    assert time.monotonic() - t0 < 15


def test_receive_fails_within_the_timeout_when_the_sender_never_sends():
    port, made = free_port(), {}
    t = threading.Thread(target=lambda: made.update(
        s=WeightSender("127.0.0.1", port, 2, SPEC, timeout_s=2.0)))
    t.start()
    receiver = WeightReceiver("127.0.0.1", port, 1, 2, SPEC, timeout_s=2.0)
    t.join()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="[Tt]imed out"):
        receiver.receive()  # the sender is alive but never calls send: a peer gone silent
    assert 1.5 < time.monotonic() - t0 < 15


# ---- Ray: replace, restart, resize ------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_env(tmp_path_factory):
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from cluster.ray_setup import start_ray

    run_dir = tmp_path_factory.mktemp("elastic")
    ray = start_ray(ClusterConfig(num_cpus=2), run_dir)
    model = str(build_model(run_dir / "model", "tiny", seed=0))
    yield ray, model
    ray.shutdown()


@pytest.fixture(scope="module")
def pools_cfg(ray_env):
    """Learner stand-in, one rollout actor, one scorer, in one weight-sync group; shared by the
    tests below (each leaves every actor in the group with the learner's weights) since every actor
    process costs seconds to start."""
    from cluster.pools import Pools, broadcast_weights, connect_weight_sync, spawn_rollout, \
        spawn_scorer
    from learner.testing import WeightSource

    ray, model = ray_env
    cfg = SimpleNamespace(
        cluster=ClusterConfig(rollout_cpus=0.25, scorer_cpus=0.25, weight_sync_timeout_s=30.0,
                              actor_max_restarts=1),
        rollout=RolloutConfig(model_path=model, samples_per_prompt=2, max_new_tokens=6,
                              batch_size=8),
        scorer=ScorerConfig(micro_batch=4), task=TaskConfig(n_train=8, n_heldout=2),
        # a KL penalty: every scorer, replacements included, holds the initial model as reference
        correction=CorrectionConfig(loss=LossConfig(kl_coef=0.1)))
    pools = Pools(learners=[ray.remote(num_cpus=0.25)(WeightSource).remote(model)])
    pools.rollout_ids = [0]
    pools.rollout = [spawn_rollout(cfg, 0)]
    pools.scorer = [spawn_scorer(cfg)]
    connect_weight_sync(pools, cfg)
    broadcast_weights(pools)
    return pools, cfg


def train_step(ray, pools, seed: int) -> int:
    """What a learner step does to the weights: change them and bump the version."""
    return ray.get(pools.learners[0].step.remote(seed))


def assert_in_sync(ray, pools, version: int) -> None:
    """Every receiver holds the learner's version and exactly its weights, once it has swapped in
    what it staged (as its next batch does first)."""
    ray.get([a.__ray_call__.remote(lambda self: self._swap_staged()) for a in pools.receivers])
    ref = ray.get(pools.learners[0].state_checksum.remote())
    sums = ray.get([a.state_checksum.remote() for a in pools.receivers])
    versions = ray.get([a.__ray_call__.remote(lambda self: self.version) for a in pools.receivers])
    assert versions == [version] * len(pools.receivers)
    assert sums == [ref] * len(pools.receivers)


@pytest.mark.slow
def test_killed_and_restarted_actors_rejoin_with_the_learners_weights(ray_env, pools_cfg):
    ray, _ = ray_env
    from cluster.elastic import replace_dead
    from cluster.pools import broadcast_weights

    pools, cfg = pools_cfg
    v = train_step(ray, pools, seed=1)
    broadcast_weights(pools)
    problems = [Problem(3, "sum a1b2", "3")]
    before = ray.get(pools.rollout[0].rollout.remote(problems, v, 7))
    old_scorer = pools.scorer[0]

    ray.kill(pools.rollout[0], no_restart=True)   # gone for good: replaced
    ray.kill(pools.scorer[0], no_restart=False)   # Ray restarts it, fresh and outside the group
    _await_restart(ray, pools.scorer[0])
    counted = pools.faults["faults/actor_replacements"]
    report = replace_dead(pools, cfg)

    assert report == ["rollout actor 0: dead, replaced", "scorer 0: restarted by Ray, rejoined"]
    assert pools.faults["faults/actor_replacements"] == counted + 2  # metrics and summary
    assert pools.scorer[0] is old_scorer and pools.rollout_ids == [0]
    assert_in_sync(ray, pools, v)
    # the replacement has actor_id 0 and the learner's weights: it regenerates the lost chunk
    again = ray.get(pools.rollout[0].rollout.remote(problems, v, 7))
    assert [(r["sample_id"], r["response_ids"]) for r in again] == \
        [(r["sample_id"], r["response_ids"]) for r in before]
    # and the next step's broadcast reaches every actor of the re-formed group
    v2 = train_step(ray, pools, seed=2)
    assert broadcast_weights(pools)[0] == v2
    assert_in_sync(ray, pools, v2)
    assert replace_dead(pools, cfg) == []          # nothing wrong: nothing done
    assert pools.faults["faults/actor_replacements"] == counted + 2


@pytest.mark.slow
def test_actor_dying_in_a_broadcast_fails_it_and_heals_within_the_timeout(ray_env, pools_cfg):
    """The broadcast that finds a member dead raises instead of hanging; survivors blocked in it
    give up after ``weight_sync_timeout_s``, and replace_dead then re-forms the group."""
    ray, _ = ray_env
    from dataclasses import replace

    from cluster.elastic import replace_dead, sync_all
    from cluster.pools import broadcast_weights

    pools, cfg = pools_cfg
    short = SimpleNamespace(**vars(cfg))
    short.cluster = replace(cfg.cluster, weight_sync_timeout_s=3.0)
    sync_all(pools, short)                         # the group now gives up after 3 s
    v = train_step(ray, pools, seed=6)
    ray.kill(pools.rollout[0], no_restart=True)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="[Cc]onnection|[Tt]imed out|died"):
        broadcast_weights(pools)
    assert replace_dead(pools, short) == ["rollout actor 0: dead, replaced"]
    assert time.monotonic() - t0 < 60
    assert_in_sync(ray, pools, v)
    sync_all(pools, cfg)                           # back to the fixture's timeout


@pytest.mark.slow
def test_resize_rollout_pool_one_two_one(ray_env, pools_cfg):
    ray, _ = ray_env
    from cluster.elastic import DEAD, probe, resize_pool
    from cluster.pools import broadcast_weights

    pools, cfg = pools_cfg
    assert len(pools.rollout) == 1
    v = train_step(ray, pools, seed=3)
    broadcast_weights(pools)

    assert resize_pool(pools, cfg, "rollout", 2) == ["rollout actor 1: added"]
    assert pools.rollout_ids == [0, 1] and len(pools.receivers) == 3
    assert_in_sync(ray, pools, v)                  # the new actor got the current weights

    v = train_step(ray, pools, seed=4)
    broadcast_weights(pools)
    assert_in_sync(ray, pools, v)

    removed = pools.rollout[1]
    assert resize_pool(pools, cfg, "rollout", 1) == ["rollout actor 1: removed"]
    assert pools.rollout_ids == [0] and len(pools.receivers) == 2
    assert probe([removed], timeout_s=10) == [DEAD]
    v = train_step(ray, pools, seed=5)
    broadcast_weights(pools)                       # the smaller group works without the old member
    assert_in_sync(ray, pools, v)
    with pytest.raises(ValueError):
        resize_pool(pools, cfg, "learner", 2)


@pytest.mark.slow
def test_driver_regenerates_a_dead_actors_share_and_scores_after_a_scorer_dies(ray_env, pools_cfg):
    """launch/train.py's helpers: a rollout actor killed while its batch is in flight is replaced
    and the batch comes back exactly as a healthy actor would have produced it; a dead scorer is
    replaced and every pending row still gets scored."""
    ray, _ = ray_env
    from buffer import BufferConfig, ReplayBuffer
    from cluster.pools import broadcast_weights
    from launch.rollouts import PromptSampler, gather_rollouts, launch_rollouts
    from launch.scoring import score_pending

    pools, cfg = pools_cfg
    v = train_step(ray, pools, seed=7)
    broadcast_weights(pools)
    problems = [Problem(i, f"sum a{i}b2", str(i + 2)) for i in range(4)]
    healthy = gather_rollouts(launch_rollouts(pools, PromptSampler(problems, 2, 0), v), pools, cfg, v)
    in_flight = launch_rollouts(pools, PromptSampler(problems, 2, 0), v)
    ray.kill(pools.rollout[0], no_restart=True)
    again = gather_rollouts(in_flight, pools, cfg, v)
    key = lambda rows: [(r["sample_id"], r["response_ids"], r["sampler_logprobs"]) for r in rows]
    assert key(again) == key(healthy) and len(again) == 4
    assert_in_sync(ray, pools, v)

    pools.buffer = ray.remote(num_cpus=0)(ReplayBuffer).remote(BufferConfig())
    cfg.buffer = BufferConfig()
    ray.get(pools.buffer.append.remote(again))
    ray.kill(pools.scorer[0], no_restart=True)
    score_pending(pools, cfg, v)
    stats = ray.get(pools.buffer.stats.remote())
    assert stats["scored_rows_live"] == 4 and stats["generated_rows"] == 0
    assert_in_sync(ray, pools, v)
    # the replacement's reference is the initial model, not the learner's current weights, and
    # the rescored rows carry its log-probs next to the old ones
    from common.modeling import checksum, load_model

    ref_sum = ray.get(pools.scorer[0].__ray_call__.remote(
        lambda self: checksum(self.ref.named_parameters())))
    assert ref_sum == checksum(load_model(cfg.rollout.model_path).named_parameters())
    assert ref_sum != ray.get(pools.learners[0].state_checksum.remote())
    scored = ray.get(pools.buffer.sample_batch.remote(2, v)).to_pylist()
    assert len(scored) == 4
    assert all(len(r["ref_logprobs"]) == len(r["old_logprobs"]) == r["response_len"]
               for r in scored)
    assert any(a != b for r in scored for a, b in zip(r["ref_logprobs"], r["old_logprobs"]))


def _hold_next_generation(flags: str):
    """For ``__ray_call__`` on a rollout actor: its next generation writes ``flags/started`` and
    waits for ``flags/release`` (a long generation, as long as the test wants)."""
    def install(actor):
        import os
        import time as t

        orig = actor.engine.generate

        def generate(prompts, params):
            actor.engine.generate = orig                       # this call only
            open(os.path.join(flags, "started"), "w").close()
            deadline = t.monotonic() + 120
            while not os.path.exists(os.path.join(flags, "release")) and t.monotonic() < deadline:
                t.sleep(0.05)
            return orig(prompts, params)

        actor.engine.generate = generate
    return install


def _wait_for(path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.slow
def test_broadcast_completes_beside_a_running_rollout_and_the_next_batch_uses_it(
        ray_env, pools_cfg, tmp_path):
    """run.rollouts_ahead=1 (the pools' default): the broadcast after a learner step returns while
    a rollout is still generating; that batch's rows all carry the old version and its samples are
    the old weights'; the next batch swaps the new weights in first and carries the new version."""
    ray, _ = ray_env
    from cluster.pools import broadcast_weights

    pools, cfg = pools_cfg
    actor = pools.rollout[0]
    v0 = train_step(ray, pools, seed=11)
    broadcast_weights(pools)
    problems = [Problem(3, "sum a1b2", "3"), Problem(5, "sum a3b2", "5")]
    ref_old = ray.get(actor.rollout.remote(problems, v0, 21))   # swaps v0 in, then generates
    ray.get(actor.__ray_call__.remote(_hold_next_generation(str(tmp_path))))
    running = actor.rollout.remote(problems, v0, 21)            # the same batch, held mid-way
    _wait_for(tmp_path / "started")
    v1 = train_step(ray, pools, seed=12)
    t0 = time.monotonic()
    version, sync = broadcast_weights(pools)                    # beside the running rollout
    took = time.monotonic() - t0
    ready, _ = ray.wait([running], timeout=0)
    assert version == v1 and sync["weights/max_rel_diff"] == 0.0 and took < 30
    assert not ready                                            # the rollout is still running
    (tmp_path / "release").touch()
    rows = ray.get(running)
    assert all(r["policy_version"] == v0 for r in rows)
    key = lambda rows: [(r["response_ids"], r["sampler_logprobs"]) for r in rows]
    assert key(rows) == key(ref_old)                            # generated by v0's weights only
    assert ray.get(actor.__ray_call__.remote(lambda self: self.version)) == v0
    after = ray.get(actor.rollout.remote(problems, v1, 22))
    assert all(r["policy_version"] == v1 for r in after)
    assert ray.get(actor.__ray_call__.remote(lambda self: self.swaps[-1][0])) == v1
    assert_in_sync(ray, pools, v1)


def _die_after_the_gate():
    """For ``__ray_call__``: the actor's process exits inside its next weight transfer, once every
    rank has passed the transfer's gate (a peer dying mid-broadcast). A closure, so Ray ships it by
    value (the actor cannot import this test module)."""
    def install(actor):
        import os

        gate = actor._receiver.receiver.gate
        enter = gate.enter

        def die(seq):
            enter(seq)
            os._exit(1)

        gate.enter = die
    return install


@pytest.mark.slow
def test_a_peer_dying_mid_broadcast_is_an_error_the_driver_heals(ray_env, pools_cfg):
    """A rollout actor dies inside the broadcast, after every member passed the gate: the
    learner's send fails with an error instead of hanging (or aborting), and the driver's
    ``sync_weights`` replaces the actor, re-forms the group and sends again."""
    ray, _ = ray_env
    from dataclasses import replace

    from cluster.elastic import sync_all
    from launch.scoring import sync_weights

    pools, cfg = pools_cfg
    short = SimpleNamespace(**vars(cfg))
    short.cluster = replace(cfg.cluster, weight_sync_timeout_s=3.0)
    sync_all(pools, short)
    dying = pools.rollout[0]
    ray.get(dying.__ray_call__.remote(_die_after_the_gate()))
    v = train_step(ray, pools, seed=13)
    t0 = time.monotonic()
    version, sync = sync_weights(pools, short)
    assert version == v and sync["weights/max_rel_diff"] == 0.0
    assert time.monotonic() - t0 < 60
    assert pools.rollout[0] is not dying
    assert_in_sync(ray, pools, v)
    sync_all(pools, cfg)                           # back to the fixture's timeout


def _await_restart(ray, actor, timeout_s: float = 60.0) -> None:
    """Until the actor answers from its restarted process (fresh: no weight receiver); a call right
    after ``ray.kill`` may still reach the old process, or fail while Ray restarts it."""
    from ray.exceptions import RayActorError

    from cluster.elastic import _joined

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if not ray.get(actor.__ray_call__.remote(_joined), timeout=timeout_s):
                return
        except RayActorError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the killed actor was not restarted by Ray")


@pytest.mark.slow
def test_a_resize_request_lands_rollouts_in_flight_then_grows_and_shrinks_the_pool(
        ray_env, pools_cfg, tmp_path):
    """``python -m launch.resize RUN rollout=2`` as the driver applies it between steps: the batch
    in flight lands in the buffer first (no actor with work is removed, no sample lost), the new
    actor holds the learner's weights, the config records the size; then back to one."""
    ray, _ = ray_env
    from collections import deque

    from buffer import BufferConfig, ReplayBuffer
    from cluster.pools import broadcast_weights
    from launch.resize import REQUEST, apply_requested, request
    from launch.rollouts import PromptSampler, launch_rollouts

    pools, cfg = pools_cfg
    pools.buffer = ray.remote(num_cpus=0)(ReplayBuffer).remote(BufferConfig())
    (tmp_path / "config.yaml").write_text("{}")
    v = train_step(ray, pools, seed=11)
    broadcast_weights(pools)
    problems = [Problem(i, f"sum a{i}b3", str(i + 3)) for i in range(4)]
    in_flight = deque([launch_rollouts(pools, PromptSampler(problems, 2, 0), v)])
    request(tmp_path, {"rollout": 2})
    assert apply_requested(tmp_path, in_flight, pools, cfg, v) == {
        "resize/rollout_actors": 2, "resize/scorer_actors": 1}
    assert list(in_flight) == [[]] and not (tmp_path / REQUEST).exists()
    assert ray.get(pools.buffer.stats.remote())["generated_rows"] == 4  # the batch landed
    assert pools.rollout_ids == [0, 1] and cfg.rollout.num_actors == 2
    assert_in_sync(ray, pools, v)
    request(tmp_path, {"rollout": 1})
    apply_requested(tmp_path, deque(), pools, cfg, v)
    assert pools.rollout_ids == [0] and cfg.rollout.num_actors == 1
    assert_in_sync(ray, pools, v)
