"""Elastic pools: the weight-sync group re-forms when actors die, restart or a pool is resized,
without restarting the job.

The group is static (a fixed world size, one rank per receiver), so any change of membership means
a new group: every member leaves the old one and all join a fresh one on a new port, ranks
re-assigned in pool order (``reform_weight_sync``). The learner's current weights and version are
then broadcast, so every actor - new or surviving - holds exactly the learner's weights; the
checksums are compared like ``broadcast_weights`` does.

The probe, the re-formation and the broadcast run in each actor's "weights" concurrency group
(``cluster.pools.WEIGHTS_GROUP``), beside a rollout or scoring call in progress: a busy actor is
probed, re-joined and sent the weights without waiting for its call to return.
"""
from __future__ import annotations

from cluster import placement
from cluster.pools import (Pools, slot_of, broadcast_weights, connect_weight_sync, spawn_rollout,
                           spawn_scorer, weights_call)

ROLES = ("rollout", "scorer")
OK, DEAD, UNJOINED, UNRESPONSIVE = "ok", "dead", "unjoined", "unresponsive"
# How long a new actor may take to be placed and constructed: on KubeRay the autoscaler may have
# to add a worker pod first, which takes minutes.
START_TIMEOUT_S = 600.0


def _joined(actor) -> bool:
    """Runs inside a rollout or scorer actor (``__ray_call__``): does it hold a weight receiver?
    An actor Ray restarted (``max_restarts``) runs ``__init__`` again and comes back without one."""
    return getattr(actor, "_receiver", None) is not None


