"""Weight broadcast from learner rank 0 to rollout and scorer actors.

The group is deliberately *not* torch.distributed's default group: every learner process already owns
one (DeepSpeed's), and a process may hold only one default group. So each side builds a standalone
``TCPStore`` plus a bare ``ProcessGroupGloo`` (``ProcessGroupNCCL`` on GPU) and calls collectives on that
object directly. Learner rank 0 is rank 0 of this group; every actor is one more rank.

Wire protocol of one ``send``/``receive`` (a collective: all ranks must call it):
  1. an int64 tensor ``[version, num_buckets]``;
  2. the weights, flattened into buckets (one dtype per bucket, at most ``bucket_bytes`` unless a
     single tensor is larger), in the order of the shared spec.
Both sides derive the same bucket plan from the spec, so only the version travels as metadata. The
spec itself is agreed once, at construction, through the store: the sender publishes its spec (wire
dtypes), bucket size and backend; a receiver whose parameter names or shapes differ fails there, and
makes every rank fail, with the first differing entry named, instead of hanging in a broadcast of
the wrong size.
"""
from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist

SpecEntry = tuple[str, tuple[int, ...], torch.dtype]
DEFAULT_BUCKET_BYTES = 64 << 20
_VERDICT_OK = "ok"


def weight_spec(model: torch.nn.Module) -> list[SpecEntry]:
    """(name, shape, dtype) of every parameter, in ``named_parameters`` order, HF names.

    A DeepSpeed engine or DDP wrapper names parameters ``module.x``; that prefix is stripped so the
    learner's spec matches the actors' plain HF models.
    """
    spec = []
    for name, p in model.named_parameters():
        name = name[len("module."):] if name.startswith("module.") else name
        # ZeRO-3 partitions parameters and leaves a 0-size local tensor; ds_shape is the full shape.
        shape = tuple(getattr(p, "ds_shape", p.shape))
        spec.append((name, shape, p.dtype))
    return spec


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for tests and single-machine runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _spec_json(spec: Iterable[SpecEntry]) -> str:
    return json.dumps([[n, list(s), str(d)] for n, s, d in spec])


