"""Weight broadcast over a standalone gloo group: 1 sender + 2 receivers in separate processes."""
from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest
import torch

from cluster.weight_sync import (DIRECT_BYTES, WeightReceiver, WeightSender, free_port,
                                 plan_buckets, weight_spec)
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


class _BigNet(torch.nn.Module):
    """One tensor above DIRECT_BYTES (travels alone, in place) between small packed ones."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.small = torch.nn.Parameter(torch.randn(10, generator=g))
        self.big = torch.nn.Parameter(torch.randn(DIRECT_BYTES // 4 + 3, generator=g))
        self.lowp = torch.nn.Parameter(torch.randn(DIRECT_BYTES // 2 + 1, generator=g).bfloat16())
        self.tail = torch.nn.Parameter(torch.randn(7, 3, generator=g))
        self.tail2 = torch.nn.Parameter(torch.randn(5, generator=g))


def _big_scenario(rank, world, port, versions, shm):
    """Rank 1 receives into its model's parameters (``into``), rank 2 into the receiver's buffers;
    through the shared-memory ring (``shm``) or gloo over TCP."""
    net = _BigNet(100 + rank)
    if rank == 0:
        s = WeightSender("127.0.0.1", port, world, weight_spec(net), bucket_bytes=4096, timeout_s=30,
                         same_host_shm=shm)
        for v in versions:
            info = s.send(net.named_parameters(), v)
            with torch.no_grad():
                net.big.mul_(2.0)
        return sorted(s._flats), info["transport"]  # buckets that needed a staging copy
    net = net.float()  # fp32 destinations: the bf16 tensor is cast on the way in
    r = WeightReceiver("127.0.0.1", port, rank, world, weight_spec(net), timeout_s=30)
    params = dict(net.named_parameters())
    got = []
    for _ in versions:
        if rank == 1:
            v, named = r.receive(into=params)
            landed = {n: t.data_ptr() == params[n].data_ptr() for n, t in named}
            got.append((v, checksum(net.named_parameters()), landed, sorted(r._flats)))
        else:
            v, named = r.receive()
            got.append((v, checksum(named), {n: t.data_ptr() for n, t in named}))
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
    for name, port, shm in (("big_shm", ports[2], True), ("big_tcp", ports[3], False)):
        try:
            out[name] = ("ok", _big_scenario(rank, world, port, [5, 6], shm))
        except Exception as e:
            out[name] = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    q.put((rank, out))


@pytest.fixture(scope="module")
def results():
    """{scenario: {rank: (status, payload)}} from 3 processes: sender + 2 receivers."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = [free_port() for _ in range(4)]
    procs = [ctx.Process(target=_worker, args=(r, 3, ports, q)) for r in range(3)]
    for p in procs:
        p.start()
    res: dict = {"good": {}, "mismatch": {}, "big_shm": {}, "big_tcp": {}}
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


def test_plan_buckets_sends_large_tensors_alone():
    spec = weight_spec(_BigNet(0))
    buckets = plan_buckets(spec, bucket_bytes=4096)
    # small | big alone | lowp alone (bf16, over DIRECT_BYTES) | tail + tail2 packed
    assert [b.entries for b in buckets] == [((0, 0, 10),), ((1, 0, spec[1][1][0]),),
                                            ((2, 0, spec[2][1][0]),), ((3, 0, 21), (4, 21, 5))]
    # with bigger buckets the small ones still pack, but never with a large one
    packed = plan_buckets(weight_spec(_Net(0)) + spec, bucket_bytes=64 << 20)
    assert all(len(b.entries) == 1 for b in packed if b.numel * 4 >= DIRECT_BYTES)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_large_tensors_in_place_and_into_destinations(results, transport):
    res = results[f"big_{transport}"]
    assert all(s == "ok" for s, _ in res.values()), res
    sender = _BigNet(100)
    expected = [checksum(sender.named_parameters())]
    with torch.no_grad():
        sender.big.mul_(2.0)
    expected.append(checksum(sender.named_parameters()))
    into, plain = res[1][1], res[2][1]
    assert [g[0] for g in into] == [g[0] for g in plain] == [5, 6]
    assert [g[1] for g in into] == pytest.approx(expected, rel=1e-12)
    assert [g[1] for g in plain] == pytest.approx(expected, rel=1e-12)
    # the fp32 'big' landed in the parameter itself; bf16 'lowp' was cast into it; all are params
    assert all(into[0][2].values()) and all(into[1][2].values())
    # staged buckets: only the packed one on the sender (lone tensors go out in place); the
    # receiver also stages the bf16 one, which its fp32 parameter cannot take off the wire
    assert res[0][1] == ([3], "shm" if transport == "shm" else "gloo") and into[1][3] == [2, 3]
    # without ``into`` the receiver reuses its buffers: no fresh allocation per broadcast
    assert plain[0][2] == plain[1][2]


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


