"""Host syncs and aten ops of the native engine's decode step and compression (issue 27's CPU proxy).

    python bench/decode_profile.py                      # dense + every policy at batch 16 and 64
    python bench/decode_profile.py --json runs/decode_profile.json

A GPU decode step is host-bound when the host issues many small kernels or waits for the device.
Both are counted here on the CPU, where no GPU is needed to see them:
- ``ops``: aten operators dispatched (``TorchDispatchMode``); ``kernels``: those that are not views
  (a GPU launches a kernel for each);
- ``syncs``: points where the host waits for a device value: the aten ops that need one
  (``_local_scalar_dense`` behind ``.item()``/``int()``/``bool()``, ``nonzero``,
  ``masked_select``, ``unique``, ...) plus reads of a tensor into host memory (``.cpu()``,
  ``.tolist()``, ``.numpy()``, ``.item()``, ``bool()``/``int()``/``float()`` of a tensor, seen by a
  ``TorchFunctionMode``: on a CPU tensor they dispatch nothing, on a GPU each is a copy that waits).
Every torch tensor of the engine's loop lives on its device; host bookkeeping is numpy.

A generation of ``--batch`` random prompts (``--prompt-len`` tokens, all admitted at once) decodes
``--gen-len`` tokens with stop tokens in play (so the sampled tokens are read, as in RL) at budget
``--budget`` / N = ``--every``. A loop iteration is everything between two decode-step calls; the
ones that admit prompts are left out, and those that compress are counted apart: per row
{policy, batch, syncs_per_step (most over non-compressing iterations), ops_per_step and
kernels_per_step (means), syncs_per_compression, ops_per_compression and kernels_per_compression
(means per compression call)}.
Bars: <= 1 sync per non-compressing step for dense and every policy; ops per compression at batch
64 <= 1.1x those at batch 16. ``snapkv-adaptive`` / ``rkv-adaptive``: the policy with the per-row
adaptive budget (``rollout.kv.keep_mass`` = ``--keep-mass``, ``min_budget`` = ``--min-budget``),
whose compression reads the rows' budgets from the device once by design
(``syncs_per_compression`` 1, against 0 for a fixed budget).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from actors.config import KVConfig  # noqa: E402
from actors.engine import SamplingParams  # noqa: E402
from actors.native import NativeEngine  # noqa: E402

POLICIES = ("dense", "streaming", "h2o", "snapkv", "rkv", "snapkv-adaptive", "rkv-adaptive")
ADAPTIVE = "-adaptive"
SYNC_OPS = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique",
            "_unique", "_unique2", "unique_dim", "unique_consecutive", "is_nonzero", "item",
            "equal", "allclose", "repeat_interleave_tensor"}
# views and other metadata-only ops: no kernel on a GPU (``kernels`` leaves them out)
VIEWS = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "expand", "transpose",
         "t", "permute", "as_strided", "alias", "split", "split_with_sizes", "chunk", "unbind",
         "detach", "narrow", "diagonal", "_reshape_alias", "view_as"}
HOST_READS = {"cpu", "tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__"}
BAR_SYNCS, BAR_COMPRESS = 1, 1.1


class Counts:
    """Ops and syncs, routed to the current bucket (a step, or a compression)."""

    def __init__(self):
        self.bucket = None

    def add(self, key: str) -> None:
        if self.bucket is not None:
            self.bucket[key] = self.bucket.get(key, 0) + 1


class _Ops(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts.add("ops")
        if name not in VIEWS:
            self.counts.add("kernels")
        if name in SYNC_OPS or (name == "repeat_interleave" and isinstance(args[0], torch.Tensor)
                                and len(args) > 1 and isinstance(args[1], torch.Tensor)):
            self.counts.add("syncs")
        return func(*args, **(kwargs or {}))


class _Reads(TorchFunctionMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.counts.add("syncs")
        elif getattr(func, "__name__", "") == "to" and _to_host(args, kwargs or {}):
            self.counts.add("syncs")
        return func(*args, **(kwargs or {}))


def _to_host(args, kwargs) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


def profile(engine: NativeEngine, prompts, params: SamplingParams) -> dict:
    """Run one generation under the counters; per-iteration and per-compression counts."""
    counts, steps, comps = Counts(), [], []
    state = {"admit": False, "compress": False}
    runner, compress, admit = engine.stepper, engine._compress, engine._admit

    def step(*a, **k):
        out = runner(*a, **k)
        if not state["admit"]:
            steps.append(dict(counts.bucket, compress=state["compress"]))
        counts.bucket, state["admit"], state["compress"] = {"ops": 0, "kernels": 0, "syncs": 0}, False, False
        return out

    def compress_(*a, **k):
        outer, counts.bucket = counts.bucket, {"ops": 0, "kernels": 0, "syncs": 0}
        compress(*a, **k)
        comps.append(counts.bucket)
        for key, v in counts.bucket.items():
            outer[key] = outer.get(key, 0) + v
        counts.bucket, state["compress"] = outer, True

    def admit_(*a, **k):
        state["admit"] = True
        return admit(*a, **k)

    engine.stepper = _Wrapped(runner, step)    # instance attributes shadow the methods
    engine._compress, engine._admit = compress_, admit_
    counts.bucket = {"ops": 0, "kernels": 0, "syncs": 0}
    try:
        with _Reads(counts), _Ops(counts):
            engine.generate(prompts, params)
    finally:
        del engine._compress, engine._admit
        engine.stepper = runner
    return _summary(steps, comps)


def _summary(steps: list[dict], comps: list[dict]) -> dict:
    plain = [s for s in steps if not s["compress"]]
    mean = lambda xs: sum(xs) / max(1, len(xs))   # noqa: E731
    return {"steps": len(plain), "syncs_per_step": max((s["syncs"] for s in plain), default=0),
            "syncs_per_step_mean": mean([s["syncs"] for s in plain]),
            "ops_per_step": mean([s["ops"] for s in plain]),
            "kernels_per_step": mean([s["kernels"] for s in plain]), "compressions": len(comps),
            "syncs_per_compression": max((c["syncs"] for c in comps), default=0),
            "ops_per_compression": mean([c["ops"] for c in comps]),
            "kernels_per_compression": mean([c["kernels"] for c in comps])}


class _Wrapped:
    """The engine's step runner with its call replaced (the rest delegated)."""

    def __init__(self, runner, call):
        self._runner, self._call = runner, call

    def __call__(self, *a, **k):
        return self._call(*a, **k)

    def __getattr__(self, name):
        return getattr(self._runner, name)


