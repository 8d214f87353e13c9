"""The staleness split wired from rollout to learner: the rollout's dense log-probs at its own
version (``dense_sampler_logprobs``), their buffer column and tensors, old segments without the
column, the config cross-checks, and ``Learner.train_step`` with ``correction.staleness.enabled``."""
from __future__ import annotations

import math
import os

import numpy as np
import pyarrow as pa
import pytest
import torch

from actors.config import KVConfig, RolloutConfig, ScorerConfig
from actors.rollout import RolloutActor
from actors.scorer import ScorerActor
from buffer import BufferConfig, ReplayBuffer, SCHEMA
from buffer.schema import normalize_batch, rows_to_batch, upgrade
from buffer.storage import SegmentStore
from buffer.synth import dense_scores, synthetic_rows
from buffer.tensors import to_tensors
from common.errors import ConfigError
from common.modeling import load_model
from learner.testing import train
from common.testmodels import build_model
from correction import CorrectionConfig, correct
from tasks.base import Problem
from conftest import ContainsAnswer

torch.set_num_threads(1)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache",
                                                           "torch_extensions"))
_PORT = 29763
COL = "dense_sampler_logprobs"


def _with_dense(rows, seed=0):
    rng = np.random.default_rng(seed)
    for r in rows:
        r[COL] = (-rng.random(len(r["response_ids"]), dtype=np.float32)).tolist()
    return rows


# ---- buffer ---------------------------------------------------------------------------------

def test_column_round_trips_through_append_and_sample_batch(tmp_path):
    rows = _with_dense(synthetic_rows(2, 3, version=4))
    for root in (None, str(tmp_path / "buf")):
        buf = ReplayBuffer(BufferConfig(fsync=False), root=root)
        buf.append(rows)
        p = buf.pending_scoring(100)
        buf.set_scores(p.column("sample_id").to_pylist(), dense_scores(p), 5)
        if root:  # and through recovery from the segments
            buf = ReplayBuffer(BufferConfig(fsync=False), root=root)
        got = buf.sample_batch(2, learner_version=5)
        by_id = {r["sample_id"]: r[COL] for r in got.to_pylist()}
        for r in rows:
            np.testing.assert_array_equal(np.float32(by_id[r["sample_id"]]), np.float32(r[COL]))


def test_column_length_is_checked_and_optional():
    rows = _with_dense(synthetic_rows(1, 2, response_len=(3, 5)))
    rows[1][COL] = rows[1][COL] + [-0.5]
    with pytest.raises(ValueError, match=COL):
        rows_to_batch(rows)
    plain = rows_to_batch(synthetic_rows(1, 2))
    assert plain.column(COL).null_count == plain.num_rows


def test_segment_written_before_the_column_still_loads(tmp_path):
    root = str(tmp_path / "buf")
    rows = synthetic_rows(2, 3, version=1)
    # the SCHEMA before this column (and every later one) existed
    later = SCHEMA.names[SCHEMA.names.index(COL):]
    old = normalize_batch(rows_to_batch(rows)).drop_columns(later)
    assert old.schema.names == SCHEMA.names[:-len(later)]
    SegmentStore(root, fsync=False).write("data", old)
    bad = old.set_column(old.schema.get_field_index("reward"), "reward",
                         old.column("reward").cast(pa.float64()))  # a changed type: refused
    assert upgrade(bad) is None and upgrade(old.select(SCHEMA.names[1:-len(later)])) is None
    buf = ReplayBuffer(BufferConfig(fsync=False), root=root)
    assert len(buf.live_sample_ids()) == 6 and not buf.quarantined()
    p = buf.pending_scoring(100)
    buf.set_scores(p.column("sample_id").to_pylist(), dense_scores(p), 1)
    batch = buf.sample_batch(2, learner_version=1)
    assert batch.schema.equals(SCHEMA) and batch.column(COL).null_count == 6
    t = to_tensors(batch, pad_id=0)
    assert COL not in t and "old_logprobs" in t