def _dtype(name: str) -> torch.dtype:
    """'torch.bfloat16' -> torch.bfloat16."""
    dtype = getattr(torch, name.rsplit(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r} in the sender's spec")
    return dtype


def _spec_diff(mine: list, theirs: list) -> str | None:
    """Human-readable first difference between two JSON-decoded specs, or None when equal."""
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return f"entry {i}: receiver has {a}, sender has {b}"
    if len(mine) != len(theirs):
        return f"receiver has {len(mine)} tensors, sender has {len(theirs)}"
    return None


@dataclass(frozen=True)
class _Bucket:
    dtype: torch.dtype
    numel: int
    entries: tuple[tuple[int, int, int], ...]  # (spec index, offset, numel)


def plan_buckets(spec: list[SpecEntry], bucket_bytes: int) -> list[_Bucket]:
    """Group consecutive same-dtype tensors into flat buckets of at most ``bucket_bytes``."""
    buckets: list[_Bucket] = []
    cur: list[tuple[int, int, int]] = []
    cur_dtype, cur_numel = None, 0

    def close():
        if cur:
            buckets.append(_Bucket(cur_dtype, cur_numel, tuple(cur)))

    for i, (_, shape, dtype) in enumerate(spec):
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty((), dtype=dtype).element_size()
        if cur and (dtype != cur_dtype or (cur_numel + numel) * itemsize > bucket_bytes):
            close()
            cur, cur_numel = [], 0
        cur_dtype = dtype
        cur.append((i, cur_numel, numel))
        cur_numel += numel
    close()
    return buckets


def listen_fd(host: str, port: int) -> int:
    """The fd of a TCP socket listening on (host, port), for ``TCPStore(master_listen_fd=...)``,
    which takes ownership of it (and closes it with the store)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock.detach()


class _Group:
    """Store + process group shared by sender and receivers; rank 0 hosts the store.

    The sender's spec, bucket size and backend are authoritative: a receiver checks names and shapes
    against its own model, then adopts the sender's wire dtypes (a bf16 learner may feed fp32
    actors; ``copy_`` casts on load), bucket size and backend, so only the sender needs configuring.
    """

    def __init__(self, host, port, rank, world_size, spec, backend, bucket_bytes, timeout_s, key):
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"weight sync backend must be 'gloo' or 'nccl', got {backend!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"weight sync rank {rank} outside world of size {world_size}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.spec = [(n, tuple(s), d) for n, s, d in spec]
        self.bucket_bytes = bucket_bytes
        self.timeout = timedelta(seconds=timeout_s)
        self._key = key
        # TCPStore's own server listens on every interface ("::"): rank 0 hands it a socket bound
        # to ``host`` instead, so a 127.0.0.1 group is reachable from this machine only.
        server = {"master_listen_fd": listen_fd(host, port)} if rank == 0 else {}
        self.store = dist.TCPStore(host, port, world_size, is_master=(rank == 0),
                                   timeout=self.timeout, wait_for_workers=False, **server)
        self._agree_on_spec()
        self.buckets = plan_buckets(self.spec, self.bucket_bytes)
        self.pg = self._make_pg()
        # NCCL moves CUDA tensors only: buckets live on this process's current GPU
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" \
            else torch.device("cpu")

    def _agree_on_spec(self) -> None:
        """Rank 0 publishes its spec; every receiver reports a diff; rank 0 publishes one verdict.

        Everyone waits for the verdict before building the process group, so a single bad receiver
        makes *all* ranks fail fast with the same message instead of the good ones hanging.
        """
        k = self._key
        if self.rank == 0:
            meta = {"spec": json.loads(_spec_json(self.spec)), "bucket_bytes": int(self.bucket_bytes),
                    "backend": self.backend}
            self.store.set(f"{k}/meta", json.dumps(meta))
            problems = []
            for r in range(1, self.world_size):
                msg = self.store.get(f"{k}/check/{r}").decode()
                if msg != _VERDICT_OK:
                    problems.append(f"rank {r}: {msg}")
            verdict = _VERDICT_OK if not problems else "; ".join(problems)
            self.store.set(f"{k}/verdict", verdict)
            # rank 0 hosts the store: leaving (raising) before every receiver has read the verdict
            # would cut them off with a bare connection error instead of the message
            self.store.wait([f"{k}/seen/{r}" for r in range(1, self.world_size)])
        else:
            meta = json.loads(self.store.get(f"{k}/meta").decode())
            theirs = meta["spec"]
            # names and shapes must match; dtypes are the sender's (the wire format)
            diff = _spec_diff([e[:2] for e in json.loads(_spec_json(self.spec))],
                              [e[:2] for e in theirs])
            if diff is None and self.backend not in (None, meta["backend"]):
                diff = f"receiver backend {self.backend!r}, sender backend {meta['backend']!r}"
            self.store.set(f"{k}/check/{self.rank}", diff or _VERDICT_OK)
            verdict = self.store.get(f"{k}/verdict").decode()
            self.store.set(f"{k}/seen/{self.rank}", "1")
            if verdict == _VERDICT_OK:
                self.spec = [(n, tuple(shape), _dtype(d)) for n, shape, d in theirs]
                self.bucket_bytes, self.backend = int(meta["bucket_bytes"]), meta["backend"]
        if verdict != _VERDICT_OK:
            raise ValueError(f"weight sync spec mismatch (receiver model differs from the "
                             f"learner's): {verdict}")

    def _make_pg(self):
        if self.backend == "gloo":
            return dist.ProcessGroupGloo(self.store, self.rank, self.world_size, self.timeout)
        if not hasattr(dist, "ProcessGroupNCCL") or not torch.cuda.is_available():
            raise RuntimeError("weight sync backend 'nccl' needs a CUDA build of torch and a GPU")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self.timeout
        return dist.ProcessGroupNCCL(self.store, self.rank, self.world_size, opts)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.pg.broadcast(tensor, 0).wait()

    def close(self) -> None:
        """Leave the group (before re-forming it, e.g. on a new port after an actor restart or a
        pool resize). Rank 0's TCPStore server stops when its last reference goes."""
        self.pg = None
        self.store = None


