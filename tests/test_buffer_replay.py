import os
import time

import numpy as np
import pyarrow as pa
import pytest

from buffer import BufferConfig, BufferFull, PodsConfig, ReplayBuffer, SCHEMA, StalePolicy
from buffer.pods import max_variance_subset
from buffer.synth import dense_scores, synthetic_rows


def score_all(buf, version=1):
    p = buf.pending_scoring(10_000)
    if p.num_rows:
        buf.set_scores(p.column("sample_id").to_pylist(), dense_scores(p), version)
    return p


@pytest.fixture(params=["memory", "disk"])
def make(request, tmp_path):
    def _make(**kw):
        root = str(tmp_path / "buf") if request.param == "disk" else None
        return ReplayBuffer(BufferConfig(fsync=False, **kw), root=root)
    return _make


def test_lifecycle_whole_groups_fifo(make):
    buf = make(capacity=64)
    ids = buf.append(synthetic_rows(3, 4))
    assert len(ids) == 12 and buf.stats()["generated_rows"] == 12
    assert buf.sample_batch(1, 0) is None                 # nothing scored yet
    first = buf.pending_scoring(6)                        # half of the rows: g0 and half of g1
    assert buf.pending_scoring(6).column("sample_id").to_pylist() == ids[6:]   # leased apart
    buf.set_scores(first.column("sample_id").to_pylist(), dense_scores(first), 1)
    assert buf.sample_batch(2, 0) is None                 # g1 incomplete -> only 1 group ready
    b = buf.sample_batch(1, 0)
    assert b.schema.equals(SCHEMA) and b.column("group_id").unique().to_pylist() == ["g0"]
    assert b.column("scorer_version").to_pylist() == [1] * 4
    assert b.column("state").to_pylist() == ["scored"] * 4
    assert all(len(o) == n for o, n in zip(b.column("old_logprobs").to_pylist(),
                                           b.column("response_len").to_pylist()))
    assert buf.sample_batch(1, 0) is None                 # g0 leased, g1 not complete
    assert buf.mark_consumed(b.column("sample_id").to_pylist()) == 4
    assert buf.mark_consumed(b.column("sample_id").to_pylist()) == 0   # idempotent
    s = buf.stats()
    assert s["live_rows"] == 8 and s["consumed_rows"] == 4


def test_set_scores_ignores_unknown_and_checks_lengths(make):
    buf = make()
    buf.append(synthetic_rows(1, 2, response_len=(3, 3)))
    with pytest.raises(ValueError, match="g0-1"):
        buf.set_scores(["g0-0", "g0-1"], [[0.0] * 3, [0.0] * 2], 1)
    assert buf.set_scores(["nope", "g0-0"], [[0.0], [0.0] * 3], 1) == 1
    assert buf.set_scores(["g0-0"], [[-1.0] * 3], 2) == 0               # first score wins
    assert buf.stats()["score_ignored_rows"] == 2


def test_append_validates_and_dedupes(make):
    buf = make()
    rows = synthetic_rows(1, 2)
    bad = [dict(rows[0], sampler_logprobs=[0.0])]
    with pytest.raises(ValueError, match="sampler_logprobs"):
        buf.append(bad)
    with pytest.raises(ValueError, match="unknown keys"):
        buf.append([dict(rows[0], rewrd=1.0)])
    with pytest.raises(ValueError, match="missing"):
        buf.append([{k: v for k, v in rows[0].items() if k != "reward"}])
    assert buf.append(rows) == ["g0-0", "g0-1"]
    assert buf.append(rows) == ["g0-0", "g0-1"]                         # retry: no duplicate
    assert buf.stats()["live_rows"] == 2 and buf.stats()["duplicate_rows"] == 2
    ids = buf.append([{k: v for k, v in r.items() if k != "sample_id"}
                      for r in synthetic_rows(1, 2, prefix="x")])
    assert len(set(ids)) == 2 and buf.stats()["live_rows"] == 4          # ids generated


def test_append_record_batch(make):
    buf = make()
    rows = synthetic_rows(2, 2)
    batch = pa.RecordBatch.from_pylist(rows)
    assert buf.append(batch) == [r["sample_id"] for r in rows]
    p = buf.pending_scoring(10)
    assert p.column("kv_policy").to_pylist() == ["streaming"] * 4


def test_capacity_backpressure(make):
    buf = make(capacity=8)
    buf.append(synthetic_rows(2, 4))
    with pytest.raises(BufferFull, match="capacity 8") as e:
        buf.append(synthetic_rows(1, 4, first_group=2))
    assert e.value.capacity == 8 and buf.stats()["live_rows"] == 8    # nothing stored
    assert buf.try_append(synthetic_rows(1, 4, first_group=2)) is None
    score_all(buf)
    b = buf.sample_batch(1, 0)
    buf.mark_consumed(b.column("sample_id").to_pylist())
    assert buf.try_append(synthetic_rows(1, 4, first_group=2)) is not None
    assert buf.stats()["full_rejections"] == 2
    with pytest.raises(ValueError, match="exceed buffer.capacity"):
        buf.append(synthetic_rows(3, 4, first_group=10))


