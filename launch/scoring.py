"""Steps 6b and 6e of ``launch/train.py``: dense old-policy log-probs for the rows waiting for them,
and the new weights to every rollout and scorer actor (a scorer or rollout actor that died is
replaced, ``cluster/elastic.py``).
"""
from __future__ import annotations

from launch.rollouts import split_rows


def score_pending(pools, cfg, version: int) -> None:
    """Dense old-policy log-probs (and reference log-probs when the scorers hold the reference
    policy, ``cluster.pools.needs_reference``) for every buffer row waiting for them, split over
    the scorers. A scorer that died is replaced; the rows it held are released and scored again."""
    import ray
    from ray.exceptions import RayActorError

    from cluster.elastic import replace_dead
    from launch.recovery import buffer

    if cfg.scorer.num_actors == 0:  # rows come scored (launch.rollouts.own_scores); a resume
        if buffer(pools).pending_scoring(1).num_rows:  # cannot drop the scorers (checkpoint.py)
            raise RuntimeError("rows wait for a scorer in a run without one (scorer.num_actors=0)")
        return
    for attempt in range(2):
        pending = buffer(pools).pending_scoring(cfg.buffer.capacity)
        calls = [s.score.remote(part) for s, part in
                 zip(pools.scorer, split_rows(pending, len(pools.scorer)))]
        try:
            for ids, old, ref in ray.get(calls):
                buffer(pools).set_scores(ids, old, version, ref_logprobs=ref)
            return
        except RayActorError as err:
            if attempt:
                raise
            print(f"[elastic] scorer lost ({type(err).__name__}): {replace_dead(pools, cfg)}",
                  flush=True)
            buffer(pools).release(pending.column("sample_id").to_pylist())


def sync_weights(pools, cfg) -> tuple[int, dict]:
    """``broadcast_weights``; when a receiver died on the way, replace it (the group re-forms) and
    send again, so the job goes on without a restart. A dead peer fails the broadcast on every
    live member within ``cluster.weight_sync_timeout_s``, on gloo and NCCL alike
    (``cluster.sync_guard``): here as the learner's or a receiver's task error."""
    from ray.exceptions import RayActorError, RayTaskError

    from cluster.elastic import replace_dead
    from cluster.pools import broadcast_weights

    try:
        return broadcast_weights(pools)
    except (RayActorError, RayTaskError) as err:
        print(f"[elastic] weight broadcast failed ({type(err).__name__}): "
              f"{replace_dead(pools, cfg)}", flush=True)
        return broadcast_weights(pools)