def kv_config(name: str, args) -> KVConfig:
    """A row's KV config: ``name`` is a policy, or a policy + ``-adaptive`` (the per-row budget)."""
    if not name.endswith(ADAPTIVE):
        return KVConfig(policy=name, budget=args.budget, compress_every=args.every)
    return KVConfig(policy=name.removesuffix(ADAPTIVE), budget=args.budget,
                    compress_every=args.every, keep_mass=args.keep_mass,
                    min_budget=args.min_budget or args.budget // 2)


def run(model, policies, batches, args) -> list[dict]:
    rows = []
    for policy in policies:
        for batch in batches:
            kv = kv_config(policy, args)
            kv.validate("decode_profile")
            eng = NativeEngine(model, kv, batch_size=batch, step="eager")
            g = torch.Generator().manual_seed(0)
            prompts = torch.randint(3, model.config.vocab_size, (batch, args.prompt_len),
                                    generator=g).tolist()
            params = SamplingParams(max_new_tokens=args.gen_len, seed=0, stop_token_ids=(1, 2))
            rows.append({"policy": policy, "batch": batch, **profile(eng, prompts, params)})
    return rows


def bars(rows: list[dict]) -> list[str]:
    out = []
    worst = max(rows, key=lambda r: r["syncs_per_step"])
    out.append(f"syncs per non-compressing step <= {BAR_SYNCS} (dense and every policy): "
               f"{'PASS' if worst['syncs_per_step'] <= BAR_SYNCS else 'FAIL'} "
               f"(most {worst['syncs_per_step']}, {worst['policy']} at batch {worst['batch']})")
    by = {(r["policy"], r["batch"]): r for r in rows}
    for policy in sorted({r["policy"] for r in rows if r["compressions"]}):
        a, b = by.get((policy, 16)), by.get((policy, 64))
        if a is None or b is None:
            out.append(f"{policy}: ops per compression at batch 64 vs 16: MISSING")
            continue
        ratio = b["ops_per_compression"] / max(1e-9, a["ops_per_compression"])
        out.append(f"{policy}: ops per compression at batch 64 vs 16 <= {BAR_COMPRESS}x: "
                   f"{'PASS' if ratio <= BAR_COMPRESS else 'FAIL'} ({ratio:.2f}x)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=160)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--every", type=int, default=32)
    ap.add_argument("--keep-mass", type=float, default=0.9,
                    help="the -adaptive rows' rollout.kv.keep_mass")
    ap.add_argument("--min-budget", type=int, default=0,
                    help="the -adaptive rows' rollout.kv.min_budget (0: half of --budget)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from common.modeling import load_model
    from common.testmodels import build_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(build_model(Path(tmp) / "m", "tiny", seed=0))
    rows = run(model, args.policies.split(","), [int(b) for b in args.batches.split(",")], args)
    cols = ("policy", "batch", "steps", "syncs_per_step", "ops_per_step", "kernels_per_step",
            "compressions", "syncs_per_compression", "ops_per_compression",
            "kernels_per_compression")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c])
                                for c in cols) + " |")
    print("\nbars:\n  " + "\n  ".join(bars(rows)))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "bars": bars(rows)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
