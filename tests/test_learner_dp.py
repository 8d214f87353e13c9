"""Two data-parallel learner processes (DeepSpeed ZeRO over gloo on CPU).

Rank 0 trains on two GRPO groups, rank 1 on one (unequal shards exercise the padding micro-batch
that keeps ZeRO's collectives in step). After one step both ranks must hold bit-identical weights,
equal (up to float summation order) to one learner stepping on the whole batch.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest
import torch

from cluster.weight_sync import free_port
from common.modeling import load_model
from correction import CorrectionConfig, CorrectionMethod
from learner.config import LearnerConfig
from learner.testing import make_batch, make_tiny_model

_EXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".cache", "torch_extensions")


def _cfgs(stage: int, world: int):
    # method none: IS weights are 1, so shard-wise normalisation cannot differ from the full batch
    return (LearnerConfig(num_learners=world, zero_stage=stage, lr=1e-3, micro_batch_size=3),
            CorrectionConfig(method=CorrectionMethod.NONE))


def _shard(batch: dict, rows: slice) -> dict:
    return {k: v[rows] for k, v in batch.items()}


def _worker(rank, world, port, model_dir, stages, q):
    """Each stage in turn in one process (DeepSpeed's group is made once per process, then reused)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", _EXT)
    torch.set_num_threads(1)
    try:
        from learner.learner import Learner

        batch = make_batch(num_groups=3, group_size=4, model=load_model(model_dir))
        rows = slice(0, 8) if rank == 0 else slice(8, 12)
        out = {}
        for stage in stages:
            cfg, corr = _cfgs(stage, world)
            lrn = Learner(cfg, corr, model_dir, rank=rank, world_size=world, master_port=port)
            m = lrn.train_step(_shard(batch, rows), temperature=1.0)
            # numpy, not tensors: torch pickles tensors via shared memory that dies with the process
            weights = ({n: t.float().numpy() for n, t in lrn.named_weights()}
                       if rank == 0 or stage < 3 else None)
            out[stage] = (m["learner/micro_batches"], lrn.version, weights)
        q.put((rank, "ok", out))
    except Exception as e:
        q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_dp") / "model")


_STAGES = (2, 3)


@pytest.fixture(scope="module")
def dp_results(model_dir):
    """Run both learner processes once, for every stage; {rank: {stage: (mb, version, weights)}}."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, model_dir, _STAGES, q))
             for r in range(2)]
    for p in procs:
        p.start()
    res = {}
    for _ in procs:
        rank, status, payload = q.get(timeout=240)
        res[rank] = (status, payload)
    for p in procs:
        p.join(timeout=30)
    assert all(s == "ok" for s, _ in res.values()), res
    return {r: payload for r, (_, payload) in res.items()}


@pytest.mark.slow
@pytest.mark.parametrize("stage", _STAGES)
def test_two_learners_identical_and_equal_to_one(model_dir, dp_results, stage):
    (mb0, v0, w0), (mb1, v1, w1) = dp_results[0][stage], dp_results[1][stage]
    assert mb0 == mb1 == 3 and v0 == v1 == 1
    if w1 is not None:  # data parallel replicas agree exactly (ZeRO-3 keeps full weights on rank 0)
        for n in w0:
            assert (w0[n] == w1[n]).all(), n

    from learner.learner import Learner  # one learner, whole batch (this process's own group)

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", _EXT)
    cfg, corr = _cfgs(stage, 1)
    single = Learner(cfg, corr, model_dir, master_port=free_port())
    single.train_step(make_batch(num_groups=3, group_size=4, model=load_model(model_dir)))
    for n, t in single.named_weights():
        torch.testing.assert_close(torch.from_numpy(w0[n]), t, rtol=1e-4, atol=2e-5)
