"""Pipeline benchmark: async vs sync step time, learner idle fraction, weight-broadcast cost.

    python bench/pipeline.py [--quick] [--json PATH] [--steps N] [--mb 50]

Rows (printed as a table, and one JSON object each with --json):
- ``pipeline``: ``launch/train.py`` run in sync and in async mode on the default task with the same
  work (steps x prompts x G, 2 rollout actors); mean step time after the first step, the learner's
  idle fraction (1 - train time / step time) and async/sync ratio.
- ``broadcast``: the same bytes sent learner -> receiver through the gloo weight-sync group, copied
  in memory (memcpy), and passed through the Ray object store; ratios to memcpy.
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


def pipeline_rows(steps: int, out: Path) -> list[dict]:
    from launch.train import main

    rows = []
    for mode in ("sync", "async"):
        summary = main([f"run.mode={mode}", f"run.steps={steps}", "run.eval_problems=16",
                        "rollout.num_actors=2", f"run.out_dir={out}", f"run.name=bench-{mode}"])
        recs = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").open()]
        train = [r for r in recs if "time/step_s" in r][1:]  # the first step has nothing to overlap
        step_s = statistics.mean(r["time/step_s"] for r in train)
        learn_s = statistics.mean(r.get("time/train_s", 0.0) for r in train)
        rows.append({"bench": "pipeline", "variant": mode, "steps": len(train), "step_s": step_s,
                     "learner_busy_s": learn_s, "learner_idle_frac": max(0.0, 1 - learn_s / step_s)})
    for r in rows:
        r["vs_sync"] = r["step_s"] / rows[0]["step_s"]
    return rows


def _sender(port: int, n: int, reps: int):
    from cluster.weight_sync import WeightSender

    spec = [("w", (n,), torch.float32)]
    s = WeightSender("127.0.0.1", port, 2, spec)
    t = torch.randn(n)
    times = []
    for v in range(reps):
        t0 = time.perf_counter()
        s.send([("w", t)], v)
        times.append(time.perf_counter() - t0)
    return min(times)


def _receiver(port: int, n: int, reps: int):
    from cluster.weight_sync import WeightReceiver

    r = WeightReceiver("127.0.0.1", port, 1, 2, [("w", (n,), torch.float32)])
    for _ in range(reps):
        r.receive()
    return True


def broadcast_rows(mb: int, reps: int) -> list[dict]:
    import ray

    from cluster.weight_sync import free_port

    n = mb * (1 << 20) // 4
    port = free_port()
    send = ray.remote(num_cpus=0.5)(_sender).remote(port, n, reps)
    recv = ray.remote(num_cpus=0.5)(_receiver).remote(port, n, reps)
    bcast_s = ray.get(send)
    ray.get(recv)
    t = torch.randn(n)
    memcpy_s = min(_timed(lambda: t.clone()) for _ in range(reps))

    @ray.remote(num_cpus=0.5)
    def consume(x):
        return float(x[0])

    store_s = min(_timed(lambda: ray.get(consume.remote(ray.put(t)))) for _ in range(reps))
    rows = [{"bench": "broadcast", "variant": v, "mb": mb, "seconds": s}
            for v, s in (("gloo_broadcast", bcast_s), ("memcpy", memcpy_s), ("ray_object_store", store_s))]
    for r in rows:
        r["vs_memcpy"] = r["seconds"] / memcpy_s
    return rows


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and repetitions (~2-3 min)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--mb", type=int, default=50)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = p.parse_args(argv)
    if not (Path(MODEL) / "config.json").is_file():
        raise SystemExit(f"{MODEL} is missing: run `make model` first")
    steps = args.steps or (6 if args.quick else 20)
    rows = pipeline_rows(steps, args.out)
    import ray

    from cluster.config import ClusterConfig
    from cluster.ray_setup import start_ray

    start_ray(ClusterConfig(), args.out)
    try:
        rows += broadcast_rows(args.mb, 3 if args.quick else 10)
    finally:
        ray.shutdown()
    _print(rows)
    if args.json:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _print(rows: list[dict]) -> None:
    for bench in ("pipeline", "broadcast"):
        part = [r for r in rows if r["bench"] == bench]
        keys = [k for k in part[0] if k != "bench"]
        print(f"\n{bench}\n" + "  ".join(f"{k:>18}" for k in keys))
        for r in part:
            print("  ".join(f"{r[k]:>18.4g}" if isinstance(r[k], float) else f"{r[k]!s:>18}"
                            for k in keys))


if __name__ == "__main__":
    main()
