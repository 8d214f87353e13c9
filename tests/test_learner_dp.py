"""Two data-parallel learner processes (DeepSpeed ZeRO over gloo on CPU).

The batch is prepared once on the whole batch (``learner.batch.prepare_batch``: GRPO advantages,
the default Sparse-RL correction with its batch-normalised IS weights) and split by
``shard_batch``: rank 0 trains on two GRPO groups, rank 1 on one (unequal shards exercise the
padding micro-batch that keeps ZeRO's collectives in step), in two mini-batches (two optimiser
steps). Both ranks must hold bit-identical weights, equal (up to float summation order) to one
learner stepping on the whole batch; the ranks' reduced metrics equal the single learner's. Under
ZeRO-3 the two ranks also stream a broadcast together (one gathered parameter at a time).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest
import torch

from cluster.weight_sync import free_port
from common.modeling import load_model
from correction import CorrectionConfig
from learner.batch import prepare_batch, reduce_metrics, shard_batch
from learner.config import LearnerConfig
from common.testmodels import build_model
from learner.testing import make_batch

_EXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".cache", "torch_extensions")


def _cfgs(stage: int, world: int):
    # the default (sparse_rl) correction: its IS weights are normalised over the whole batch
    return (LearnerConfig(num_learners=world, zero_stage=stage, lr=1e-3, micro_batch_size=3,
                          mini_batches=2), CorrectionConfig())


def _prepared(model_dir) -> dict:
    """3 groups of 4, sampler log-probs off the model's by noise 0.3 (tokens get rejected and the
    IS weights are far from 1, so a per-shard normalisation would change the update)."""
    batch = make_batch(num_groups=3, group_size=4, model=load_model(model_dir), noise=0.3)
    return prepare_batch(batch, CorrectionConfig(), 0, mini_batches=2)


def _sent_checksum(lrn, port) -> float:
    """Rank 0's streamed broadcast as a receiver in a thread sees it (every rank gathers)."""
    import threading

    from common.modeling import checksum
    from cluster.weight_sync import WeightReceiver

    got = {}

    def receive():
        r = WeightReceiver("127.0.0.1", port, 1, 2, lrn.weight_spec(), timeout_s=60)
        got["sum"] = checksum(r.receive()[1])

    th = threading.Thread(target=receive)
    th.start()
    lrn.init_weight_sync("127.0.0.1", port, 2, "gloo", bucket_mb=1)
    lrn.broadcast_weights()
    th.join(60)
    return got["sum"]


def _worker(rank, world, port, model_dir, stages, q):
    """Each stage in turn in one process (DeepSpeed's group is made once per process, then reused)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", _EXT)
    torch.set_num_threads(1)
    try:
        from learner.learner import Learner

        shard = shard_batch(_prepared(model_dir)[0], world)[rank]
        out = {}
        for stage in stages:
            cfg, corr = _cfgs(stage, world)
            lrn = Learner(cfg, corr, model_dir, rank=rank, world_size=world, master_port=port)
            m = lrn.train_step(shard, temperature=1.0)
            # numpy, not tensors: torch pickles tensors via shared memory that dies with the process
            weights = {n: t.float().numpy() for n, t in lrn.named_weights()}  # ZeRO-3: gathered
            sent = None
            if stage == 3:
                sent = _sent_checksum(lrn, port + 1) if rank == 0 else lrn.broadcast_weights()
            out[stage] = (m, lrn.version, weights, sent, lrn.state_checksum())
        q.put((rank, "ok", out))
    except Exception as e:
        q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("tiny_dp") / "model")


_STAGES = (2, 3)


@pytest.fixture(scope="module")
def dp_results(model_dir):
    """Run both learner processes once, for every stage;
    {rank: {stage: (metrics, version, weights, streamed checksum, state checksum)}}."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()   # (port + 1: the ZeRO-3 broadcast's group)
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
    (m0, v0, w0, sent, sum0), (m1, v1, w1, _, sum1) = dp_results[0][stage], dp_results[1][stage]
    # mini-batches: groups {0, 1} and {2}; rank 0 gets group 0 (4 rows: 2 micro-batches of <= 3)
    # and group 2, rank 1 group 1 and nothing of the second (padding micro-batches instead)
    assert m0["learner/micro_batches"] == m1["learner/micro_batches"] == 4
    assert m0["learner/optimizer_steps"] == m1["learner/optimizer_steps"] == 2
    assert v0 == v1 == 1
    for n in w0:  # data parallel replicas agree exactly
        assert (w0[n] == w1[n]).all(), n
    assert sum0 == sum1
    if stage == 3:  # what rank 0 streamed is what the ranks hold
        assert sent == pytest.approx(sum0, rel=1e-9)

    from learner.learner import Learner  # one learner, whole batch (this process's own group)

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", _EXT)
    cfg, corr = _cfgs(stage, 1)
    single = Learner(cfg, corr, model_dir, master_port=free_port())
    prepared, corr_metrics = _prepared(model_dir)
    assert corr_metrics["correction/frac_rejected"] > 0 and corr_metrics["correction/norm_scale"] != 1
    m = single.train_step(prepared)
    for n, t in single.named_weights():
        torch.testing.assert_close(torch.from_numpy(w0[n]), t, rtol=1e-4, atol=2e-5)
    both = reduce_metrics([m0, m1])
    for k in ("loss", "loss/pg", "loss/clipfrac", "loss/ratio_mean", "learner/kept_tokens",
              "learner/rows", "loss/num_kept_tokens"):
        assert both[k] == pytest.approx(m[k], rel=1e-4, abs=1e-7), k