class WeightSender(_Group):
    """Rank 0 of the weight-sync group (learner rank 0): ``send(named_tensors, version)``."""

    def __init__(self, host: str, port: int, world_size: int, spec: list[SpecEntry],
                 backend: str = "gloo", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout_s: float = 300.0, key: str = "weights"):
        self._flats: list[torch.Tensor] | None = None
        super().__init__(host, port, 0, world_size, spec, backend, bucket_bytes, timeout_s, key)

    @torch.no_grad()
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        """Broadcast the weights (in any order; matched by name against the spec) tagged ``version``.

        Returns {"bytes": ..., "buckets": ...} for logging.
        """
        by_name = dict(named_tensors)
        missing = [n for n, _, _ in self.spec if n not in by_name]
        if missing:
            raise KeyError(f"weight sync send: tensors missing for {missing[:5]} "
                           f"({len(missing)} of {len(self.spec)})")
        for name, shape, _ in self.spec:  # before the header: receivers must never wait on a send
            if tuple(by_name[name].shape) != shape:  # that failed half-way
                raise ValueError(f"weight sync send: {name} has shape "
                                 f"{tuple(by_name[name].shape)}, spec says {shape}")
        if self._flats is None:  # kept between sends: fresh 100 MB buffers cost page faults each time
            self._flats = [torch.empty(b.numel, dtype=b.dtype, device=self.device)
                           for b in self.buckets]
        self.broadcast(torch.tensor([int(version), len(self.buckets)], dtype=torch.int64,
                                    device=self.device))
        works = []
        for b, flat in zip(self.buckets, self._flats):
            for idx, off, numel in b.entries:
                flat[off:off + numel].copy_(by_name[self.spec[idx][0]].reshape(-1))
            # asynchronous: bucket i goes out while bucket i+1 is being packed
            works.append(self.pg.broadcast(flat, 0))
        for w in works:
            w.wait()
        return {"bytes": sum(f.numel() * f.element_size() for f in self._flats),
                "buckets": len(self.buckets)}


class WeightReceiver(_Group):
    """Rank >= 1 of the weight-sync group (a rollout or scorer actor): ``receive()``."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, spec: list[SpecEntry],
                 backend: str | None = None, timeout_s: float = 300.0, key: str = "weights"):
        """``spec`` is this actor's own ``weight_spec(model)``; ``backend=None`` adopts the sender's.

        Bucket size and wire dtypes always come from the sender (see ``_Group``).
        """
        if rank == 0:
            raise ValueError("weight sync rank 0 is the sender (learner rank 0); receivers use >= 1")
        super().__init__(host, port, rank, world_size, spec, backend, None, timeout_s, key)

    @torch.no_grad()
    def receive(self) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Block until the sender's next ``send``; return (version, [(name, tensor), ...]).

        Tensors are views into fresh per-call buffers (on the group's device), in spec order, in
        the sender's dtypes.
        """
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        self.broadcast(header)
        version, num_buckets = int(header[0]), int(header[1])
        if num_buckets != len(self.buckets):  # cannot happen after the spec check; guards misuse
            raise RuntimeError(f"weight sync: sender sent {num_buckets} buckets, receiver planned "
                               f"{len(self.buckets)}")
        flats = [torch.empty(b.numel, dtype=b.dtype, device=self.device) for b in self.buckets]
        for w in [self.pg.broadcast(flat, 0) for flat in flats]:  # all in flight, then wait
            w.wait()
        out: list[tuple[str, torch.Tensor]] = []
        for b, flat in zip(self.buckets, flats):
            for idx, off, numel in b.entries:
                name, shape, _ = self.spec[idx]
                out.append((name, flat[off:off + numel].view(shape)))
        return version, out
