"""Single-process learner: config checks, LR schedule, a DeepSpeed step per ZeRO stage / precision,
micro-batch invariance, HF save/reload, and the weight broadcast from learner rank 0."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from common.errors import ConfigError
from common.modeling import checksum, load_model
from correction import CorrectionConfig
from learner.config import LearnerConfig, LRSchedule
from learner.learner import Learner, lr_lambda
from learner.testing import make_batch, train

torch.set_num_threads(1)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache",
                                                           "torch_extensions"))
_PORT = 29731  # DeepSpeed's default group is created once per process; later learners reuse it


@pytest.fixture
def model_dir(learner_model_dir):
    return learner_model_dir


@pytest.fixture
def batch(learner_batch):
    return learner_batch


def _learner(model_dir, **kw) -> Learner:
    kw.setdefault("lr", 1e-3)
    corr = kw.pop("correction", CorrectionConfig())
    return Learner(LearnerConfig(**kw), corr, model_dir, master_port=_PORT)


def test_config_validation_names_keys():
    LearnerConfig().validate()
    for kw, key in [({"zero_stage": 4}, "learner.zero_stage"), ({"lr": 0.0}, "learner.lr"),
                    ({"betas": (0.9, 1.0)}, "learner.betas.1"),
                    ({"micro_batch_size": 0}, "learner.micro_batch_size"),
                    ({"mini_batches": 0}, "learner.mini_batches"), ({"epochs": 0}, "learner.epochs"),
                    ({"max_tokens_per_micro_batch": -1}, "learner.max_tokens_per_micro_batch"),
                    ({"logprob_chunk_tokens": 0}, "learner.logprob_chunk_tokens"),
                    ({"dtype": "bf16"}, "learner.dtype"), ({"lr_schedule": "step"}, "learner.lr_schedule"),
                    ({"grad_clip": -1.0}, "learner.grad_clip")]:
        with pytest.raises(ConfigError) as e:
            LearnerConfig(**kw).validate("learner")
        assert e.value.key == key


def test_lr_schedule_warmup_and_cosine():
    f = lr_lambda(LearnerConfig(warmup_steps=3, lr_schedule=LRSchedule.COSINE, decay_steps=10,
                                min_lr_ratio=0.1))
    assert [round(f(s), 3) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(3 + 5) == pytest.approx(0.55) and f(3 + 10) == pytest.approx(0.1) == f(100)
    g = lr_lambda(LearnerConfig())
    assert g(0) == g(1000) == 1.0


@pytest.mark.parametrize("stage,dtype", [(1, "float32"), (2, "bfloat16"), (3, "float32")])
def test_step_changes_weights_and_bumps_version(model_dir, batch, tmp_path, stage, dtype):
    lrn = _learner(model_dir, zero_stage=stage, dtype=dtype, micro_batch_size=5)
    before = lrn.state_checksum()
    m = train(lrn, batch, temperature=1.0)
    assert lrn.version == 1 and m["version"] == 1.0
    assert lrn.state_checksum() != before
    assert m["learner/micro_batches"] == 3 and m["learner/stepped"] == 1.0
    assert m["grad_norm"] > 0 and m["lr"] == pytest.approx(1e-3)
    assert 0.99 < m["loss/ratio_mean"] < 1.01  # old log-probs are this model's own (bf16: ~1)
    for k in ("loss", "loss/pg", "adv/mean", "mismatch/rho_mean", "correction/frac_rejected"):
        assert k in m, k
    names = [n for n, _ in lrn.named_weights()]
    assert names[0] == "model.embed_tokens.weight" and not any(n.startswith("module.") for n in names)
    out = lrn.save_hf(str(tmp_path / "saved"))
    reloaded = load_model(out)
    assert checksum(reloaded.named_parameters()) == pytest.approx(lrn.state_checksum(), rel=1e-6)


def test_micro_batching_does_not_change_the_update(model_dir, batch):
    one = _learner(model_dir, micro_batch_size=12, zero_stage=0, grad_clip=0.0)
    train(one, batch)
    many = _learner(model_dir, micro_batch_size=5, zero_stage=0, grad_clip=0.0)
    train(many, batch)
    for (n, a), (_, b) in zip(one.named_weights(), many.named_weights()):
        # atol: Adam's first step is ~lr*sign(g), so a g near 0 may differ by ~1e-6
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_token_budget_and_checkpointing_do_not_change_the_update(model_dir, batch):
    """Micro-batches cut by a token budget, and gradient checkpointing, take the same step."""
    ref = _learner(model_dir, micro_batch_size=12, zero_stage=0, grad_clip=0.0)
    train(ref, batch)
    longest = int(batch["attention_mask"].sum(1).max())
    for kw in ({"max_tokens_per_micro_batch": 2 * longest}, {"gradient_checkpointing": True}):
        other = _learner(model_dir, micro_batch_size=12, zero_stage=0, grad_clip=0.0, **kw)
        m = train(other, batch)
        if "max_tokens_per_micro_batch" in kw:  # at most 2 rows of <= longest tokens each
            assert m["learner/micro_batches"] >= 6
        for (n, a), (_, b) in zip(ref.named_weights(), other.named_weights()):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_mini_batches_and_epochs_make_ppo_steps_where_the_clip_binds(model_dir, batch):
    """One mini-batch: the old log-probs are the model's own, the ratio is 1 and nothing clips.
    Two mini-batches x two epochs: four optimiser steps; from the second the policy has moved
    (lr 0.05), the ratio leaves [0.8, 1.2] and the clip binds."""
    one = train(_learner(model_dir, lr=0.05, zero_stage=1), batch)
    assert one["learner/optimizer_steps"] == 1 and one["loss/clipfrac"] == 0.0
    assert one["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    lrn = _learner(model_dir, lr=0.05, zero_stage=1, mini_batches=2, epochs=2)
    m = train(lrn, batch)
    assert m["learner/optimizer_steps"] == 4 and lrn.version == 1
    assert m["loss/clipfrac"] > 0 and m["loss/ratio_max"] > 1.2


def test_weights_load_in_the_training_dtype(model_dir):
    lrn = _learner(model_dir, zero_stage=0, dtype="bfloat16")
    assert {p.dtype for p in lrn.engine.module.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in _learner(model_dir, zero_stage=0).engine.module.parameters()} == \
        {torch.float32}


def test_micro_slices_pack_by_rows_and_tokens():
    from learner.plan import micro_slices, mini_ranges, plan

    assert micro_slices([5, 5, 5, 5, 5], max_rows=2, max_tokens=0) == \
        [slice(0, 2), slice(2, 4), slice(4, 5)]
    # tokens: rows x longest <= 12; a 20-token row stands alone
    assert micro_slices([3, 4, 4, 20, 2, 2], max_rows=8, max_tokens=12, start=10) == \
        [slice(10, 13), slice(13, 14), slice(14, 16)]
    assert mini_ranges(torch.tensor([0, 0, 2, 2, 2]), 3) == [(0, 2), (2, 2), (2, 5)]
    with pytest.raises(ValueError, match="ordered"):
        mini_ranges(torch.tensor([1, 0]), 2)
    minis = plan(torch.tensor([4, 4, 4]), torch.tensor([2.0, 3.0, 1.0]), torch.tensor([0, 0, 1]),
                 2, max_rows=1, max_tokens=0,
                 reduce=lambda t, op: t * 0 + 3 if op == "max" else t * 2)  # 2 equal ranks
    assert [len(m.slices) for m in minis] == [3, 3] and minis[0].units == [2.0, 3.0, 0.0]
    assert [m.total for m in minis] == [10.0, 2.0]


def test_a_micro_batch_with_every_token_rejected_still_steps(model_dir, batch):
    """Rows 0-3 (one micro-batch of 4) are all vetoed, the rest are kept: the vetoed micro-batch
    computes no log-prob, yet its loss must stay a graph DeepSpeed can backpropagate (it failed
    with 'loss must be a scalar tensor' at KV budget 16, where most sequences are vetoed); the
    update equals the one without those rows."""
    b = dict(batch)
    vetoed = torch.zeros_like(b["response_mask"], dtype=torch.bool)
    vetoed[:4] = b["response_mask"][:4].bool()
    b["sampler_logprobs"] = b["sampler_logprobs"] + 30.0 * vetoed   # rho ~ e^-30 < 1e-4: vetoed
    lrn = _learner(model_dir, zero_stage=0, grad_clip=0.0, micro_batch_size=4)
    m = train(lrn, b)
    assert m["learner/stepped"] == 1.0 and m["learner/micro_batches"] == 3
    assert m["correction/frac_vetoed"] == pytest.approx(4 / 12)
    rest = {k: v[4:] for k, v in batch.items()}
    ref = _learner(model_dir, zero_stage=0, grad_clip=0.0, micro_batch_size=4)
    train(ref, rest)
    for (n, x), (_, y) in zip(lrn.named_weights(), ref.named_weights()):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=2e-5)


def test_nothing_kept_means_no_update(model_dir, batch):
    lrn = _learner(model_dir, zero_stage=1)
    b = dict(batch)
    b["sampler_logprobs"] = b["old_logprobs"] + 30.0 * b["response_mask"]  # every token vetoed
    before = lrn.state_checksum()
    m = train(lrn, b)
    assert m["learner/stepped"] == 0.0 and m["learner/kept_tokens"] == 0
    assert lrn.state_checksum() == before and lrn.version == 1


def test_broadcast_from_learner_to_a_receiver(model_dir, batch):
    from cluster.weight_sync import WeightReceiver, free_port, weight_spec

    lrn = _learner(model_dir, zero_stage=1, dtype="bfloat16")
    train(lrn, batch)
    actor_model = load_model(model_dir)  # fp32 actor receiving a bf16 learner's weights
    port = free_port()
    got = {}

    def receive():
        r = WeightReceiver("127.0.0.1", port, 1, 2, weight_spec(actor_model), timeout_s=60)
        got["version"], named = r.receive()
        got["checksum"] = checksum(named)

    th = threading.Thread(target=receive)
    th.start()
    lrn.init_weight_sync("127.0.0.1", port, 2, "gloo", bucket_mb=1)
    assert lrn.broadcast_weights() == 1
    th.join(60)
    assert got["version"] == 1
    assert got["checksum"] == pytest.approx(lrn.state_checksum(), rel=1e-9)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_logprobs_equal_the_full_vocabulary_computation(model_dir, batch, chunk):
    """Response-only, vocabulary-chunked log-probs and entropies (checkpointed per chunk) equal the
    textbook full-logits computation, values and gradients, whatever the chunk size."""
    from common.modeling import token_logprobs
    from learner.testing import naive_token_logprobs

    model = load_model(model_dir)
    ids, attn, resp = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    r = resp.bool()
    ref_lp, ref_ent = naive_token_logprobs(model, ids, attn, 0.8)
    lp, ent = token_logprobs(model, ids, attn, 0.8, response_mask=resp, with_entropy=True,
                             chunk_tokens=chunk)
    torch.testing.assert_close(lp[r], ref_lp[r], rtol=0, atol=2e-6)
    torch.testing.assert_close(ent[r], ref_ent[r], rtol=0, atol=5e-6)
    assert (lp[~r] == 0).all() and (ent[~r] == 0).all() and (ent[r] > 0).all()
    grads = []
    for out in ((ref_lp + 0.1 * ref_ent), (lp + 0.1 * ent)):
        model.zero_grad()
        (out * resp).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # without a response mask: every attended position
        full = token_logprobs(model, ids, attn, 0.8, chunk_tokens=chunk)
    a = attn.bool() & (torch.arange(ids.shape[1]) > 0)
    torch.testing.assert_close(full[a], ref_lp.detach()[a], rtol=0, atol=2e-6)


def test_entropy_bonus_reaches_the_loss(model_dir, batch):
    corr = CorrectionConfig()
    corr.loss.entropy_coef = 0.01
    m = train(_learner(model_dir, zero_stage=1, correction=corr), batch, temperature=0.8)
    assert m["loss/entropy"] > 0


@pytest.mark.parametrize("a,b", [((0, "bfloat16"), (1, "bfloat16")), ((0, "float32"), (3, "float32"))])
def test_zero_stages_take_the_same_step(model_dir, batch, a, b):
    """Stages differ in where state lives, not in the update (this caught DeepSpeed's bf16 ZeRO-0
    dummy optimizer step that shifted Adam's bias correction)."""
    out = []
    for stage, dtype in (a, b):
        lrn = _learner(model_dir, zero_stage=stage, dtype=dtype, micro_batch_size=5)
        train(lrn, batch)
        out.append(dict(lrn.named_weights()))
    for n in out[0]:
        torch.testing.assert_close(out[0][n].float(), out[1][n].float(), rtol=1e-2, atol=2e-5)


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_resume_continues_exactly(model_dir, batch, tmp_path, stage):
    """Save after step 1, take step 2; a fresh learner restored from the checkpoint takes the same
    step 2 (Adam moments and LR schedule included)."""
    kw = dict(zero_stage=stage, warmup_steps=2, micro_batch_size=5)
    a = _learner(model_dir, **kw)
    train(a, batch)
    a.save_checkpoint(str(tmp_path / "ckpt"))
    rng_a = torch.rand(3)  # the learner process's RNG stream after the checkpoint
    train(a, batch)
    b = _learner(model_dir, **kw)
    torch.manual_seed(1234)
    assert b.load_checkpoint(str(tmp_path / "ckpt")) == 1
    assert torch.equal(torch.rand(3), rng_a)  # RNG state came back with the checkpoint
    train(b, batch)
    assert b.version == a.version == 2
    for (n, x), (_, y) in zip(a.named_weights(), b.named_weights()):
        assert torch.equal(x, y), n


def test_combine_weighted_closed_form():
    from learner.batch import combine_weighted, reduce_metrics

    parts = [(3.0, {"loss": 1.0, "loss/num_kept_tokens": 3.0, "loss/ratio_max": 1.1}),
             (1.0, {"loss": 5.0, "loss/num_kept_tokens": 1.0, "loss/ratio_max": 1.3}),
             (0.0, {"loss/extra": 7.0})]                      # weighs nothing: its own value
    assert combine_weighted(parts) == {"loss": 2.0, "loss/num_kept_tokens": 4.0,
                                       "loss/ratio_max": 1.3, "loss/extra": 7.0}
    ranks = [{"loss": 1.0, "learner/loss_units": 3.0, "time/train_s": 2.0, "lr": 0.1},
             {"loss": 5.0, "learner/loss_units": 1.0, "time/train_s": 3.0, "lr": 0.1}]
    assert reduce_metrics(ranks) == {"loss": 2.0, "learner/loss_units": 4.0, "time/train_s": 3.0,
                                     "lr": 0.1}
