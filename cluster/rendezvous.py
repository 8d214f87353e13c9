"""Rendezvous owned by the process that serves it.

A group's store (DeepSpeed's default group, the weight-sync group) is served by one member, learner
rank 0, so that member picks the address and the port: its own node's IP as Ray knows it (loopback
on a local Ray, started on 127.0.0.1) and a port bound right there and kept open until the store
takes the socket over, so nothing can take it in between. Every other member dials what it reports.
A driver choosing for it cannot work on a cluster: the driver can neither bind the learner's
address nor know which of its own addresses the learner can reach.

Gloo advertises the address of the interface it binds to, and by default it resolves this machine's
hostname for that, which /etc/hosts may map to 127.0.0.1 (then peers on other hosts dial their own
loopback). ``use_interface_toward`` makes every gloo group a process creates bind the interface it
reaches the store's host through.
"""
from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass

LOOPBACK = "127.0.0.1"
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
GLOO_AUTO = "SPARSE_RL_GLOO_IFNAME_AUTO"  # the GLOO_IFNAME value use_interface_toward chose


@dataclass(frozen=True)
class Endpoint:
    """A listening socket on (host, port), open until a store server takes ``fd`` over."""
    host: str
    port: int
    fd: int

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port


def node_ip() -> str:
    """This process's node address as Ray knows it (in an actor); loopback outside Ray."""
    import ray

    if not ray.is_initialized():
        return LOOPBACK
    return ray.util.get_node_ip_address()


# free_port's range: below Linux's default ephemeral range (32768-60999), whose ports every
# outgoing connection (Ray's workers, gRPC) takes its local port from, and above Ray's worker
# listeners (10002-19999). A port probed there can be lost before its bind only to another
# listener; one the kernel hands out (bind to 0) was lost once to a connection (CI: EADDRINUSE).
FREE_PORTS = range(20000, 32768)


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A TCP port in ``FREE_PORTS`` that was free a moment ago (for tests and single-machine
    runs; a served group binds its own: ``open_endpoint``)."""
    rng = random.Random()  # OS-seeded: concurrent callers do not walk the same ports
    for _ in range(tries):
        port = rng.choice(FREE_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port on {host} in {FREE_PORTS.start}-{FREE_PORTS.stop - 1} "
                  f"after {tries} tries")


def listen_fd(host: str, port: int) -> int:
    """The fd of a TCP socket listening on (host, port), for ``TCPStore(master_listen_fd=...)``,
    which takes ownership of it (and closes it with the store)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock.detach()


def open_endpoint(port: int = 0, host: str | None = None) -> Endpoint:
    """Listen on ``host`` (default: this node's IP) and ``port`` (0: any free one)."""
    host = host or node_ip()
    fd = listen_fd(host, port)
    with socket.socket(fileno=os.dup(fd)) as s:  # a duplicate: reading the port leaves fd open
        return Endpoint(host, s.getsockname()[1], fd)


def close_endpoint(ep: Endpoint | None) -> None:
    """Close an endpoint no store took over (e.g. a formation that failed before it)."""
    if ep is not None:
        try:
            os.close(ep.fd)
        except OSError:
            pass


def take_endpoint(ep: Endpoint | None, host: str, port: int) -> int | None:
    """The socket of ``ep`` when it listens on (host, port), for a store to take over; None
    (``ep`` closed) otherwise, and the caller binds one itself."""
    if ep is not None and ep.address == (host, int(port)):
        return ep.fd
    close_endpoint(ep)
    return None


def local_ip_toward(host: str) -> str:
    """The address this process reaches ``host`` from (the kernel's route; nothing is sent)."""
    if host.startswith("127."):
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def interface_of(ip: str) -> str | None:
    """The name of the network interface holding ``ip`` (None when none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return None


def use_interface_toward(host: str) -> str | None:
    """Bind this process's gloo groups to the interface ``host`` is reached through (sets
    GLOO_SOCKET_IFNAME, read at each group's creation); one the user set is kept. Returns the
    interface in use (None: gloo's own default).

    A value this function set (here or in a parent process: child processes inherit the
    environment, e.g. a test process that formed a loopback group and then starts Ray nodes) is
    marked in ``GLOO_AUTO`` and recomputed for each host, so it never pins later groups to ``lo``.
    """
    current = os.environ.get(GLOO_IFNAME)
    if current and current != os.environ.get(GLOO_AUTO):
        return current  # the user's choice
    name = interface_of(local_ip_toward(host))
    if name:
        os.environ[GLOO_IFNAME] = os.environ[GLOO_AUTO] = name
    else:
        os.environ.pop(GLOO_IFNAME, None)
        os.environ.pop(GLOO_AUTO, None)
    return name