def test_to_tensors_pads_the_column_like_old_logprobs():
    rows = _with_dense(synthetic_rows(3, 2, response_len=(0, 9), prompt_len=(1, 5), version=2))
    for r in rows:
        r["old_logprobs"] = [x - 1.0 for x in r[COL]]
        r["scorer_version"] = 3
    t = to_tensors(rows_to_batch(rows), pad_id=0)
    resp = t["response_mask"].bool()
    assert t[COL].dtype == torch.float32 and t[COL].shape == t["old_logprobs"].shape
    assert torch.equal(t[COL][~resp], torch.zeros(int((~resp).sum())))
    torch.testing.assert_close(t["old_logprobs"][resp], t[COL][resp] - 1.0)  # same positions
    for i, r in enumerate(rows):
        p = len(r["prompt_ids"])
        assert t[COL][i, p:p + len(r[COL])].tolist() == pytest.approx(r[COL])
    assert t["policy_version"].tolist() == [2] * 6 and t["scorer_version"].tolist() == [3] * 6
    rows[0].pop(COL)                       # one row without it: the key is left out, no error
    assert COL not in to_tensors(rows_to_batch(rows), pad_id=0)


# ---- config -----------------------------------------------------------------------------------

def test_config_cross_checks_name_the_key():
    from launch.config import load_config

    on = ["correction.staleness.enabled=true", "rollout.dense_logprobs=true"]
    cfg = load_config(on)
    assert cfg.correction.staleness.enabled and cfg.rollout.dense_logprobs
    for argv in (on[:1], on[1:]):
        with pytest.raises(ConfigError) as e:
            load_config(argv)
        assert e.value.key == "rollout.dense_logprobs"
    RolloutConfig(engine="vllm", dense_logprobs=True).validate("rollout")   # vLLM: an HF copy
    with pytest.raises(ConfigError) as e:
        RolloutConfig(dense_micro_batch=0).validate("rollout")
    assert e.value.key == "rollout.dense_micro_batch"


# ---- rollout actor ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(build_model(tmp_path_factory.mktemp("m"), "tiny", seed=0))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_dense_logprobs_equal_the_scorer_at_the_same_weights(tiny_dir, tmp_path,
                                                                     temperature):
    kv = KVConfig(policy="streaming", budget=4, compress_every=1, sink_tokens=1)
    cfg = RolloutConfig(model_path=tiny_dir, samples_per_prompt=3, max_new_tokens=10, kv=kv,
                        temperature=temperature, dense_logprobs=True, dense_micro_batch=2)
    actor = RolloutActor(cfg, task_cfg=None, model_path=tiny_dir, actor_id=1)
    actor._task = ContainsAnswer()
    other = load_model(build_model(tmp_path / "o", "tiny", seed=3))   # weights of "version 2"
    actor.load_weights(list(other.named_parameters()), 2)
    problems = [Problem(0, "1+2=", "3"), Problem(7, "hello there", "o")]
    rows = actor.rollout(problems, version=2, batch=0)
    assert all(len(r[COL]) == r["response_len"] for r in rows)
    scorer = ScorerActor(ScorerConfig(micro_batch=4), tiny_dir, temperature)
    scorer.load_weights(list(other.named_parameters()), 2)
    ids, old, _ = scorer.score(rows_to_batch(rows))
    assert ids == [r["sample_id"] for r in rows]
    for r, lp in zip(rows, old):
        np.testing.assert_allclose(r[COL], lp, rtol=0, atol=1e-5)
    # the sparse sampler's own log-probs differ (KV evicted down to 4 tokens)
    gap = max(abs(a - b) for r in rows for a, b in zip(r[COL], r["sampler_logprobs"]))
    assert gap > 1e-3
    actor.cfg.dense_logprobs = False                       # off: no column, no extra forward
    assert all(COL not in r for r in actor.rollout(problems, version=2, batch=1))


# ---- learner ------------------------------------------------------------------------------------



def _step(model_dir, batch, staleness: bool, normalize: bool = True):
    from learner.config import LearnerConfig
    from learner.learner import Learner

    cc = CorrectionConfig()
    cc.staleness.enabled = staleness
    cc.is_.normalize = normalize
    lrn = Learner(LearnerConfig(lr=1e-3, zero_stage=0, grad_clip=0.0, micro_batch_size=12), cc,
                  model_dir, master_port=_PORT)
    m = train(lrn, batch)
    return m, dict(lrn.named_weights())


def _lagged(batch, delta: torch.Tensor, lag: int) -> dict:
    """The batch as an async sample: pi_sparse^v and pi_dense^v both shifted by ``delta`` from
    (sampler, old) -- so the sparsity ratio s_t is unchanged -- and old = pi_dense^n, n = v + lag:
    the staleness ratio is u_t = exp(-delta)."""
    resp = batch["response_mask"].float()
    b = dict(batch)
    b["sampler_logprobs"] = batch["sampler_logprobs"] + delta * resp
    b[COL] = batch["old_logprobs"] + delta * resp
    b["policy_version"] = torch.full_like(batch["policy_version"], 3)
    b["scorer_version"] = b["policy_version"] + lag
    return b