@pytest.mark.parametrize("policy", ["drop", "requeue"])
def test_staleness(make, policy):
    buf = make(max_staleness=1, stale_policy=policy)
    buf.append(synthetic_rows(1, 2, version=0, prefix="old"))
    buf.append(synthetic_rows(1, 2, version=2, prefix="new", first_group=7))
    score_all(buf)
    b = buf.sample_batch(1, learner_version=2)          # old (0 < 2 - 1) is stale
    assert b.column("group_id").unique().to_pylist() == ["new7"]
    s = buf.stats()
    if policy == "drop":
        assert s["stale_dropped_groups"] == 1 and s["stale_dropped_rows"] == 2
        assert buf.take_requeued() == []
    else:
        assert s["requeued_groups"] == 1 and s["requeue_pending_groups"] == 1
        assert buf.take_requeued() == [0]
        assert buf.take_requeued() == []
    assert buf.stats()["live_rows"] == 2
    assert buf.stats()["last_batch_staleness_max"] == 0.0


def test_stale_unscored_rows_leave_scoring_queue(make):
    buf = make(max_staleness=0)
    buf.append(synthetic_rows(1, 2, version=5, prefix="a"))
    score_all(buf)
    buf.append(synthetic_rows(1, 2, version=0, prefix="b"))
    assert buf.sample_batch(1, 5) is not None
    assert buf.pending_scoring(10).num_rows == 0          # b is stale: not worth scoring


def test_pods_downsampling(make):
    buf = make(pods=PodsConfig(enabled=True, keep=3))
    rows = synthetic_rows(2, 6, seed=4)
    buf.append(rows)
    score_all(buf)
    b = buf.sample_batch(2, 0)
    assert b.num_rows == 6
    for g in ("g0", "g1"):
        rewards = [r["reward"] for r in rows if r["group_id"] == g]
        want = {f"{g}-{i}" for i in max_variance_subset(rewards, 3)}
        got = {s for s in b.column("sample_id").to_pylist() if s.startswith(g + "-")}
        assert got == want
    kept = b.column("sample_id").to_pylist()
    assert buf.mark_consumed(kept[:3]) == 3
    s = buf.stats()
    assert s["pods_dropped_rows"] == 3 and s["live_rows"] == 6    # g1 untouched
    buf.mark_consumed(kept[3:])
    assert buf.stats()["live_rows"] == 0 and buf.stats()["pods_dropped_rows"] == 6


def test_release_and_scoring_lease_expiry(make):
    buf = make(scoring_lease_s=0.05)
    buf.append(synthetic_rows(2, 2))
    assert buf.pending_scoring(10).num_rows == 4
    assert buf.pending_scoring(10).num_rows == 0
    time.sleep(0.06)
    p = buf.pending_scoring(10)                           # first scorer presumed lost
    assert p.num_rows == 4
    buf.set_scores(p.column("sample_id").to_pylist(), dense_scores(p), 1)
    b = buf.sample_batch(2, 0)
    assert buf.sample_batch(1, 0) is None
    assert buf.release(b.column("sample_id").to_pylist()) == 2
    assert buf.sample_batch(2, 0).num_rows == 4


def test_group_size_requires_full_groups(make):
    buf = make(group_size=4)
    buf.append(synthetic_rows(1, 3))
    score_all(buf)
    assert buf.sample_batch(1, 0) is None
    buf.append([dict(synthetic_rows(1, 4)[3])])
    score_all(buf)
    assert buf.sample_batch(1, 0).num_rows == 4


def test_persisted_state_and_gc(tmp_path):
    root = str(tmp_path / "b")
    cfg = BufferConfig(fsync=True, segment_rows=4)
    buf = ReplayBuffer(cfg, root)
    buf.append(synthetic_rows(3, 4))                       # 3 data segments
    score_all(buf)
    b = buf.sample_batch(1, 0)
    buf.mark_consumed(b.column("sample_id").to_pylist())
    again = ReplayBuffer(cfg, root)                         # restart
    assert sorted(again.live_sample_ids()) == sorted(buf.live_sample_ids())
    assert again.stats()["ready_groups"] == 2              # scores survived
    b2 = again.sample_batch(1, 0)
    assert b2.column("old_logprobs").to_pylist() == \
        buf.sample_batch(1, 0).column("old_logprobs").to_pylist()
    for g in range(2):
        bb = again.sample_batch(1, 0) if g else b2
        again.mark_consumed(bb.column("sample_id").to_pylist())
    assert again.stats()["live_rows"] == 0
    assert [f for f in os.listdir(root) if f.endswith(".arrow")] == []   # all retired
    assert again.stats()["memory_bytes"] == 0


def test_restart_keeps_requeued_prompts(tmp_path):
    cfg = BufferConfig(fsync=False, max_staleness=0, stale_policy=StalePolicy.REQUEUE)
    buf = ReplayBuffer(cfg, str(tmp_path))
    buf.append(synthetic_rows(2, 2, version=0))
    assert buf.sample_batch(1, 3) is None
    assert buf.stats()["requeue_pending_groups"] == 2
    again = ReplayBuffer(cfg, str(tmp_path))
    assert sorted(again.take_requeued()) == [0, 1]
    assert ReplayBuffer(cfg, str(tmp_path)).take_requeued() == []


def test_rows_appended_with_scores_are_scored(make):
    buf = make()
    rows = synthetic_rows(2, 2)
    for r in rows[:2]:                                   # group g0 arrives already scored
        r["old_logprobs"], r["scorer_version"] = r["sampler_logprobs"], 7
        r["state"] = "consumed"                           # ignored: data rows start generated
    rows[2]["sample_id"] = None                           # derived where missing
    ids = buf.append(rows)
    assert ids[2] is not None and len(set(ids)) == 4
    assert buf.pending_scoring(10).column("sample_id").to_pylist() == ids[2:]
    b = buf.sample_batch(1, 0)
    assert b.column("scorer_version").to_pylist() == [7, 7]
    assert b.column("old_logprobs").to_pylist() == b.column("sampler_logprobs").to_pylist()
