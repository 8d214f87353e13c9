"""ReplayBuffer.snapshot/restore: the buffer part of a run checkpoint."""
from __future__ import annotations

import pytest

from buffer import BufferConfig, ReplayBuffer
from buffer.synth import dense_scores, synthetic_rows

CFG = dict(capacity=1000, segment_rows=8, fsync=False)


def _state(buf: ReplayBuffer) -> tuple:
    s = buf.stats()
    return (buf.live_sample_ids(), s["generated_rows"], s["scored_rows_live"], s["ready_groups"])


def test_snapshot_restores_exact_state_and_later_writes_do_not_leak(tmp_path):
    buf = ReplayBuffer(BufferConfig(**CFG), str(tmp_path / "a"))
    buf.append(synthetic_rows(3, 4))
    p = buf.pending_scoring(6)                       # half scored: a mixed state
    buf.set_scores(p.column("sample_id").to_pylist(), dense_scores(p), 1)
    before = _state(buf)
    assert before[3] == 1  # one whole group scored, ready to train
    assert buf.snapshot(str(tmp_path / "snap")) > 0
    # the source keeps working after the snapshot; its later writes must not reach the copy
    b = buf.sample_batch(1, 1)
    buf.mark_consumed(b.column("sample_id").to_pylist())
    buf.append(synthetic_rows(2, 4, first_group=10))
    rest = ReplayBuffer(BufferConfig(**CFG), str(tmp_path / "b"))
    assert rest.restore(str(tmp_path / "snap")) == len(before[0])
    assert _state(rest) == before
    # a restored buffer serves the same rows: scoring and sampling go on from there
    q = rest.pending_scoring(100)
    assert sorted(q.column("sample_id").to_pylist()) == sorted(
        s for s in before[0] if s not in p.column("sample_id").to_pylist())


def test_snapshot_and_restore_refuse_what_they_cannot_do(tmp_path):
    mem = ReplayBuffer(BufferConfig(**CFG))
    with pytest.raises(ValueError, match="buffer.root"):
        mem.snapshot(str(tmp_path / "s"))
    buf = ReplayBuffer(BufferConfig(**CFG), str(tmp_path / "a"))
    buf.append(synthetic_rows(1, 4))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        buf.snapshot(str(tmp_path / "full"))
    buf.snapshot(str(tmp_path / "s"))
    with pytest.raises(ValueError, match="already holds data"):
        buf.restore(str(tmp_path / "s"))
    fresh = ReplayBuffer(BufferConfig(**CFG), str(tmp_path / "c"))
    with pytest.raises(FileNotFoundError, match="missing"):
        fresh.restore(str(tmp_path / "missing"))
