"""A local Ray started by the project listens on loopback only, runs no dashboard and keeps actors
to one thread."""
from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import psutil
import pytest

from cluster.ray_setup import actor_options
from cluster.weight_sync import free_port


def _listening_addresses(root_pid: int) -> list[str]:
    pids = {root_pid} | {p.pid for p in psutil.Process(root_pid).children(recursive=True)}
    return [c.laddr.ip for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def test_local_ray_listens_on_loopback_only(local_ray):
    ray = local_ray

    @ray.remote(**actor_options(0.5))
    class Probe:
        def threads(self):
            return os.environ.get("OMP_NUM_THREADS")

    probe = Probe.remote()
    assert ray.get(probe.threads.remote()) == "1"
    assert ray.nodes()[0]["NodeManagerAddress"] == "127.0.0.1"
    # no dashboard web UI: no URL, and Ray's dashboard process runs without its frontend (what
    # it does listen on is checked with the rest below)
    assert not ray._private.worker._global_node.address_info.get("webui_url")
    heads = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)
             if "dashboard/dashboard.py" in " ".join(p.cmdline())]
    assert all("--disable-frontend" in c and "--host=127.0.0.1" in c for c in heads), heads
    addrs = _listening_addresses(os.getpid())
    assert addrs, "expected Ray's servers among this process's children"
    for ip in addrs:
        addr = ipaddress.ip_address(ip)
        mapped = getattr(addr, "ipv4_mapped", None)
        assert addr.is_loopback or (mapped is not None and mapped.is_loopback), ip


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    import socket

    from cluster.rendezvous import FREE_PORTS

    port = free_port()
    assert port in FREE_PORTS
    lo, _ = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert FREE_PORTS.stop <= lo  # outgoing connections never take these ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