def test_split_at_lag_zero_takes_the_plain_step(learner_model_dir, learner_batch):
    model_dir, batch = learner_model_dir, learner_batch
    plain, w_plain = _step(model_dir, batch, staleness=False)
    b = dict(batch, **{COL: batch["old_logprobs"].clone()})   # pi_dense^v == pi_dense^n
    split, w_split = _step(model_dir, b, staleness=True)
    assert plain["correction/staleness_split"] == 0.0 and split["correction/staleness_split"] == 1.0
    assert split["staleness/lag_max"] == 0.0 and split["staleness/weight_mean"] == 1.0
    assert split["loss"] == plain["loss"]
    for k in ("correction/weight_mean", "correction/frac_rejected", "mismatch/rho_mean"):
        assert split[k] == plain[k], k
    for n in w_plain:
        assert torch.equal(w_plain[n], w_split[n]), n
    # enabled, but the batch lacks pi_dense^v (rows from before the switch): the plain path
    fallback, w_fb = _step(model_dir, batch, staleness=True)
    assert fallback["correction/staleness_split"] == 0.0 and fallback["loss"] == plain["loss"]


def test_split_at_lag_one_scales_by_the_staleness_ratio(learner_model_dir, learner_batch):
    model_dir, batch = learner_model_dir, learner_batch
    """Closed forms with a uniform shift delta = 0.3 (u = e^-0.3, inside [0.5, 2]): without
    normalisation every weight, hence the loss and the gradient, is multiplied by u; with it the
    constant factor cancels and the step is the plain one."""
    delta = torch.full_like(batch["old_logprobs"], 0.3)
    u = math.exp(-0.3)
    plain, _ = _step(model_dir, batch, staleness=False, normalize=False)
    split, w_split = _step(model_dir, _lagged(batch, delta, lag=1), staleness=True, normalize=False)
    assert split["staleness/lag_mean"] == 1.0 and split["staleness/frac_truncated"] == 0.0
    assert split["staleness/weight_mean"] == pytest.approx(u, rel=1e-6)
    assert split["correction/frac_rejected"] == plain["correction/frac_rejected"]
    assert split["loss"] == pytest.approx(u * plain["loss"], rel=1e-5)
    assert split["grad_norm"] == pytest.approx(u * plain["grad_norm"], rel=1e-4)
    _, w_plain = _step(model_dir, batch, staleness=False, normalize=True)
    _, w_norm = _step(model_dir, _lagged(batch, delta, lag=1), staleness=True, normalize=True)
    for n in w_plain:
        torch.testing.assert_close(w_norm[n], w_plain[n], rtol=1e-4, atol=2e-5)


def test_split_truncates_large_staleness_ratios(learner_model_dir, learner_batch):
    model_dir, batch = learner_model_dir, learner_batch
    """delta = -1 on every other response token: u = e > upper 2 there, truncated to 2 (lag 1:
    bounds [0.5, 2]); weight_mean is the closed-form mean of min(u, 2) over kept tokens."""
    resp = batch["response_mask"].bool()
    alt = (torch.arange(resp.shape[1]) % 2 == 0).expand_as(resp)
    delta = torch.where(alt, -1.0, 0.1)
    b = _lagged(batch, delta, lag=1)
    keep = correct(batch["sampler_logprobs"], batch["old_logprobs"], resp,
                   CorrectionConfig()).loss_mask > 0
    u = torch.exp(-delta).clamp(max=2.0)
    split, w_split = _step(model_dir, b, staleness=True)
    assert split["staleness/frac_truncated"] == pytest.approx(float((alt & resp).sum() / resp.sum()))
    assert split["staleness/weight_mean"] == pytest.approx(float(u[keep].mean()), rel=1e-6)
    assert split["staleness/lag_max"] == 1.0
    _, w_plain = _step(model_dir, batch, staleness=False)
    assert any(not torch.allclose(w_split[n], w_plain[n]) for n in w_plain)
    too_stale = _lagged(batch, delta, lag=5)                # > max_lag 4: every sample rejected
    m, _ = _step(model_dir, too_stale, staleness=True)
    assert m["staleness/frac_too_stale"] == 1.0 and m["learner/stepped"] == 0.0
