"""Decode cost model of the engine in use, measured and cached per (model, machine).

Two least-squares fits over timed calls of the native engine's own decode step and compression:
    step_s(batch, kv)     = a + b * batch + c * batch * kv           (one decode step, every layer)
    compress_s(batch, kv) = d + e * batch * kv + f * batch * kv ** 2 (one compression of a full
                                                                     cache of kv slots; R-KV's key
                                                                     similarity is quadratic)
Points alternate between a fitting set and a held-out set; ``error`` is the mean relative error on
the held-out points (reported in metrics and the bench). The fit is cached as JSON under
``<cache_dir>/<key>.json``, key = hash of the model's config, dtype, KV policy and compress_every,
the device name and host, so a re-run on the same machine reuses it.
"""
from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class CostModel:
    step: list[float]                 # a, b, c
    compress: list[float]             # d, e, f
    error: dict = field(default_factory=dict)   # held-out mean relative error per fit
    key: str = ""

    def step_s(self, batch: int, kv: float) -> float:
        a, b, c = self.step
        return max(0.0, a + b * batch + c * batch * kv)

    def compress_s(self, batch: int, kv: float) -> float:
        d, e, f = self.compress
        return max(0.0, d + e * batch * kv + f * batch * kv * kv)

    def token_s(self, position: int, budget: int, compress_every: int, batch: int) -> float:
        """Seconds per generated token at ``position`` under ``budget`` (a row holds its position's
        worth of slots until it first reaches budget + compress_every, then budget plus half a
        period on average, and pays a compression every compress_every tokens)."""
        if position < budget + compress_every:
            return self.step_s(batch, position) / batch
        return (self.step_s(batch, budget + compress_every / 2)
                + self.compress_s(batch, budget + compress_every) / compress_every) / batch

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        return cls(**d)


def slots_held(position: int, budget: int, compress_every: int) -> float:
    """KV slots a row holds when it writes ``position`` under ``budget`` (its position's worth
    until it first fills budget + compress_every, then budget plus half a period on average)."""
    if position < budget + compress_every:
        return float(position + 1)
    return budget + compress_every / 2


def bin_cost(objective: str, model: "CostModel | None", bin_tokens: int, compress_every: int,
             batch: int, counts: dict[int, int]):
    """``cost(bin, budget)`` for ``schedule.plan.plan``: over the ``counts[bin]`` probe tokens of a
    bin, predicted decode seconds (``objective="speed"``, needs ``model``) or KV slots held
    (``"memory"``), each position of the bin weighted alike."""
    def per_bin(k: int, budget: int) -> float:
        span = range(k * bin_tokens, (k + 1) * bin_tokens)
        if objective == "memory":
            per = [slots_held(p, budget, compress_every) for p in span]
        else:
            per = [model.token_s(p, budget, compress_every, batch) for p in span]
        return counts.get(k, 0) * sum(per) / bin_tokens
    return per_bin


def lstsq(features: list[list[float]], y: list[float]) -> list[float]:
    x = torch.tensor(features, dtype=torch.float64)
    t = torch.tensor(y, dtype=torch.float64)
    return torch.linalg.lstsq(x, t[:, None]).solution[:, 0].tolist()


def _rel_error(coef, features, y) -> float:
    pred = [sum(c * f for c, f in zip(coef, row)) for row in features]
    return sum(abs(p - t) / t for p, t in zip(pred, y)) / max(1, len(y))


def fit(points: list[dict]) -> CostModel:
    """points: {"kind": "step"|"compress", "batch", "kv", "seconds", "held_out": bool}."""
    coefs, errors = {}, {}
    feats = {"step": lambda b, s: [1.0, b, b * s], "compress": lambda b, s: [1.0, b * s, b * s * s]}
    for kind, make in feats.items():
        train = [p for p in points if p["kind"] == kind and not p["held_out"]]
        test = [p for p in points if p["kind"] == kind and p["held_out"]]
        coefs[kind] = lstsq([make(p["batch"], p["kv"]) for p in train], [p["seconds"] for p in train])
        errors[kind] = _rel_error(coefs[kind], [make(p["batch"], p["kv"]) for p in test],
                                  [p["seconds"] for p in test])
    return CostModel(coefs["step"], coefs["compress"], errors)


def cache_key(engine, model_path: str) -> str:
    """Model config, dtype, policy, compress_every, device and host."""
    cfg = Path(model_path, "config.json")
    device = (torch.cuda.get_device_name() if engine.device.type == "cuda"
              else f"{platform.processor() or platform.machine()}-t{torch.get_num_threads()}")
    parts = [cfg.read_text() if cfg.is_file() else model_path, str(engine.dec.dtype),
             engine.policy.value, str(engine.kv.compress_every), device, platform.node()]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


@torch.no_grad()
def measure(engine, batches=(4, 16, 32), kv_lens=(16, 32, 64, 128, 256, 384), repeats: int = 3
            ) -> list[dict]:
    """Time the engine's decode step and compression on caches of random keys (what they cost
    does not depend on the values). Every other kv length is held out of the fit."""
    from actors.native.kvcache import KVPool
    from actors.native.model import RopeTable

    dec, dev, kv_cfg = engine.dec, engine.device, engine.kv
    dec.refresh()
    rope = RopeTable(dec, max(kv_lens) + 2, dev)
    need_acc = engine.policy.value == "h2o"
    window = kv_cfg.obs_window if engine.policy.value in ("snapkv", "rkv") else 0
    points = []
    for batch in batches:
        for j, kv in enumerate(kv_lens):
            pool = KVPool(dec.n_layers, batch, dec.n_kv, dec.n_heads, dec.head_dim, kv + 1,
                          dec.dtype, need_acc=need_acc, obs_window=window, device=dev)
            for t in (pool.k, pool.v) + ((pool.qwin,) if window else ()):
                t.normal_()
            pool.pos.copy_(torch.arange(kv + 1, device=dev).expand_as(pool.pos))

            def reset(kv=kv, pool=pool):
                pool.n.fill_(kv)
                pool.seen.fill_(kv)

            points.append(_timed("step", batch, kv, j % 2 == 1, repeats, lambda: (
                reset(), engine.stepper(dec, pool, rope, batch, kv, need_acc))))
            keep = max(1, min(kv - kv_cfg.compress_every, kv - 1, kv // 2 + window), window)
            points.append(_timed("compress", batch, kv, j % 2 == 1, repeats, lambda: (
                reset(), _compress_to(engine, pool, batch, keep))))
    return points


def _compress_to(engine, pool, rows: int, keep: int) -> None:
    n, seen = pool.n[:rows], pool.seen[:rows]
    for i in range(engine.dec.n_layers):
        engine._compress_layer(pool, i, rows, n, seen, keep, None)


def _timed(kind, batch, kv, held_out, repeats, fn) -> dict:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return {"kind": kind, "batch": batch, "kv": kv, "seconds": best, "held_out": held_out}


def load_or_measure(engine, model_path: str, cache_dir: str | Path) -> CostModel:
    """The cached fit for this (model, machine), else measure, fit and cache it."""
    key = cache_key(engine, model_path)
    path = Path(cache_dir) / f"{key}.json"
    if path.is_file():
        return CostModel.from_dict(json.loads(path.read_text()))
    model = fit(measure(engine))
    model.key = key
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(model)))
    tmp.replace(path)
    return model
