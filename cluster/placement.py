"""Placement groups: each pool's resources reserved, as a whole, before any of its actors starts.

One Ray placement group per pool (learners, rollout, scorer), one bundle per actor holding the
pool's request (``cluster.<pool>_cpus/_gpus/_resources``, as ``cluster.resources.plan`` sums them),
strategy ``cluster.placement``: ``pack`` (Ray's PACK: as few nodes as possible) or ``spread``
(SPREAD: over as many as possible). The learners of one DeepSpeed group share one placement group.
Actor ``i`` of a pool runs in bundle ``i``; a replacement (``cluster.elastic``) takes its
predecessor's bundle, and an actor added by a resize gets a one-bundle group of its own, removed
with it.

A pool that cannot be reserved within ``cluster.placement_timeout_s`` is a ConfigError naming the
pool, what one of its actors asks for and what the cluster has free; nothing half-started stays
behind (every group is removed).
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.config import Placement
from cluster.resources import brief, plan
from common.errors import ConfigError

POOLS = ("learner", "rollout", "scorer")
STRATEGY = {Placement.pack: "PACK", Placement.spread: "SPREAD"}


@dataclass(frozen=True)
class Slot:
    """Bundle ``index`` of placement group ``group``; ``owned``: the group exists for this one
    actor (added by a resize) and goes when the actor does."""
    group: object
    index: int
    owned: bool = False


def strategy(cfg) -> str:
    return STRATEGY[Placement(cfg.cluster.placement)]


def reserve(cfg, timeout_s: float) -> dict[str, list[Slot]]:
    """A placement group per pool, ready (resources held) within ``timeout_s``: {pool: one Slot
    per actor, in actor order}."""
    from ray.util.placement_group import placement_group

    wanted = {pool: plan(cfg)[pool] for pool in POOLS}
    groups = {pool: placement_group([dict(req) for _ in range(n)], strategy=strategy(cfg),
                                    name=f"sparse-rl-{pool}")
              for pool, (n, req) in wanted.items() if n > 0}
    _await_ready(groups, wanted, timeout_s, cfg.cluster.placement)
    return {pool: [Slot(pg, i) for i in range(wanted[pool][0])] for pool, pg in groups.items()}


def reserve_one(cfg, pool: str, timeout_s: float) -> Slot:
    """A one-bundle group for an actor a resize adds beyond the pool's reserved bundles."""
    from ray.util.placement_group import placement_group

    req = plan(cfg)[pool][1]
    pg = placement_group([dict(req)], strategy=strategy(cfg), name=f"sparse-rl-{pool}-extra")
    _await_ready({pool: pg}, {pool: (1, req)}, timeout_s, cfg.cluster.placement)
    return Slot(pg, 0, owned=True)


def _await_ready(groups: dict, wanted: dict, timeout_s: float, placement) -> None:
    """Every group ready within ``timeout_s``, else all removed and a ConfigError naming the pools
    still waiting."""
    import ray

    refs = {pg.ready(): pool for pool, pg in groups.items()}
    ready, waiting = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    if not waiting:
        return
    free = brief(ray.available_resources())
    for pg in groups.values():
        ray.util.remove_placement_group(pg)
    pools = "; ".join(f"{refs[r]} pool ({wanted[refs[r]][0]} x {wanted[refs[r]][1]})"
                      for r in waiting)
    raise ConfigError("cluster.placement_timeout_s", timeout_s,
                      f"enough for every pool's placement group (cluster.placement="
                      f"{Placement(placement).value}) to be reserved; still waiting: {pools} "
                      f"(free now: {free})")


def options(slot: Slot | None) -> dict:
    """``ray.remote``/``.options`` keywords that put an actor in its bundle (none: anywhere)."""
    if slot is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=slot.group, placement_group_bundle_index=slot.index)}


def release(slot: Slot | None) -> None:
    """Remove the group of an actor that had one of its own (``reserve_one``)."""
    if slot is not None and slot.owned:
        import ray

        ray.util.remove_placement_group(slot.group)
