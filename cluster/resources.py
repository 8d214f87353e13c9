"""Can the cluster ever hold the actors the config asks for? Checked right after Ray starts.

Ray queues an actor it cannot place and a ``ray.get`` on it waits forever (with Ray logging "No
available node types can fulfill resource request"). So, before any actor exists, ``check_plan``
sums each pool's request (``cluster.<pool>_cpus/_gpus/_resources`` x its actor count) and compares
it with the cluster's *total* resources (``ray.cluster_resources()``, not what is free now):

- a local Ray (``cluster.address`` unset) never grows: a shortfall is a ConfigError naming the key,
  the resource, what the pools need and what the cluster has;
- so does a joined cluster on which no autoscaler advertises itself (``autoscaling_limits``): its
  total counts every node, busy or not, so what exceeds it can never be placed;
- a joined cluster whose autoscaler publishes its limits (autoscaler v2's cluster config: each
  node group's resources x its max count) is checked against those: beyond them, a ConfigError;
  within them but beyond the nodes up now, a printed warning while it grows;
- a joined cluster whose autoscaler publishes no limits (v1: only its status) gets the warning;
in every case bounded by ``cluster.placement_timeout_s`` (``wait_placed``), after which the
unplaced actors are named.
"""
from __future__ import annotations

from common.errors import ConfigError

# Ray's resource names for the per-pool cpus/gpus keys
CPU, GPU = "CPU", "GPU"


def plan(cfg) -> dict[str, tuple[int, dict[str, float]]]:
    """{pool: (actor count, resources per actor)} as ``cluster.pools.build_pools`` requests them."""
    c = cfg.cluster

    def per_actor(pool: str, extra: dict | None = None) -> dict[str, float]:
        res = {CPU: float(getattr(c, f"{pool}_cpus"))}
        gpus = float(getattr(c, f"{pool}_gpus", 0.0))
        if gpus:
            res[GPU] = gpus
        res.update({k: float(v) for k, v in (extra or {}).items()})
        return res

    return {"learner": (cfg.learner.num_learners, per_actor("learner", c.learner_resources)),
            "rollout": (cfg.rollout.num_actors, per_actor("rollout", c.rollout_resources)),
            "scorer": (cfg.scorer.num_actors, per_actor("scorer", c.scorer_resources)),
            "buffer": (1, per_actor("buffer", c.buffer_resources))}


def shortfalls(cfg, total: dict[str, float]) -> list[tuple[str, str, float, float, str]]:
    """(config key, resource, needed, cluster total, per-pool breakdown) for every resource the
    pools need more of, in all, than ``total`` holds."""
    pools = plan(cfg)
    out = []
    for res in sorted({r for _, req in pools.values() for r in req}):
        parts = [(pool, n, req[res]) for pool, (n, req) in pools.items() if req.get(res)]
        need = sum(n * each for _, n, each in parts)
        have = float(total.get(res, 0.0))
        if need > have + 1e-9:
            out.append((_key(cfg, res, parts), res, need, have,
                        ", ".join(f"{pool} {n} x {each:g}" for pool, n, each in parts)))
    return out


def _key(cfg, res: str, parts) -> str:
    """The key to change: a local Ray's size for CPUs, else the largest pool's request."""
    if res == CPU and not cfg.cluster.address:
        return "cluster.num_cpus"
    pool = max(parts, key=lambda p: p[1] * p[2])[0]
    suffix = {CPU: "cpus", GPU: "gpus"}.get(res, "resources")
    return f"cluster.{pool}_{suffix}"


def check_plan(cfg, ray) -> None:
    """ConfigError when the cluster can never place the pools; a printed warning when it could once
    its autoscaler adds nodes. Call after ``start_ray``, before ``build_pools``."""
    short = shortfalls(cfg, ray.cluster_resources())
    if not short:
        return
    limits = autoscaling_limits() if cfg.cluster.address else None
    if limits:  # what the autoscaler can reach, not what is up now
        never = shortfalls(cfg, limits)
        if never:
            key, res, need, have, parts = never[0]
            raise ConfigError(key, _value(cfg, key, res), f"a plan this cluster can place: the "
                              f"pools need {res} {need:g} in all ({parts}); its autoscaler "
                              f"reaches {have:g} at most")
    key, res, need, have, parts = short[0]
    what = f"{res} {need:g} in all ({parts}); the cluster has {have:g} in total"
    if limits is None:
        value = cfg.cluster.num_cpus if key == "cluster.num_cpus" else _value(cfg, key, res)
        where = "this local Ray" if not cfg.cluster.address else \
            "this cluster (no autoscaler advertises itself)"
        raise ConfigError(key, value, f"a plan {where} can place: the pools need {what}")
    print(f"[resources] the pools need {what}; waiting up to cluster.placement_timeout_s="
          f"{cfg.cluster.placement_timeout_s:g} s for the autoscaler to add nodes", flush=True)


def autoscaling_limits() -> dict[str, float] | None:
    """How far the joined cluster can grow: None when no autoscaler can add nodes, ``{}`` when one
    can but publishes no limits, else the most of each resource its node groups reach (what Ray
    Train and Ray Data check their requests against too).

    Autoscaler v2 says so in the GCS (its flag, and its cluster config once reported). Every head
    runs a v1 monitor that writes its status; without an autoscaling config (``ray start``, a
    KubeRay cluster without in-tree autoscaling) it uses the read-only provider, whose node types
    are the nodes themselves (``node_<id>``), where a real config names its node groups."""
    import json

    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray._private.state import state
    from ray._raylet import GCS_AUTOSCALER_STATE_NAMESPACE, GCS_AUTOSCALER_V2_ENABLED_KEY
    from ray.experimental.internal_kv import _internal_kv_get

    limits = state.get_max_resources_from_cluster_config()
    if limits:
        return {k: float(v) for k, v in limits.items()}
    if _internal_kv_get(GCS_AUTOSCALER_V2_ENABLED_KEY,
                        namespace=GCS_AUTOSCALER_STATE_NAMESPACE) == b"1":
        return {}
    status = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
    if not status:
        return None
    types = (json.loads(status).get("autoscaler_report") or {}).get("node_type_mapping") or {}
    readonly = bool(types) and all(t == f"node_{n}" for n, t in types.items())
    return None if readonly else {}


def _value(cfg, key: str, res: str):
    value = getattr(cfg.cluster, key.split(".", 1)[1])
    return value.get(res) if isinstance(value, dict) else value


def wait_placed(named_actors: list[tuple[str, object]], timeout_s: float) -> None:
    """Wait until every actor's constructor has run; ConfigError naming the ones still waiting
    after ``timeout_s`` (``cluster.placement_timeout_s``), so an unplaceable actor is not waited
    on forever. ``named_actors``: (pool/index, actor handle)."""
    import ray

    refs = {a.__ray_ready__.remote(): name for name, a in named_actors}
    ready, waiting = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    ray.get(ready)  # a constructor that raised surfaces here, as itself
    if waiting:
        names = ", ".join(refs[r] for r in waiting)
        raise ConfigError("cluster.placement_timeout_s", timeout_s,
                          f"enough for every actor to start; still not placed: {names} (free now: "
                          f"{brief(ray.available_resources())})")


def brief(res: dict) -> dict:
    """CPU, GPU and custom resources (not Ray's per-node and memory entries)."""
    skip = ("node:", "memory", "object_store_memory", "accelerator_type:")
    return {k: round(v, 3) for k, v in sorted(res.items()) if not k.startswith(skip)}
