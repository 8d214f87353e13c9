"""Crash recovery: SIGKILL mid-stream, truncated and corrupted segments."""
import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest

from buffer import BufferConfig, ReplayBuffer, SegmentCorrupt
from buffer.synth import dense_scores, synthetic_rows

CHILD = textwrap.dedent("""
    import sys
    from buffer import BufferConfig, ReplayBuffer
    from buffer.synth import dense_scores, synthetic_rows
    root, fsync, g = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
    buf = ReplayBuffer(BufferConfig(fsync=fsync, capacity=10**6, segment_rows=64), root)
    def say(*words):
        print(*words, flush=True)
    say("LIVE", *buf.live_sample_ids())
    p = buf.pending_scoring(10**6)
    say("UNSCORED", *p.column("sample_id").to_pylist())
    while True:
        rows = synthetic_rows(1, 4, first_group=g, response_len=(4, 64), seed=g)
        say("WILL append", *[r["sample_id"] for r in rows])
        buf.append(rows)
        say("DID")
        p = buf.pending_scoring(3)                 # scoring lags and splits groups
        say("WILL score", *p.column("sample_id").to_pylist())
        buf.set_scores(p.column("sample_id").to_pylist(), dense_scores(p), 1)
        say("DID")
        b = buf.sample_batch(1, 0)
        if b is not None:
            say("WILL consume", *b.column("sample_id").to_pylist())
            buf.mark_consumed(b.column("sample_id").to_pylist())
            say("DID")
        g += 1
""")


def run_and_kill(root, fsync, first_group, kill_after_lines, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(script), root, str(int(fsync)), str(first_group)],
                            stdout=subprocess.PIPE, text=True, env=env)
    lines = []
    while len(lines) < kill_after_lines:
        line = proc.stdout.readline()
        assert line, f"child exited early (rc={proc.poll()})"
        lines.append(line.split())
    os.kill(proc.pid, signal.SIGKILL)                  # lands wherever the child is
    rest, _ = proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    lines += [ln.split() for ln in rest.splitlines()]
    return lines


def replay_log(lines):
    """(live, scored, in-flight op) from the child's acknowledged operations."""
    assert lines[0][0] == "LIVE" and lines[1][0] == "UNSCORED"
    live = set(lines[0][1:])
    scored = live - set(lines[1][1:])
    pending = None
    for words in lines[2:]:
        if words[0] == "WILL":
            pending = (words[1], set(words[2:]))
        elif words == ["DID"]:
            op, ids = pending
            if op == "append":
                live |= ids
            elif op == "score":
                scored |= ids
            else:
                live -= ids
            pending = None
    return live, scored & live, pending


def check_recovered(root, lines, fsync):
    live, scored, pending = replay_log(lines)
    buf = ReplayBuffer(BufferConfig(fsync=fsync, capacity=10**6), root)
    got = buf.live_sample_ids()
    assert len(got) == len(set(got)), "duplicated samples after recovery"
    got = set(got)
    got_scored = got - set(buf.pending_scoring(10**6).column("sample_id").to_pylist())
    options = [(live, scored)]
    if pending is not None:                            # the in-flight op is all or nothing
        op, ids = pending
        options.append({"append": (live | ids, scored), "score": (live, scored | (ids & live)),
                        "consume": (live - ids, scored - ids)}[op])
    assert (got, got_scored) in options, (
        f"lost {sorted(live - got)[:5]}, extra {sorted(got - live)[:5]}, in flight {pending}")
    return len(got)


@pytest.mark.parametrize("fsync", [False, True])
def test_sigkill_mid_stream_loses_and_duplicates_nothing(tmp_path, fsync):
    root = str(tmp_path / "buf")
    rng = random.Random(1234 + fsync)
    first = 0
    for _ in range(2):                                 # kill, restart on the same root, kill
        lines = run_and_kill(root, fsync, first, rng.randint(30, 90), tmp_path)
        check_recovered(root, lines, fsync)
        first += 1000
    assert not any(n.endswith(".tmp") for n in os.listdir(root))


def _filled(root, n_segments=3):
    cfg = BufferConfig(fsync=False, segment_rows=4)
    buf = ReplayBuffer(cfg, root)
    buf.append(synthetic_rows(n_segments, 4))
    p = buf.pending_scoring(100)
    buf.set_scores(p.column("sample_id").to_pylist(), dense_scores(p), 1)
    return cfg, sorted(f for f in os.listdir(root) if f.startswith("data-"))


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_segment_is_named_quarantined_and_rest_recovered(tmp_path, damage):
    root = str(tmp_path / "buf")
    cfg, data = _filled(root)
    victim = os.path.join(root, data[1])                  # group g1's rows
    raw = open(victim, "rb").read()
    raw = raw[: len(raw) // 2] if damage == "truncate" else \
        raw[:100] + bytes([raw[100] ^ 0xFF]) + raw[101:]
    open(victim, "wb").write(raw)
    with pytest.warns(RuntimeWarning, match=data[1]):
        buf = ReplayBuffer(cfg, root)
    assert sorted(buf.live_sample_ids()) == [f"g{g}-{i}" for g in (0, 2) for i in range(4)]
    assert buf.stats()["ready_groups"] == 2 and buf.stats()["quarantined_segments"] == 1
    err = buf._store.quarantined[0]
    assert isinstance(err, SegmentCorrupt) and err.path == victim
    assert buf.quarantined() == [str(err)] and victim in str(err) and "corrupt" in str(err)
    assert not os.path.exists(victim)
    assert os.path.exists(os.path.join(root, "quarantine", data[1]))
    again = ReplayBuffer(cfg, root)                       # quarantine is not re-read
    assert len(again.live_sample_ids()) == 8 and again.stats()["quarantined_segments"] == 0


def test_bad_schema_and_leftover_temp_files(tmp_path):
    root = str(tmp_path / "buf")
    cfg, data = _filled(root, 1)
    tmp = os.path.join(root, f".{data[0]}.tmp")
    open(tmp, "wb").write(b"half a write")
    with pytest.warns(RuntimeWarning, match="stray.arrow"):
        open(os.path.join(root, "stray.arrow"), "wb").write(b"x")
        buf = ReplayBuffer(cfg, root)
    assert not os.path.exists(tmp) and len(buf.live_sample_ids()) == 4
