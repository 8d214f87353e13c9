"""Resize the rollout or scorer pool of a running job, between two steps.

    python -m launch.resize RUN_DIR rollout=8 [scorer=2]

writes ``RUN_DIR/resize.json`` (atomically); the driver of that run reads it after its next weight
broadcast (``launch/train.py`` step 6e, ``apply_requested``), lands every rollout still in flight in
the buffer (so no actor with work is removed and no sample is lost), grows or shrinks the pools with
``cluster.elastic.resize_pool`` (new actors get the learner's current weights; on KubeRay, actors
that do not fit make the autoscaler add worker pods up to the group's ``maxReplicas``), records the
new sizes in the run's config (checkpoints and a resumed run keep them) and deletes the file. A
request it cannot apply (bad JSON, a pool it does not know, a size below 1, a scorer pool the run
was started without) is renamed to
``resize.json.rejected`` with the reason printed; the run goes on unchanged.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REQUEST = "resize.json"
ROLES = ("rollout", "scorer")


def parse_request(pairs: dict) -> dict[str, int]:
    """``{"rollout": 8}`` checked: known pools, whole sizes >= 1; ValueError naming the entry."""
    if not isinstance(pairs, dict) or not pairs:
        raise ValueError(f"a resize request is an object like {{\"rollout\": 4}}, got {pairs!r}")
    out = {}
    for role, n in pairs.items():
        if role not in ROLES:
            raise ValueError(f"unknown pool {role!r} (resizable: {', '.join(ROLES)})")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{role}={n!r}: a pool size is a whole number >= 1")
        out[role] = n
    return out


def request(run_dir: str | Path, sizes: dict[str, int]) -> Path:
    """Write ``run_dir/resize.json`` for the running driver (tmp file + rename: it never reads
    half a request)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"{run_dir} is not a run folder (no config.yaml)")
    sizes = parse_request(sizes)
    tmp = run_dir / f".{REQUEST}.tmp"
    tmp.write_text(json.dumps(sizes))
    os.replace(tmp, run_dir / REQUEST)
    return run_dir / REQUEST


def apply_requested(run_dir: str | Path, in_flight, pools, cfg, version: int, note=None) -> dict:
    """The pending request of ``run_dir``, if any, applied (see the module doc; ``note``: as for
    ``launch.rollouts.land_rollouts``). Returns metrics:
    the pool sizes after a resize (``resize/rollout_actors``, ``resize/scorer_actors``), or {}."""
    from cluster.elastic import resize_pool
    from launch.rollouts import land_rollouts

    path = Path(run_dir) / REQUEST
    if not path.is_file():
        return {}
    try:
        sizes = parse_request(json.loads(path.read_text()))
        if "scorer" in sizes and cfg.scorer.num_actors == 0:  # the anchor's version would change
            raise ValueError("this run has no scorer pool (scorer.num_actors=0: its rollout "
                             "actors score their own samples), so it cannot be resized")
    except ValueError as err:  # json.JSONDecodeError is a ValueError too
        os.replace(path, path.with_name(REQUEST + ".rejected"))
        print(f"[resize] {path} rejected: {err}", flush=True)
        return {}
    land_rollouts(in_flight, pools, cfg, version, note)  # no actor is removed with a batch in flight
    report = []
    for role, n in sizes.items():
        report += resize_pool(pools, cfg, role, n)
        getattr(cfg, role).num_actors = n  # checkpoints (config.yaml) and resumes keep the size
    path.unlink()
    print(f"[resize] {sizes}: {report or 'no change'}", flush=True)
    return {f"resize/{role}_actors": len(getattr(pools, role)) for role in ROLES}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    try:
        sizes = {}
        for arg in argv[1:]:
            role, sep, n = arg.partition("=")
            if not sep or not n.strip().isdigit():
                raise ValueError(f"{arg!r}: expected POOL=N, e.g. rollout=8")
            sizes[role] = int(n)
        path = request(argv[0], sizes)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"requested {sizes}: the driver applies it after its next weight broadcast ({path})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
