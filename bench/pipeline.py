"""Pipeline benchmark: async vs sync step time, learner idle fraction, weight-broadcast cost.

    python bench/pipeline.py [--quick] [--json PATH] [--steps N] [--mb 50] [--parts pipeline,broadcast]

Rows (printed as a table, and one JSON object each with --json), then one verdict line per bar:
- ``pipeline``: ``launch/train.py`` run in sync and in async mode on the default task with the same
  work (steps x prompts x G, 2 rollout actors), in two core layouts: ``shared`` (every pool may run
  on every core) and ``pinned`` (``cluster.*_cores``: rollout actors on half the cores, learner and
  scorer on the other half, standing in for the deployment's separate per-pool hardware). Median
  step time after the first step (other work on a shared machine makes single steps spike), the
  learner's busy time and idle fraction (1 - train time / step time), and async/sync ratio.
- ``broadcast``: the same bytes (``--mb`` in 8 tensors) from a sender to a receiver process through
  the weight-sync group (shared-memory ring and gloo over loopback TCP; into the receiver's buffers,
  then also copied into its model as actors' ``load_weights`` do, or straight ``into`` the model),
  a bare gloo broadcast,
  two memcpy baselines (a copy into an existing tensor, the fair floor; ``clone()``, which also
  allocates and page-faults) and the Ray object store; ratios to both baselines. Broadcast times
  run from a barrier to the later of the two sides' ends.
Issue bars: async <= 0.75x sync step time with >= 2 rollout actors; broadcast <= 2x memcpy on CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# Run as a script, this folder leads sys.path and `import buffer` would find bench/buffer.py
# instead of the buffer package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

MODEL = ".cache/models/tiny-base"


def core_layouts() -> dict[str, list[str]]:
    """Overrides per core layout: ``shared`` (every pool on every core) and ``pinned`` (rollout
    actors on the first half of this process's cores, learner + scorer on the rest), which stands
    in for the deployment's disjoint per-pool hardware on one machine."""
    cores = sorted(os.sched_getaffinity(0))
    layouts = {"shared": []}
    if len(cores) >= 2:
        half = len(cores) // 2
        roll, rest = cores[:half], cores[half:]
        layouts["pinned"] = [f"cluster.rollout_cores={roll}", f"cluster.learner_cores={rest}",
                             f"cluster.scorer_cores={rest}"]
    return layouts


def pipeline_rows(steps: int, out: Path) -> list[dict]:
    from launch.train import main

    rows = []
    for layout, overrides in core_layouts().items():
        part = []
        for mode in ("sync", "async"):
            summary = main([f"run.mode={mode}", f"run.steps={steps}", "run.eval_problems=16",
                            "rollout.num_actors=2", f"run.out_dir={out}",
                            f"run.name=bench-{layout}-{mode}", *overrides])
            recs = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").open()]
            train = [r for r in recs if "time/step_s" in r][1:]  # the first step has nothing to overlap
            step_s = statistics.median(r["time/step_s"] for r in train)
            learn_s = statistics.median(r.get("time/train_s", 0.0) for r in train)
            part.append({"bench": "pipeline", "variant": f"{layout}/{mode}", "steps": len(train),
                         "step_s": step_s, "learner_busy_s": learn_s,
                         "learner_idle_frac": max(0.0, 1 - learn_s / step_s)})
        for r in part:
            r["vs_sync"] = r["step_s"] / part[0]["step_s"]
        rows += part
    return rows


PARTS = 8  # the broadcast bench's bytes as this many equal tensors (one bucket each, pipelined)
VARIANTS = {("shm", "buffers"): "weight sync, shm ring (receiver's buffers)",
            ("shm", "load"): "weight sync, shm ring + load copy",
            ("shm", "into"): "weight sync, shm ring into model (actors)",
            ("tcp", "buffers"): "weight sync, gloo TCP (receiver's buffers)",
            ("tcp", "load"): "weight sync, gloo TCP + load copy",
            ("tcp", "into"): "weight sync, gloo TCP into model (actors, remote)",
            ("tcp", "raw"): "bare gloo broadcast, 1 tensor (TCP floor)"}


def _endpoint(rank: int, port: int, n: int, reps: int, mode: str, shm: bool) -> list[float]:
    """One side of a 2-rank weight-sync group; seconds per broadcast, each timed from a barrier
    to this side's end (with ``load`` and ``into``, the receiver's end has the weights in its model).

    Modes: ``buffers`` (the broadcast proper: the bytes are in the receiver's buffers), ``load``
    (then copied into the model, as ``load_weights`` does), ``into`` (received straight into
    destination tensors: what rollout and scorer actors do with their staging copy,
    ``actors.weights.StagedWeights``; the swap into the model is one more copy, paid by the actor
    between batches, off the broadcast's path) and ``raw`` (one bare gloo broadcast of one tensor: TCP's
    floor). ``shm``: the same-machine shared-memory ring (the
    default when every receiver is local) rather than gloo over loopback TCP.
    """
    from cluster.weight_sync import WeightReceiver, WeightSender

    spec = [(f"w{i}", (n // PARTS,), torch.float32) for i in range(PARTS)]
    model = {name: (torch.randn if rank == 0 else torch.zeros)(shape) for name, shape, _ in spec}
    group = (WeightSender("127.0.0.1", port, 2, spec, same_host_shm=shm) if rank == 0
             else WeightReceiver("127.0.0.1", port, 1, 2, spec))
    flat = torch.zeros(n) if mode == "raw" else None
    times = []
    for version in range(reps + 1):  # the first round touches every buffer: not timed
        group.pg.allreduce(torch.zeros(1)).wait()  # barrier: both sides start together
        t0 = time.perf_counter()
        if mode == "raw":
            group.pg.broadcast(flat, 0).wait()
        elif rank == 0:
            group.send(model.items(), version)
        elif mode == "into":
            group.receive(into=model)
        else:
            _, named = group.receive()
            for name, t in named if mode == "load" else ():
                model[name].copy_(t)
        times.append(time.perf_counter() - t0)
    return times[1:]


def _memcpy_rows(n: int, reps: int) -> list[tuple[str, float]]:
    """Two baselines, both one 1-thread copy of the same bytes: into a tensor that already exists
    (the fair floor: a receiver's model exists too) and ``clone()``, which also allocates and
    page-faults fresh memory."""
    torch.set_num_threads(1)  # like the actors (OMP_NUM_THREADS=1)
    src, dst = torch.randn(n), torch.empty(n)
    dst.copy_(src)
    prealloc = min(_timed(lambda: dst.copy_(src)) for _ in range(reps + 1))
    clone = min(_timed(lambda: src.clone()) for _ in range(reps + 1))
    return [("memcpy (copy_ into existing tensor)", prealloc), ("memcpy (clone: allocates)", clone)]


def broadcast_rows(mb: int, reps: int) -> list[dict]:
    import ray

    from cluster.weight_sync import free_port

    n = mb * (1 << 20) // 4 // PARTS * PARTS
    rows = []
    for transport, mode in (("shm", "buffers"), ("shm", "load"), ("shm", "into"), ("tcp", "buffers"),
                            ("tcp", "load"), ("tcp", "into"), ("tcp", "raw")):
        port = free_port()
        ends = [ray.remote(num_cpus=0.5)(_endpoint).remote(r, port, n, reps, mode, transport == "shm")
                for r in (0, 1)]
        send_t, recv_t = ray.get(ends)
        rows.append((VARIANTS[transport, mode],
                     min(max(a, b) for a, b in zip(send_t, recv_t))))
    rows += _memcpy_rows(n, reps)
    t = torch.randn(n)

    @ray.remote(num_cpus=0.5)
    def consume(x):
        return float(x[0])

    rows.append(("ray object store (put + remote get)",
                 min(_timed(lambda: ray.get(consume.remote(ray.put(t)))) for _ in range(reps))))
    base = dict(rows)["memcpy (copy_ into existing tensor)"]
    clone = dict(rows)["memcpy (clone: allocates)"]
    return [{"bench": "broadcast", "variant": v, "mb": mb, "seconds": sec, "vs_memcpy": sec / base,
             "vs_clone": sec / clone} for v, sec in rows]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and repetitions (~2-3 min)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--mb", type=int, default=50)
    p.add_argument("--parts", default="pipeline,broadcast", help="which benches, comma-separated")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = p.parse_args(argv)
    if not (Path(MODEL) / "config.json").is_file():
        raise SystemExit(f"{MODEL} is missing: run `make model` first")
    parts = set(args.parts.split(","))
    steps = args.steps or (5 if args.quick else 20)
    rows = pipeline_rows(steps, args.out) if "pipeline" in parts else []
    if "broadcast" in parts:
        import ray

        from cluster.config import ClusterConfig
        from cluster.ray_setup import start_ray

        start_ray(ClusterConfig(), args.out)
        try:
            rows += broadcast_rows(args.mb, 10 if args.quick else 30)
        finally:
            ray.shutdown()
    _print(rows)
    if args.json:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def bars(rows: list[dict]) -> list[str]:
    """Issue 6's bars, one verdict line each, from whichever rows were measured."""
    out = []
    pipe = [r for r in rows if r["bench"] == "pipeline"]
    best = {m: min((r["step_s"] for r in pipe if r["variant"].endswith(m)), default=None)
            for m in ("/sync", "/async")}
    if None not in best.values():  # pinning slows sync (rollouts get half the cores): say so
        out.append(f"(info) fastest async / fastest sync over layouts: "
                   f"{best['/async'] / best['/sync']:.2f}x")
    for r in rows:
        if r["bench"] == "pipeline" and r["variant"].endswith("/async"):
            ok = r["vs_sync"] <= 0.75
            out.append(f"async <= 0.75x sync ({r['variant'].split('/')[0]} cores): "
                       f"{r['vs_sync']:.2f}x -> {'PASS' if ok else 'fail'}")
        if r["bench"] == "broadcast" and r["variant"].startswith("weight sync"):
            ok = r["vs_memcpy"] <= 2.0
            out.append(f"broadcast <= 2x memcpy ({r['variant']}): {r['vs_memcpy']:.2f}x of a copy "
                       f"into an existing tensor, {r['vs_clone']:.2f}x of clone -> "
                       f"{'PASS' if ok else 'fail'}")
    return out


def _print(rows: list[dict]) -> None:
    for bench in ("pipeline", "broadcast"):
        part = [r for r in rows if r["bench"] == bench]
        if not part:
            continue
        keys = [k for k in part[0] if k != "bench"]
        width = max(len(str(r["variant"])) for r in part) + 2
        print(f"\n{bench}\n" + f"{keys[0]:<{width}}" + "  ".join(f"{k:>18}" for k in keys[1:]))
        for r in part:
            print(f"{r[keys[0]]:<{width}}" + "  ".join(
                f"{r[k]:>18.4g}" if isinstance(r[k], float) else f"{r[k]!s:>18}" for k in keys[1:]))
    print("\nissue 6 bars:\n" + "\n".join(f"  {line}" for line in bars(rows)))


if __name__ == "__main__":
    main()
