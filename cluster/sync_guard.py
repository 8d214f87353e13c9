"""Failure handling of the weight-sync group: a dead or silent peer is a Python exception on every
rank that is still alive, on gloo and on NCCL alike, never a hang and never a process abort.

* **gloo** honours the group timeout in every collective and raises (a peer that closed its
  sockets fails it at once, a silent one after the timeout).
* **NCCL**: by default ``ProcessGroupNCCL`` runs a watchdog thread that, when a collective outlives
  the timeout, aborts the communicator and then takes the whole process down
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` defaults to 3, "SkipCleanUp": tear down without cleanup);
  ``work.wait()`` itself only makes the current CUDA stream wait and returns at once. The group
  here is therefore built with ``TORCH_NCCL_BLOCKING_WAIT=1``, which torch reads once, in the
  group's constructor (``make_process_group`` sets it just for that call): no watchdog (nor its
  heartbeat monitor) is started for this group, and ``work.wait()`` blocks the calling thread
  until the collective completes or the group timeout passes; on timeout it aborts the
  group's communicator and raises ``DistBackendError`` in the caller. Other groups of the
  process (DeepSpeed's) keep their own settings.
* The communicator is set up when the group forms (``eager_connect_single_device``), right after
  every rank was seen alive in the spec agreement, rather than inside the first transfer: NCCL's
  set-up itself has no timeout (a peer dying in that instant is the one window left).
* **Before every transfer** each rank checks in at a gate in the group's ``TCPStore`` and waits,
  bounded by the timeout, until every rank has (``Gate``): a peer that died between broadcasts
  is found there, on both backends, before anyone enters a collective with it, and the error
  names the missing ranks. (NCCL would otherwise wait for it inside a kernel.) A receiver whose
  store host, learner rank 0, died gets a connection error at the gate at once.

A failed transfer marks the group broken (``_Group``): every later call raises at once; the driver
replaces dead actors and re-forms the group on a new port (``cluster.elastic.replace_dead``).
"""
from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch.distributed as dist

_ENV_LOCK = threading.Lock()  # the environment is per process; group constructions are serialised


class WeightSyncError(RuntimeError):
    """A weight transfer failed (dead or silent peer, timeout, aborted communicator); the group
    must be re-formed before the next transfer."""


def make_process_group(backend: str, store, rank: int, world_size: int, timeout: timedelta):
    """A standalone gloo or NCCL group on ``store`` whose collectives raise on timeout."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    import torch

    from common.devices import assigned_device

    # assigned, not merely visible: a 0-GPU Ray actor still sees the node's GPUs
    if not hasattr(dist, "ProcessGroupNCCL") or assigned_device().type != "cuda":
        raise RuntimeError("weight sync backend 'nccl' needs a CUDA build of torch and a GPU "
                           "assigned to this process (cluster.*_gpus >= 1), or "
                           "cluster.weight_sync_backend=gloo")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    with _ENV_LOCK:
        saved = os.environ.get("TORCH_NCCL_BLOCKING_WAIT")
        os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"   # read by this constructor only
        try:
            pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        finally:
            if saved is None:
                del os.environ["TORCH_NCCL_BLOCKING_WAIT"]
            else:
                os.environ["TORCH_NCCL_BLOCKING_WAIT"] = saved
    # The communicator now, while every rank is known alive (the spec agreement just finished),
    # not lazily in the first transfer: its set-up blocks without a timeout.
    pg.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
    return pg


class Gate:
    """Arrival check before transfer ``seq``: every rank sets its key, then waits for everyone's.

    Keys are ``{key}/gate/{seq}/{rank}``; a rank deletes its own key of two transfers back (every
    rank has passed that gate by then: it took part in the transfer after it).
    """

    def __init__(self, store, key: str, rank: int, world_size: int, timeout: timedelta):
        self.store, self.key, self.rank, self.world_size = store, key, rank, world_size
        self.timeout = timeout

    def _name(self, seq: int, rank: int) -> str:
        return f"{self.key}/gate/{seq}/{rank}"

    def enter(self, seq: int) -> None:
        """Return once every rank has reached transfer ``seq``; raise ``WeightSyncError`` naming
        the ranks that did not within the timeout, or saying the store's host is gone."""
        others = [self._name(seq, r) for r in range(self.world_size) if r != self.rank]
        try:
            self.store.set(self._name(seq, self.rank), "1")
            if seq >= 2:
                self.store.delete_key(self._name(seq - 2, self.rank))
            if others:
                self.store.wait(others, self.timeout)
        except dist.DistNetworkError as err:
            raise WeightSyncError(f"weight sync transfer {seq}: lost the group's store ({err}); "
                                  f"its host, learner rank 0, is gone") from err
        except dist.DistStoreError as err:  # the wait timed out
            missing = [r for r in range(self.world_size) if r != self.rank
                       and not self.store.check([self._name(seq, r)])]
            raise WeightSyncError(
                f"weight sync transfer {seq} timed out after {self.timeout.total_seconds():.0f} s: "
                f"rank(s) {missing} never arrived (dead, stuck, or not calling send/receive)"
            ) from err
