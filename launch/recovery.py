"""The replay buffer actor, re-created from its segment files when it dies mid-run.

Only the driver talks to the buffer, and always through ``call`` (``buffer(pools).method(...)``). When a call fails with
``RayActorError`` (the actor's process was killed, ``ray.kill``, its node lost) a new buffer actor
starts on the same ``buffer.root``; its constructor replays the segments (``ReplayBuffer._recover``),
so it holds exactly the acknowledged operations of its predecessor. The call is then made once more.
That is safe for every method the driver uses: ``append`` ignores sample ids it holds, ``set_scores``
rows already scored, ``mark_consumed`` rows already consumed; ``sample_batch`` and
``pending_scoring`` only lease, and leases live in memory, so they are simply taken again.

The one lease that matters is the training batch the driver holds between ``sample_batch`` and
``mark_consumed`` (``pools.buffer_lease``): a PODS cut drops the rest of each group only when its
leased rows are consumed. After a restart it is leased again, and must come back as exactly the same
rows (the oldest ready groups, cut by the same deterministic rule); if its rows were consumed before
the actor died, there is nothing to lease. Anything else stops the run (``BufferLost``, naming the
newest checkpoint for ``resume=``) rather than risk training a row twice or losing one: no durable
root (a buffer in memory), a root the new actor cannot see (re-created on another node without shared
storage), a new actor that does not start or dies as well.
"""
from __future__ import annotations

# How long a re-created buffer may take to be placed and to replay its segments.
START_TIMEOUT_S = 600.0


class BufferLost(RuntimeError):
    """The buffer actor died and could not be re-created without risk; the message ends in the
    ``resume=`` to run (``launch/train.py`` prints it as one line, exit 1)."""


class Buffer:
    """The buffer actor as the driver uses it: ``buffer(pools).append(rows)`` is ``call(pools,
    "append", rows)``, so every call site reads as a method call and every call recovers."""

    def __init__(self, pools):
        self._pools = pools

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: call(self._pools, method, *args, **kwargs)


def buffer(pools) -> Buffer:
    """The recovering buffer handle of ``pools`` (one per pools: made on first use)."""
    handle = getattr(pools, "recovering_buffer", None)
    if handle is None:
        handle = pools.recovering_buffer = Buffer(pools)
    return handle


def call(pools, method: str, *args, on_retry=None, **kwargs):
    """``ray.get(pools.buffer.<method>.remote(*args, **kwargs))``; a lost buffer actor is
    re-created from its segments (``restart``) and the call repeated once. ``on_retry``: run
    before the repeat (e.g. empty a snapshot folder the lost actor had begun to fill)."""
    import ray
    from ray.exceptions import RayActorError

    try:
        out = ray.get(getattr(pools.buffer, method).remote(*args, **kwargs))
    except RayActorError as err:
        restart(pools, err)
        if on_retry is not None:
            on_retry()
        try:
            out = ray.get(getattr(pools.buffer, method).remote(*args, **kwargs))
        except RayActorError as again:
            raise BufferLost(_stop(pools, f"the re-created buffer actor died as well ({again})")) \
                from again
    _track_lease(pools, method, args, kwargs, out)
    return out


def _track_lease(pools, method: str, args: tuple, kwargs: dict, out) -> None:
    if method == "sample_batch" and out is not None:
        pools.buffer_lease = (args, kwargs, out.column("sample_id").to_pylist())
    elif method == "mark_consumed":
        pools.buffer_lease = None


def restart(pools, err: Exception) -> None:
    """A new buffer actor on ``pools.buffer_root`` in place of the lost one, with the driver's
    training lease taken again; ``BufferLost`` when that cannot be done without risk."""
    import ray
    from ray.exceptions import RayActorError

    reason = f"{type(err).__name__}"
    if pools.buffer_root is None or pools.spawn_buffer is None:
        raise BufferLost(_stop(pools, f"the buffer actor was lost ({reason}) and kept its rows in "
                                      "memory only (buffer.root unset)"))
    ray.kill(pools.buffer, no_restart=True)  # one Ray may still be restarting must not return
    pools.buffer = pools.spawn_buffer()
    ready, _ = ray.wait([pools.buffer.__ray_ready__.remote()], timeout=START_TIMEOUT_S)
    try:
        if not ready:
            raise TimeoutError(f"not started within {START_TIMEOUT_S:.0f} s")
        stats = ray.get(pools.buffer.stats.remote())
    except Exception as e:  # a constructor that raised, or one that never ran
        raise BufferLost(_stop(pools, f"the buffer actor was lost ({reason}) and a new one did "
                                      f"not start: {e}")) from e
    if not stats["root_existed"]:
        raise BufferLost(_stop(pools, f"the buffer actor was lost ({reason}) and the new one "
                                      f"finds no {pools.buffer_root} (another node? buffer.root "
                                      "and run.out_dir must be shared storage)"))
    try:
        _lease_again(pools, reason)
    except RayActorError as e:
        raise BufferLost(_stop(pools, f"the re-created buffer actor died as well ({e})")) from e
    pools.faults["faults/buffer_restarts"] += 1
    print(f"[recovery] buffer actor lost ({reason}): re-created from {stats['segments_on_disk']} "
          f"segments in {pools.buffer_root}, {stats['live_rows']} rows live", flush=True)


def _lease_again(pools, reason: str) -> None:
    """The training batch the driver holds, leased on the new actor: the same rows, or none when
    they were all consumed before the old actor died."""
    import ray

    if pools.buffer_lease is None:
        return
    args, kwargs, ids = pools.buffer_lease
    live = set(ray.get(pools.buffer.live_sample_ids.remote()))
    held = sum(s in live for s in ids)
    if held == 0:  # mark_consumed was written; only its answer was lost
        pools.buffer_lease = None
        return
    batch = ray.get(pools.buffer.sample_batch.remote(*args, **kwargs)) if held == len(ids) else None
    got = batch.column("sample_id").to_pylist() if batch is not None else []
    if got != ids:
        raise BufferLost(_stop(pools, f"the buffer actor was lost ({reason}) while the driver "
                                      f"trained on {len(ids)} rows, and the re-created buffer "
                                      f"holds {held} of them and leases {len(got)} others"))


def _stop(pools, what: str) -> str:
    """The message: what happened and the ``resume=`` to run."""
    from common.errors import ConfigError
    from launch.ckptdir import find_checkpoint

    try:
        ckpt = find_checkpoint(str(pools.run_dir)) if pools.run_dir else None
    except ConfigError:  # none written yet
        ckpt = None
    if ckpt is None:
        return f"{what}; no checkpoint yet (run.checkpoint_every): start the run again"
    return f"{what}; continue with: python launch/train.py resume={ckpt}"
