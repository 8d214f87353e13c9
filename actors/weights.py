"""The receiving end of the weight broadcast, shared by the rollout and scorer actors."""
from __future__ import annotations

from collections.abc import Callable


def join_weight_sync(old, host: str, port: int, rank: int, world_size: int, spec,
                     timeout_s: float = 300.0):
    """Leave the group ``old`` (None: never joined) and join the one at ``host:port`` as ``rank``
    (a collective with the learner and every other actor). Re-forming happens when an actor
    restarts or a pool is resized. ``timeout_s`` bounds the join and every later receive, so a
    dead peer is an error, not a hang."""
    from cluster.weight_sync import WeightReceiver

    if old is not None:
        old.close()
    return WeightReceiver(host, port, rank, world_size, spec, timeout_s=float(timeout_s))


def receive_weights(receiver, load: Callable[[list, int], None],
                    params: dict | None = None) -> int:
    """One broadcast, between batches (never mid-sequence); returns its version.

    With ``params`` (name -> the model's parameter) the bytes land straight in the model, without
    the staging copy (bench/pipeline.py: ~1.6x a memcpy at 50 MB against ~2.6x through staging
    buffers), then ``load([], version)`` records the version and drops caches built from the old
    weights. A broadcast failing half-way leaves the model partly written; the driver then
    replaces or re-syncs the actors (cluster/elastic.py) before any more generation. Without
    ``params``, ``load(named_tensors, version)`` copies them in."""
    if receiver is None:
        raise RuntimeError("sync_weights called before init_weight_sync")
    if params is None:
        version, named = receiver.receive()
        load(named, version)
    else:
        version, _ = receiver.receive(into=params)
        load([], version)
    return version
