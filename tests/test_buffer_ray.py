"""Several producers, a scorer and several consumers at once through a Ray actor."""
import shutil
import tempfile
import time

import pytest

ray = pytest.importorskip("ray")

from buffer import BufferConfig, ReplayBuffer  # noqa: E402
from buffer.synth import dense_scores, synthetic_rows  # noqa: E402

N_PRODUCERS, GROUPS_EACH, G = 2, 6, 4


@ray.remote(num_cpus=0)
def produce(buf, producer):
    retries = 0
    for g in range(GROUPS_EACH):
        rows = synthetic_rows(1, G, first_group=g, prefix=f"p{producer}-", seed=producer * 100 + g)
        while ray.get(buf.try_append.remote(rows)) is None:      # full: back off, retry
            retries += 1
            time.sleep(0.02)
    return retries


@ray.remote(num_cpus=0)
def score(buf, total):
    scored = 0
    while scored < total:
        p = ray.get(buf.pending_scoring.remote(3))
        if p.num_rows == 0:
            time.sleep(0.01)
            continue
        scored += ray.get(buf.set_scores.remote(p.column("sample_id").to_pylist(),
                                                dense_scores(p), 1))
    return scored


@ray.remote(num_cpus=0)
def consume(buf, total, deadline):
    got = []
    while time.time() < deadline:
        b = ray.get(buf.sample_batch.remote(1, 0))
        if b is None:
            if ray.get(buf.stats.remote())["consumed_rows"] >= total:
                break
            time.sleep(0.01)
            continue
        ids = b.column("sample_id").to_pylist()
        ray.get(buf.mark_consumed.remote(ids))
        got += ids
    return got


def test_many_producers_and_consumers_lose_and_duplicate_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")      # else Ray writes $HOME/.ray/auth_token
    temp = tempfile.mkdtemp(prefix="rbuf", dir="/tmp")       # short path: Ray socket limits
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, log_to_driver=False)
    try:
        cfg = BufferConfig(capacity=3 * G, fsync=False)      # smaller than the stream: backpressure
        buf = ray.remote(ReplayBuffer).options(num_cpus=0).remote(cfg, str(tmp_path / "buf"))
        total = N_PRODUCERS * GROUPS_EACH * G
        deadline = time.time() + 60
        consumers = [consume.remote(buf, total, deadline) for _ in range(2)]
        scorer = score.remote(buf, total)
        retries = ray.get([produce.remote(buf, p) for p in range(N_PRODUCERS)])
        assert ray.get(scorer) == total
        got = [s for ids in ray.get(consumers) for s in ids]
        want = {f"p{p}-{g}-{i}" for p in range(N_PRODUCERS) for g in range(GROUPS_EACH)
                for i in range(G)}
        assert len(got) == len(set(got)), "a sample was trained on twice"
        assert set(got) == want, f"missing {sorted(want - set(got))[:5]}"
        stats = ray.get(buf.stats.remote())
        assert stats["live_rows"] == 0 and stats["duplicate_rows"] == 0
        assert sum(retries) == stats["full_rejections"]
        print("full rejections (retried):", stats["full_rejections"])
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
