"""A learner step whose loss or gradients are not finite is skipped without a trace (every ZeRO
stage, fp32 and bf16): weights, optimiser moments, Adam's step count and the LR schedule are
bitwise unchanged, and the next good batch trains exactly as it would have without the poisoned
one. Saves refuse non-finite weights or optimiser state. (Two ranks agreeing: test_faults_dp.)"""
from __future__ import annotations

import os

import pytest
import torch

from common.errors import TrainingFault
from correction import CorrectionConfig
from learner.batch import prepare_batch
from learner.config import LearnerConfig
from learner.learner import Learner

torch.set_num_threads(1)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache",
                                                           "torch_extensions"))
_PORT = 29741


def _learner(model_dir, stage: int, dtype: str, mini_batches: int = 2) -> Learner:
    cfg = LearnerConfig(zero_stage=stage, dtype=dtype, lr=1e-2, micro_batch_size=3,
                        mini_batches=mini_batches)
    return Learner(cfg, CorrectionConfig(), model_dir, master_port=_PORT)


def _prepared(batch, mini_batches: int = 2) -> dict:
    return prepare_batch(batch, CorrectionConfig(), 0, mini_batches)[0]


def _state(lrn: Learner) -> dict[str, torch.Tensor]:
    """Every number a step could change: full weights, the torch optimiser's tensors (masters,
    moments, step counts) and the learning rate."""
    out = {f"w:{n}": t.detach().float().clone() for n, t in lrn.named_weights()}
    opt = getattr(lrn.optimizer, "optimizer", lrn.optimizer)
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            out[f"p:{g}.{i}"] = p.detach().float().clone()
            for k, t in opt.state.get(p, {}).items():
                out[f"s:{g}.{i}.{k}"] = torch.as_tensor(t).detach().float().clone()
    out["lr"] = torch.tensor(lrn.scheduler.get_last_lr())
    return out


def _same(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


CASES = [(0, "float32"), (1, "float32"), (2, "float32"), (3, "float32"), (0, "bfloat16"),
         (2, "bfloat16")]


def _poison_loss(lrn, good):
    """A forward hook making the model's last norm output NaN: new log-probs, so the loss, are
    not finite (the backward still runs, on finite stand-ins, to keep collectives in step)."""
    return good, lrn.engine.module.hf.model.norm.register_forward_hook(
        lambda mod, inp, out: out * float("nan"))


def _poison_grad(lrn, good):
    """A hook turning one parameter's gradient into inf during backward: the loss stays finite,
    only the gradient check sees it (under ZeRO-2/3 before DeepSpeed's reduction hooks)."""
    p = next(iter(lrn.engine.module.parameters()))
    return good, p.register_hook(lambda g: torch.full_like(g, float("inf")))


@pytest.mark.parametrize("stage,dtype", CASES)
@pytest.mark.parametrize("poison", [_poison_loss, _poison_grad], ids=["loss", "grad"])
def test_nonfinite_step_is_skipped_without_a_trace(learner_model_dir, learner_batch, stage,
                                                    dtype, poison):
    good = _prepared(learner_batch)
    a = _learner(learner_model_dir, stage, dtype)
    bad, hook = poison(a, good)
    before = _state(a)
    m = a.train_step(bad)
    hook.remove()
    cause = "loss" if poison is _poison_loss else "grad"
    assert m["learner/skipped_steps"] == 2 and m[f"learner/skipped_{cause}"] == 2
    assert m["learner/stepped"] == 0 and m["learner/optimizer_steps"] == 0
    assert torch.isfinite(torch.tensor(m["loss"]))  # poisoned losses stay out of the metrics
    assert _same(before, _state(a)) == []
    a.check_finite()  # nothing poisoned: a checkpoint now would be fine

    m = a.train_step(good)
    assert m["learner/skipped_steps"] == 0 and m["learner/optimizer_steps"] == 2
    b = _learner(learner_model_dir, stage, dtype)
    b.train_step(good)
    assert _same(_state(a), _state(b)) == []  # the skipped step left nothing behind
    w = lambda st: {k: v for k, v in st.items() if k.startswith("w:")}  # noqa: E731
    assert _same(w(before), w(_state(a))) != []  # and it did train


@pytest.mark.parametrize("stage", [0, 3])
def test_saves_refuse_nonfinite_weights(learner_model_dir, tmp_path, stage):
    a = _learner(learner_model_dir, stage, "float32")
    name = next(iter(a._params))
    with torch.no_grad():
        p = a._params[name]
        getattr(p, "ds_tensor", p).view(-1)[0] = float("nan")
    with pytest.raises(TrainingFault, match=f"refusing to save.*{name}"):
        a.save_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(TrainingFault, match="refusing to save"):
        a.save_hf(str(tmp_path / "hf"))
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "hf").exists()


def test_a_batch_under_the_kept_share_floor_makes_no_optimizer_step(learner_model_dir,
                                                                     learner_batch):
    """correction.rejection.min_kept_share: one sequence vetoed leaves 11 of 12; under a floor
    of 0.92 prepare_batch keeps no token and the learner takes no optimizer step (weights,
    moments, lr bitwise unchanged, not counted as a fault); under 0.9 it steps."""
    from learner.testing import train

    batch = {k: v.clone() for k, v in learner_batch.items()}
    i = int(batch["response_mask"][0].nonzero()[0])
    batch["sampler_logprobs"][0, i] = batch["old_logprobs"][0, i] + 12.0   # rho = e^-12 < 1e-4
    for floor, steps in ((0.92, 0), (0.9, 2)):
        corr = CorrectionConfig()
        corr.rejection.min_kept_share = floor
        lrn = Learner(LearnerConfig(zero_stage=0, lr=1e-2, micro_batch_size=3, mini_batches=2),
                      corr, learner_model_dir, master_port=_PORT)
        before = _state(lrn)
        m = train(lrn, batch)
        assert m["correction/frac_seqs_kept"] == pytest.approx(11 / 12)
        assert m["correction/batch_floored"] == float(steps == 0)
        assert m["learner/optimizer_steps"] == steps and m["learner/skipped_steps"] == 0
        after = _state(lrn)
        if steps == 0:
            assert _same(before, after) == []
        else:  # Adam's moments appear with the first step; the weights moved
            assert any(not torch.equal(before[k], after[k]) for k in before if k[:2] == "w:")
