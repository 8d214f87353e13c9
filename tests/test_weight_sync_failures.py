"""A dead peer fails a weight transfer with ``WeightSyncError`` on every live rank within the
timeout, never a hang (``cluster.sync_guard``), here on gloo: a receiver that died between
broadcasts is caught at the gate (the error names its rank), one dying in the middle of a broadcast
fails the sender, a sender dying in the middle fails the receiver, and a group that failed refuses
further transfers until it is re-formed. The NCCL twin is in tests/test_gpu.py."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback

import pytest
import torch

from cluster.sync_guard import WeightSyncError
from cluster.weight_sync import WeightReceiver, WeightSender, free_port, weight_spec

TIMEOUT_S = 3.0


def _net() -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    net = torch.nn.Module()
    net.big = torch.nn.Parameter(torch.randn(1 << 20, generator=g))   # 4 MiB: travels alone
    net.small = torch.nn.Parameter(torch.randn(33, generator=g))
    return net


def _die_after_header(group) -> None:
    """Make ``group`` exit its process right after the transfer's header went through: dead in
    the middle of a broadcast, after the gate."""
    header = group.broadcast

    def broadcast(tensor):
        header(tensor)
        os._exit(0)

    group.broadcast = broadcast


def _peer(role: str, port: int, die: str, q) -> None:
    """The other process: a receiver (``role="receiver"``) or a sender. ``die``: "between" (one
    good transfer, then exit) or "middle" (exit inside the first transfer)."""
    torch.set_num_threads(1)
    net = _net()
    q.put("ready")  # imports done: the group forms within the (short) timeout from here
    try:
        if role == "receiver":
            g = WeightReceiver("127.0.0.1", port, 1, 2, weight_spec(net), timeout_s=TIMEOUT_S)
        else:
            g = WeightSender("127.0.0.1", port, 2, weight_spec(net), timeout_s=TIMEOUT_S,
                             same_host_shm=False)
        q.put("joined")
        if die == "middle":
            _die_after_header(g)
        if role == "receiver":
            g.receive()
        else:
            g.send(net.named_parameters(), 1)
        q.put("transferred")
    except Exception as e:
        q.put(f"error {type(e).__name__}: {e}\n{traceback.format_exc()}")
    q.close()
    q.join_thread()  # flushed before the hard exit
    os._exit(0)


def _start(role: str, die: str):
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    p = ctx.Process(target=_peer, args=(role, port, die, q))
    p.start()
    assert q.get(timeout=120) == "ready"
    return p, q, port


def _sender(port: int) -> WeightSender:
    return WeightSender("127.0.0.1", port, 2, weight_spec(_net()), timeout_s=TIMEOUT_S,
                        same_host_shm=False)


def test_receiver_dead_between_broadcasts_is_named_at_the_gate_and_breaks_the_group():
    p, q, port = _start("receiver", "between")
    sender, net = _sender(port), _net()
    assert q.get(timeout=60) == "joined"
    sender.send(net.named_parameters(), 1)
    assert q.get(timeout=60) == "transferred"
    p.join(30)                                              # the receiver is gone for good
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"timed out after 3 s: rank\(s\) \[1\] never arrived"):
        sender.send(net.named_parameters(), 2)
    assert TIMEOUT_S - 0.5 < time.monotonic() - t0 < 15
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="broken by an earlier failure.*re-form"):
        sender.send(net.named_parameters(), 3)              # refused at once, no second wait
    assert time.monotonic() - t0 < 1
    sender.close()


def test_receiver_dying_in_the_middle_of_a_broadcast_fails_the_sender():
    p, q, port = _start("receiver", "middle")
    sender, net = _sender(port), _net()
    assert q.get(timeout=60) == "joined"
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="transfer 1 failed"):
        sender.send(net.named_parameters(), 1)
    assert time.monotonic() - t0 < 15
    p.join(30)
    assert q.empty()                                       # it died before reporting anything
    sender.close()


def test_sender_dying_in_the_middle_of_a_broadcast_fails_the_receiver():
    p, q, port = _start("sender", "middle")
    receiver = WeightReceiver("127.0.0.1", port, 1, 2, weight_spec(_net()), timeout_s=TIMEOUT_S)
    assert q.get(timeout=60) == "joined"
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="transfer 1 failed"):
        receiver.receive()
    assert time.monotonic() - t0 < 15
    p.join(30)
    receiver.close()