def test_ring_only_when_every_receiver_maps_it(monkeypatch):
    """A receiver that cannot map the sender's shared-memory file (another machine) makes the
    whole group fall back to gloo over TCP; the file never outlives group formation."""
    import os
    import threading

    from cluster.shm_ring import SHM_DIR

    net = _Net(2)
    spec = weight_spec(net)
    results = {}

    def receiver(port, rank, blind):
        r = WeightReceiver("127.0.0.1", port, rank, 3, spec, timeout_s=30)
        if blind:
            assert r.ring is None
        results[rank] = (r.receive()[0], r.ring is not None)

    real_map = WeightReceiver._map_shm
    monkeypatch.setattr(WeightReceiver, "_map_shm",  # rank 2 plays the remote one
                        lambda self, offer: False if self.rank == 2 else real_map(self, offer))
    for blind, want in ((True, "gloo"), (False, "shm")):
        if not blind:
            monkeypatch.setattr(WeightReceiver, "_map_shm", real_map)
        port = free_port()
        ths = [threading.Thread(target=receiver, args=(port, r, blind)) for r in (1, 2)]
        for th in ths:
            th.start()
        s = WeightSender("127.0.0.1", port, 3, spec, timeout_s=30)
        assert not [f for f in os.listdir(SHM_DIR) if str(os.getpid()) in f]  # unlinked already
        info = s.send(net.named_parameters(), 7)
        for th in ths:
            th.join(30)
        s.close()
        assert info["transport"] == want
        assert results == {1: (7, want == "shm"), 2: (7, want == "shm")}


def test_full_shared_memory_falls_back_to_tcp(monkeypatch):
    """No room in /dev/shm (the reservation fails) is TCP, not a SIGBUS later; no file is left."""
    import errno
    import os
    import threading

    from cluster.shm_ring import SHM_DIR

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    net = _Net(3)
    spec, got, port = weight_spec(net), [], free_port()
    th = threading.Thread(target=lambda: got.append(
        WeightReceiver("127.0.0.1", port, 1, 2, spec, timeout_s=30).receive()[0]))
    th.start()
    s = WeightSender("127.0.0.1", port, 2, spec, timeout_s=30)
    assert s.ring is None and not [f for f in os.listdir(SHM_DIR) if str(os.getpid()) in f]
    assert s.send(net.named_parameters(), 9)["transport"] == "gloo"
    th.join(30)
    assert got == [9]


def test_failed_formation_leaves_no_shm_ring():
    """A receiver that never joins: the sender's formation times out, and the same-machine ring it
    created for the group is unlinked, not left in /dev/shm."""
    import glob
    import os

    pattern = f"/dev/shm/sparse-rl-weights-{os.getpid()}-*"
    before = set(glob.glob(pattern))
    net = _Net(0)
    with pytest.raises(Exception) as err:
        WeightSender("127.0.0.1", free_port(), 2, weight_spec(net), bucket_bytes=256, timeout_s=1)
    assert "timeout" in str(err.value).lower() or "timed out" in str(err.value).lower()
    assert set(glob.glob(pattern)) == before
