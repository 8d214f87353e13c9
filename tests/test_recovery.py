"""A buffer actor killed mid-run (launch/recovery.py): the driver's next call re-creates it from its
segment files and is repeated; no row is lost and none is handed out for training twice, including
when the kill lands while the driver holds a (PODS-cut) training batch, or after its mark_consumed
was written but before the answer came back. Where that is impossible the run stops naming the
resume= to run. Real Ray actors (the local Ray of launch/train.py) on real segment files."""
from __future__ import annotations

import functools
import os
import shutil
import signal
import time
from types import SimpleNamespace

import pytest

from buffer import BufferConfig, PodsConfig
from buffer.synth import dense_scores, synthetic_rows
from cluster.config import ClusterConfig
from cluster.pools import Pools, spawn_buffer
from launch.recovery import BufferLost, call


def _pools(tmp_path, root="buffer", **buffer_kw) -> Pools:
    cfg = SimpleNamespace(cluster=ClusterConfig(buffer_cpus=0.1),
                          buffer=BufferConfig(fsync=False, capacity=64, **buffer_kw))
    root = str(tmp_path / root) if root else None
    pools = Pools(buffer_root=root, spawn_buffer=functools.partial(spawn_buffer, cfg, root),
                  run_dir=str(tmp_path))
    pools.buffer = pools.spawn_buffer()
    return pools


def _fill(pools, n_groups: int, group_size: int = 4) -> None:
    """Append groups and score every row, through the driver's calls."""
    call(pools, "append", synthetic_rows(n_groups, group_size, seed=1))
    pending = call(pools, "pending_scoring", 64)
    call(pools, "set_scores", pending.column("sample_id").to_pylist(), dense_scores(pending), 0)


def _kill(ray, actor) -> None:
    """SIGKILL the actor's process (a crash, not a polite ``ray.kill``) and wait until it is gone."""
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 30
    while time.time() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.05)


def _ids(batch) -> list[str]:
    return batch.column("sample_id").to_pylist()


def test_killed_between_calls_comes_back_with_every_row(local_ray, tmp_path):
    pools = _pools(tmp_path)
    _fill(pools, 3)
    before = call(pools, "stats")
    old = pools.buffer
    _kill(local_ray, pools.buffer)
    st = call(pools, "stats")  # this call meets the dead actor: re-created, repeated
    assert pools.buffer is not old and pools.faults["faults/buffer_restarts"] == 1
    assert st["live_rows"] == before["live_rows"] == 12 and st["ready_groups"] == 3
    assert st["recovered_rows"] == 12 and st["root_existed"]
    seen = []
    while (batch := call(pools, "sample_batch", 1, 0)) is not None:
        seen += _ids(batch)
        call(pools, "mark_consumed", _ids(batch))
    assert sorted(seen) == sorted(f"g{g}-{i}" for g in range(3) for i in range(4))


def test_killed_while_the_driver_trains_on_a_pods_cut_batch(local_ray, tmp_path):
    """The training lease is taken again on the new actor: consuming the batch drops the rest of
    its groups (the PODS cut), so no discarded row reaches a later batch."""
    pools = _pools(tmp_path, group_size=4, pods=PodsConfig(enabled=True, keep=2))
    _fill(pools, 2)
    batch = call(pools, "sample_batch", 1, 0)
    trained = _ids(batch)
    assert len(trained) == 2 and pools.buffer_lease is not None
    _kill(local_ray, pools.buffer)  # dies while the learner runs
    assert call(pools, "mark_consumed", trained) == 2
    assert pools.faults["faults/buffer_restarts"] == 1 and pools.buffer_lease is None
    st = call(pools, "stats")
    assert st["live_rows"] == 4 and st["pods_dropped_rows"] == 2  # group 0's other two dropped
    nxt = call(pools, "sample_batch", 1, 0)
    assert {s.split("-")[0] for s in _ids(nxt)} == {"g1"} and not set(_ids(nxt)) & set(trained)


def test_killed_after_mark_consumed_was_written(local_ray, tmp_path):
    """Only the answer was lost: the lease is recognised as consumed and nothing is re-leased."""
    pools = _pools(tmp_path)
    _fill(pools, 2)
    trained = _ids(call(pools, "sample_batch", 1, 0))
    local_ray.get(pools.buffer.mark_consumed.remote(trained))  # written; the driver never hears
    _kill(local_ray, pools.buffer)
    assert call(pools, "mark_consumed", trained) == 0        # repeated: nothing left to consume
    assert pools.buffer_lease is None and pools.faults["faults/buffer_restarts"] == 1
    nxt = _ids(call(pools, "sample_batch", 1, 0))
    assert len(nxt) == 4 and not set(nxt) & set(trained)
    assert call(pools, "sample_batch", 1, 0) is None         # nothing else is left


def test_a_buffer_without_segments_stops_with_the_resume_to_run(local_ray, tmp_path):
    pools = _pools(tmp_path, root=None)                      # rows in memory only
    _fill(pools, 1)
    _kill(local_ray, pools.buffer)
    with pytest.raises(BufferLost, match=r"in memory only \(buffer.root unset\); no checkpoint yet"):
        call(pools, "stats")

    pools = _pools(tmp_path, root="elsewhere")
    ckpt = tmp_path / "checkpoints" / "step-000002"
    for folder in ("deepspeed/global_step2", "hf", "buffer"):  # every part of a complete one
        (ckpt / folder).mkdir(parents=True)
    (ckpt / "deepspeed" / "latest").write_text("global_step2")
    for name in ("hf/config.json", "trainer_state.json", "config.yaml"):
        (ckpt / name).write_text("{}")
    _fill(pools, 1)
    _kill(local_ray, pools.buffer)
    shutil.rmtree(pools.buffer_root)  # as if the new actor ran on a node that cannot see it
    with pytest.raises(BufferLost, match=r"finds no .*elsewhere.*shared storage\); continue "
                                         rf"with: python launch/train.py resume={ckpt}$"):
        call(pools, "append", synthetic_rows(1, 4, first_group=5))
    assert pools.faults["faults/buffer_restarts"] == 0
