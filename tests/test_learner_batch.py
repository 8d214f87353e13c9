"""``learner.batch.prepare_batch`` logs which advantage sign the Sparse-RL veto removes."""
from __future__ import annotations

import math

import pytest
import torch

from correction import CorrectionConfig
from learner.batch import prepare_batch

torch.set_num_threads(1)


def test_veto_of_a_failed_sample_drops_negative_signal_only():
    """Two groups of two: group 0 has a success and a failure, the failure holding one token the
    dense policy gives rho < 1e-4 (vetoed, the whole row leaves the loss); group 1 all equal
    rewards (no signal). Positive signal is untouched, negative signal all dropped."""
    t = 3
    sampler = torch.full((4, t), -1.0)
    old = sampler.clone()
    old[1, 2] = sampler[1, 2] + math.log(1e-5)
    batch = {"rewards": torch.tensor([1.0, 0.0, 1.0, 1.0]),
             "group_index": torch.tensor([0, 0, 1, 1]),
             "response_mask": torch.ones(4, t), "sampler_logprobs": sampler,
             "old_logprobs": old}
    out, m = prepare_batch(batch, CorrectionConfig(), 0)
    assert out["loss_mask"][1].sum() == 0 and out["loss_mask"][0].sum() == t
    assert m["correction/frac_vetoed"] == pytest.approx(0.25)
    assert m["correction/signal_dropped_pos"] == 0.0
    assert m["correction/signal_dropped_neg"] == 1.0
