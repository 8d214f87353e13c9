"""buffer.stale_policy=requeue end to end at the driver: a group that went stale in the buffer has
its prompt generated again, first in the next rollout launch, and a checkpointed sampler keeps the
prompts it has not drawn yet."""
from __future__ import annotations

from types import SimpleNamespace

from buffer import BufferConfig, ReplayBuffer
from buffer.synth import dense_scores, synthetic_rows
from launch.rollouts import PromptSampler, launch_rollouts
from tasks.base import Problem


def test_sampler_draws_requeued_prompts_first_and_checkpoints_them():
    problems = [Problem(i, f"p{i}", "0") for i in range(10)]
    a = PromptSampler(problems, 3, seed=0)
    fresh = [p.idx for p in PromptSampler(problems, 3, seed=0).next()]
    a.requeue([7, 8, 9, 4])
    assert [p.idx for p in a.next()] == [7, 8, 9]       # a whole batch of requeued ones
    pos = a.position()
    assert pos["requeued"] == [4]
    b = PromptSampler(problems, 3, seed=0)
    b.restore(pos)
    assert [p.idx for p in b.next()] == [4, *fresh[:2]] == [p.idx for p in a.next()]


def test_stale_group_in_the_buffer_is_generated_again(local_ray):
    ray = local_ray
    buf = ray.remote(num_cpus=0.1)(ReplayBuffer).remote(
        BufferConfig(max_staleness=1, stale_policy="requeue"), None)
    ray.get(buf.append.remote(synthetic_rows(1, 2, version=0, prefix="old", first_group=5)))
    ray.get(buf.append.remote(synthetic_rows(1, 2, version=2, prefix="new", first_group=1)))
    pending = ray.get(buf.pending_scoring.remote(100))
    ray.get(buf.set_scores.remote(pending.column("sample_id").to_pylist(), dense_scores(pending), 2))
    ray.get(buf.sample_batch.remote(1, 2))             # group "old5" (version 0) is now stale

    launched = []

    class Rollout:
        def remote(self, chunk, version, batch):
            launched.append([p.idx for p in chunk])

    problems = [Problem(i, f"p{i}", "0") for i in range(8)]
    sampler = PromptSampler(problems, 2, seed=0)
    fresh = [p.idx for p in PromptSampler(problems, 2, seed=0).next()]
    pools = SimpleNamespace(rollout=[SimpleNamespace(rollout=Rollout())], rollouts_ahead=1,
                            requeue=True, buffer=buf)
    launch_rollouts(pools, sampler, 2)
    assert launched == [[5, fresh[0]]]
    assert ray.get(buf.stats.remote())["requeue_pending_groups"] == 0   # taken, once
    launch_rollouts(pools, sampler, 2)                  # nothing requeued: fresh draws only
    assert launched[1][0] == fresh[1]
