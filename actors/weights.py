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


def receive_weights(receiver, load: Callable[[list, int], None]) -> int:
    """One broadcast: receive it and hand it to ``load(named_tensors, version)``, which swaps the
    weights; actors call this between batches, never mid-sequence. Returns the version."""
    if receiver is None:
        raise RuntimeError("sync_weights called before init_weight_sync")
    version, named = receiver.receive()
    load(named, version)
    return version
