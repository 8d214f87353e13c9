import numpy as np
import pyarrow as pa
import pytest
import torch

from buffer.schema import rows_to_batch
from buffer.synth import synthetic_rows
from buffer.tensors import to_tensors


def reference(rows, pad_id):
    """The obvious per-row loop, as the contract in docs/INTERFACES.md states it."""
    t = max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    b = len(rows)
    ids = torch.full((b, t), pad_id, dtype=torch.int64)
    am, rm = torch.zeros(b, t, dtype=torch.int64), torch.zeros(b, t, dtype=torch.int64)
    slp, olp = torch.zeros(b, t), torch.zeros(b, t)
    groups = {}
    for i, r in enumerate(rows):
        p, s = len(r["prompt_ids"]), r["prompt_ids"] + r["response_ids"]
        ids[i, :len(s)] = torch.tensor(s)
        am[i, :len(s)] = 1
        rm[i, p:len(s)] = 1
        slp[i, p:len(s)] = torch.tensor(r["sampler_logprobs"])
        olp[i, p:len(s)] = torch.tensor(r["old_logprobs"])
        groups.setdefault(r["group_id"], len(groups))
    gi = torch.tensor([groups[r["group_id"]] for r in rows])
    return dict(input_ids=ids, attention_mask=am, response_mask=rm, sampler_logprobs=slp,
                old_logprobs=olp, group_index=gi,
                rewards=torch.tensor([r["reward"] for r in rows], dtype=torch.float32),
                policy_version=torch.tensor([r["policy_version"] for r in rows]))


def scored_rows(n_groups=5, g=3, seed=0):
    rows = synthetic_rows(n_groups, g, seed=seed, response_len=(0, 20), prompt_len=(1, 9))
    rng = np.random.default_rng(seed)
    for r in rows:
        r["old_logprobs"] = (-rng.random(len(r["response_ids"]), dtype=np.float32)).tolist()
        r["scorer_version"] = 1
    return rows


@pytest.mark.parametrize("seed", range(3))
def test_matches_reference(seed):
    rows = scored_rows(seed=seed)
    rng = np.random.default_rng(seed)
    rows = [rows[i] for i in rng.permutation(len(rows))]      # groups interleaved
    got, want = to_tensors(rows_to_batch(rows), pad_id=7), reference(rows, 7)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        assert torch.equal(got[k], v), k
    assert "ref_logprobs" not in got


def test_sliced_and_table_inputs():
    rows = scored_rows(4, 2, seed=3)
    batch = rows_to_batch(rows)
    part = batch.slice(3, 4)                          # non-zero list offsets
    got, want = to_tensors(part, 0), reference(rows[3:7], 0)
    assert torch.equal(got["input_ids"], want["input_ids"])
    assert torch.equal(got["old_logprobs"], want["old_logprobs"])
    table = pa.Table.from_batches([batch.slice(0, 3), batch.slice(3)])
    assert torch.equal(to_tensors(table, 0)["input_ids"], to_tensors(batch, 0)["input_ids"])


def test_partially_scored_batch_is_rejected_and_unscored_omitted():
    rows = scored_rows(2, 2)
    for r in rows:
        r.pop("old_logprobs"), r.pop("scorer_version")
    out = to_tensors(rows_to_batch(rows), 0)
    assert "old_logprobs" not in out and "sampler_logprobs" in out
    rows = scored_rows(2, 2)
    rows[1]["old_logprobs"] = None
    with pytest.raises(ValueError, match="old_logprobs"):
        to_tensors(rows_to_batch(rows), 0)


def test_logprob_alignment_with_token_positions():
    rows = [dict(group_id="a", prompt_idx=0, prompt_ids=[5, 6, 7], response_ids=[8, 9],
                 sampler_logprobs=[-1.0, -2.0], reward=1.0, policy_version=3)]
    out = to_tensors(rows_to_batch(rows), pad_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert out["sampler_logprobs"].tolist() == [[0, 0, 0, -1.0, -2.0]]
    assert out["response_mask"].tolist() == [[0, 0, 0, 1, 1]]
