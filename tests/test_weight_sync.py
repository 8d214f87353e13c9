"""Weight broadcast over a standalone gloo group: 1 sender + 2 receivers in separate processes."""
from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest
import torch

from cluster.weight_sync import (WeightReceiver, WeightSender, free_port, plan_buckets,
                                 weight_spec)
from common.modeling import checksum


class _Net(torch.nn.Module):
    """Mixed dtypes and odd sizes so buckets split on dtype and on size."""

    def __init__(self, seed: int, wide: int = 7):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Parameter(torch.randn(13, wide, generator=g))
        self.b = torch.nn.Parameter(torch.randn(5, generator=g))
        self.c = torch.nn.Parameter(torch.randn(3, 4, generator=g).to(torch.bfloat16))
        self.d = torch.nn.Parameter(torch.randn(300, generator=g))


def _scenario(rank, world, port, seed, wide, versions):
    """One group: rank 0 sends ``versions`` (changing weights in between), the others receive."""
    net = _Net(seed, wide)
    if rank == 0:
        s = WeightSender("127.0.0.1", port, world, weight_spec(net), bucket_bytes=256, timeout_s=30)
        for v in versions:
            s.send(net.named_parameters(), v)
            with torch.no_grad():  # change weights so the second round is a real update
                net.a.add_(1.0)
        return None
    # receivers hold an all-fp32 model: the wire dtypes are the sender's (c is bf16)
    r = WeightReceiver("127.0.0.1", port, rank, world, weight_spec(net.float()), timeout_s=30)
    got = []
    for _ in versions:
        v, named = r.receive()
        got.append((v, checksum(named), [n for n, _ in named], {n: str(t.dtype) for n, t in named}))
    return got


def _worker(rank, world, ports, q):
    """Both scenarios in one process each (process start-up dominates these tests' time)."""
    torch.set_num_threads(1)
    out = {}
    for name, port, wide in (("good", ports[0], 7), ("mismatch", ports[1], 8 if rank == 2 else 7)):
        try:
            out[name] = ("ok", _scenario(rank, world, port, 100 + rank, wide, [3, 4]))
        except Exception as e:  # report to the parent instead of dying silently
            out[name] = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    q.put((rank, out))


@pytest.fixture(scope="module")
def results():
    """{scenario: {rank: (status, payload)}} from 3 processes: sender + 2 receivers."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = [free_port(), free_port()]
    procs = [ctx.Process(target=_worker, args=(r, 3, ports, q)) for r in range(3)]
    for p in procs:
        p.start()
    res: dict = {"good": {}, "mismatch": {}}
    for _ in procs:
        rank, out = q.get(timeout=120)
        for name, value in out.items():
            res[name][rank] = value
    for p in procs:
        p.join(timeout=30)
    return res


def test_plan_buckets_splits_on_dtype_and_size():
    spec = weight_spec(_Net(0))
    buckets = plan_buckets(spec, bucket_bytes=256)
    assert all(len({spec[i][2] for i, _, _ in b.entries}) == 1 for b in buckets)
    assert sum(len(b.entries) for b in buckets) == len(spec)
    # 'd' (1200 bytes) is larger than a bucket and travels alone
    assert any(b.entries == ((3, 0, 300),) for b in buckets)


def test_broadcast_three_processes_checksums_and_version(results):
    res = results["good"]
    assert all(s == "ok" for s, _ in res.values()), res
    sender = _Net(100)
    expected = [checksum(sender.named_parameters())]
    with torch.no_grad():
        sender.a.add_(1.0)
    expected.append(checksum(sender.named_parameters()))
    for rank in (1, 2):
        got = res[rank][1]
        assert [g[0] for g in got] == [3, 4]
        assert [g[1] for g in got] == pytest.approx(expected, rel=1e-12)
        assert got[0][2] == ["a", "b", "c", "d"]
        assert got[0][3]["c"] == "torch.bfloat16" and got[0][3]["a"] == "torch.float32"


def test_mismatched_spec_fails_everywhere_with_clear_error(results):
    res = results["mismatch"]  # rank 2's model differs
    assert all(s == "error" for s, _ in res.values()), res
    for _, msg in res.values():
        assert "spec mismatch" in msg
        assert "rank 2: entry 0: receiver has ['a', [13, 8]" in msg and "sender has ['a', [13, 7]" in msg


def test_group_re_forms_on_a_new_port_in_the_same_processes():
    """After close(), the same sender/receiver processes join a fresh group (actor restart,
    pool resize) and weights keep flowing; threads stand in for processes here."""
    import threading

    net = _Net(1)
    spec = weight_spec(net)
    got = []

    def receiver(port):
        r = WeightReceiver("127.0.0.1", port, 1, 2, spec, timeout_s=30)
        got.append(r.receive()[0])
        r.close()

    for version in (1, 2):
        port = free_port()
        th = threading.Thread(target=receiver, args=(port,))
        th.start()
        s = WeightSender("127.0.0.1", port, 2, spec, timeout_s=30)
        s.send(net.named_parameters(), version)
        th.join(30)
        s.close()
    assert got == [1, 2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_nccl_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="nccl' needs a CUDA build"):
        WeightSender("127.0.0.1", free_port(), 1, weight_spec(_Net(0)), backend="nccl", timeout_s=5)
    with pytest.raises(ValueError, match="'gloo' or 'nccl'"):
        WeightSender("127.0.0.1", free_port(), 1, weight_spec(_Net(0)), backend="mpi")


def test_sender_store_listens_on_its_host_only():
    """TCPStore's own server would listen on every interface ("::"); ours is bound to the host."""
    import os

    import psutil

    def listening():
        return {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and c.pid == os.getpid()}

    before = listening()
    port = free_port()
    s = WeightSender("127.0.0.1", port, 1, weight_spec(_Net(0)), timeout_s=5)
    new = listening() - before  # the store's server, and gloo's own pair listener
    assert ("127.0.0.1", port) in new and {ip for ip, _ in new} == {"127.0.0.1"}
    s.close()