def probe(actors: list, timeout_s: float) -> list[str]:
    """One state per actor: ok, dead (Ray reports it died), unjoined (alive but outside the
    group, e.g. restarted by Ray), or unresponsive (no answer within ``timeout_s``: hung, or
    still in a weight transfer that has not given up)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    refs = [weights_call(a, "__ray_call__").remote(_joined) for a in actors]
    if refs:  # one shared deadline, not timeout_s per actor
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    states = []
    for ref in refs:
        try:
            states.append(OK if ray.get(ref, timeout=0) else UNJOINED)
        except GetTimeoutError:
            states.append(UNRESPONSIVE)
        except RayActorError:  # ActorDiedError; ActorUnavailableError while Ray restarts it
            states.append(DEAD)
    return states


def reform_weight_sync(pools: Pools, cfg) -> int:
    """Every member leaves its old group and all join a new one on a fresh port (learner rank 0 is
    rank 0, then the rollout and scorer actors in pool order). Returns the port.

    A fresh port rather than the old one: the old group's store may still be closing, and a member
    that missed the re-formation must fail to connect, not join the new group by accident. Learner
    rank 0 binds it on its own node while the old group's socket is still open, so it differs.
    """
    return connect_weight_sync(pools, cfg, fresh=True)[1]


def sync_all(pools: Pools, cfg) -> tuple[int, dict]:
    """Re-form the group and broadcast the learner's current weights and version to every receiver;
    raises unless every receiver's checksum equals the learner's."""
    reform_weight_sync(pools, cfg)
    version, sync = broadcast_weights(pools, verify=True)
    if sync["weights/max_rel_diff"] > 1e-6:
        raise RuntimeError(f"after re-forming the weight-sync group a receiver's weights differ "
                           f"from the learner's (max relative checksum difference "
                           f"{sync['weights/max_rel_diff']:.3g})")
    return version, sync


def replace_dead(pools: Pools, cfg, probe_timeout_s: float | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> list[str]:
    """Replace dead rollout and scorer actors, take back restarted ones, and re-form the group.

    A replacement is built like the original (``spawn_rollout``: same config and ``actor_id``, so
    it regenerates exactly its predecessor's chunk of a batch). An actor that does not answer within
    ``probe_timeout_s`` (default: the weight-sync timeout plus a margin, so survivors of a failed
    broadcast have returned from it) is killed and replaced. If anything changed, the group is
    re-formed and the learner's weights broadcast and checked. Returns one line per change (empty:
    every actor was fine and nothing was done).
    """
    import ray

    timeout = probe_timeout_s if probe_timeout_s is not None \
        else float(cfg.cluster.weight_sync_timeout_s) + 30.0
    report, spawned = [], []
    states = probe(pools.receivers, timeout)  # one deadline for both pools
    members = [(role, i) for role in ROLES for i in range(len(getattr(pools, role)))]
    for (role, i), state in zip(members, states):
        actors, name = getattr(pools, role), _name(pools, role, i)
        if state == UNJOINED:
            report.append(f"{name}: restarted by Ray, rejoined")
        elif state in (DEAD, UNRESPONSIVE):
            # also when dead: one Ray is still restarting must not return beside its replacement
            ray.kill(actors[i], no_restart=True)
            actors[i] = _spawn(pools, cfg, role, i)
            spawned.append(actors[i])
            report.append(f"{name}: {state}, replaced")
    if report:
        pools.faults["faults/actor_replacements"] += len(report)
        _await_started(spawned, start_timeout_s)
        sync_all(pools, cfg)
    return report


def resize_pool(pools: Pools, cfg, role: str, n: int,
                start_timeout_s: float = START_TIMEOUT_S) -> list[str]:
    """Grow the rollout or scorer pool to ``n`` actors (new rollout actors get actor ids not in use)
    or shrink it (the last ones are killed), then re-form the group and broadcast the learner's
    weights. Returns one line per actor added or removed."""
    import ray

    if role not in ROLES:
        raise ValueError(f"resize_pool: role must be one of {ROLES}, got {role!r}")
    if n < 1:
        raise ValueError(f"resize_pool: a {role} pool needs at least one actor, got {n}")
    actors = getattr(pools, role)
    report, spawned = [], []
    slots = pools.slots.get(role)  # None: a pool built without placement groups
    while len(actors) > n:
        report.append(f"{_name(pools, role, len(actors) - 1)}: removed")
        ray.kill(actors.pop(), no_restart=True)
        if slots and len(slots) > len(actors) and slots[-1].owned:
            placement.release(slots.pop())  # the pool's own bundles stay reserved for regrowth
        if role == "rollout":
            pools.rollout_ids.pop()
    while len(actors) < n:
        if role == "rollout":
            pools.rollout_ids.append(max(pools.rollout_ids, default=-1) + 1)
        if slots is not None and len(slots) <= len(actors):
            slots.append(placement.reserve_one(cfg, role, start_timeout_s))
        actors.append(_spawn(pools, cfg, role, len(actors)))
        spawned.append(actors[-1])
        report.append(f"{_name(pools, role, len(actors) - 1)}: added")
    if report:
        _await_started(spawned, start_timeout_s)
        sync_all(pools, cfg)
    return report


def _spawn(pools: Pools, cfg, role: str, index: int):
    """Actor ``index`` of ``role``, in its bundle (a replacement takes its predecessor's)."""
    slot = slot_of(pools, role, index)
    return spawn_rollout(cfg, pools.rollout_ids[index], slot) if role == "rollout" \
        else spawn_scorer(cfg, slot)


def _name(pools: Pools, role: str, index: int) -> str:
    return f"rollout actor {pools.rollout_ids[index]}" if role == "rollout" else f"scorer {index}"


def _await_started(actors: list, timeout_s: float) -> None:
    """Wait until new actors have run ``__init__``. One that cannot be placed (the cluster lacks
    the resources) would otherwise leave the group formation waiting for it; here it is an error
    naming the cause, and the actors are killed so they do not hold on to resources."""
    import ray

    if not actors:
        return
    refs = [a.__ray_ready__.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if len(ready) < len(refs):
        for a in actors:
            ray.kill(a, no_restart=True)
        raise RuntimeError(f"{len(refs) - len(ready)} of {len(refs)} new actors did not start "
                           f"within {timeout_s:.0f} s (not enough free CPUs/GPUs/resources in "
                           f"the cluster?)")
    ray.get(refs)  # a constructor that raised surfaces here
