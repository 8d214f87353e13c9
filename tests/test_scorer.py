"""Dense scorer: log-probs equal a direct HF forward; weight sync into the scorer."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pyarrow as pa
import pytest
import torch

from actors.scorer import ScorerActor
from cluster.weight_sync import WeightSender, free_port, weight_spec
from common.modeling import checksum, load_model
from common.testmodels import build_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("tiny_scorer") / "model")


def _cfg(micro_batch=2):
    try:
        from actors.config import ScorerConfig
        return ScorerConfig(micro_batch=micro_batch)
    except ImportError:  # the colleague's config not landed: anything with micro_batch works
        return SimpleNamespace(micro_batch=micro_batch, dtype="float32")


def _batch(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        p = torch.randint(3, 128, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g)
        r = torch.randint(3, 128, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g)
        rows.append({"sample_id": f"s{i}", "prompt_ids": p.tolist(), "response_ids": r.tolist()})
    rows[0]["response_ids"] = [5, 6, 7]  # at least one known non-empty row
    return pa.RecordBatch.from_pylist(rows, schema=pa.schema([
        ("sample_id", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32()))]))


@torch.no_grad()
def _reference(model, prompt, response, temperature):
    """Unpadded single-sequence HF forward, the plainest possible computation."""
    ids = torch.tensor([prompt + response])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, dim=-1)
    return [float(logp[len(prompt) + j - 1, tok]) for j, tok in enumerate(response)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scores_equal_direct_hf_forward(model_dir, temperature):
    scorer = ScorerActor(_cfg(micro_batch=2), model_dir, temperature)
    batch = _batch()
    ids, old = scorer.score(batch)
    assert ids == [f"s{i}" for i in range(5)]
    model = load_model(model_dir)
    for row, lp in zip(batch.to_pylist(), old):
        ref = _reference(model, row["prompt_ids"], row["response_ids"], temperature)
        assert len(lp) == len(row["response_ids"])
        assert lp == pytest.approx(ref, abs=1e-5)


def test_empty_prompt_is_a_clear_error(model_dir):
    scorer = ScorerActor(_cfg(), model_dir, 1.0)
    bad = pa.RecordBatch.from_pylist([{"sample_id": "x", "prompt_ids": [], "response_ids": [4]}])
    with pytest.raises(ValueError, match="sample x has an empty prompt"):
        scorer.score(bad)


def test_sync_weights_from_a_sender(model_dir, tmp_path):
    scorer = ScorerActor(_cfg(), model_dir, 1.0)
    other = load_model(build_model(tmp_path / "other", seed=7))
    port = free_port()
    errors = []

    def send():
        try:
            s = WeightSender("127.0.0.1", port, 2, weight_spec(other), timeout_s=60)
            s.send(other.named_parameters(), 5)
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    th = threading.Thread(target=send)
    th.start()
    scorer.init_weight_sync("127.0.0.1", port, 1, 2)
    assert scorer.sync_weights() == 5
    th.join(60)
    assert not errors
    assert scorer.version == 5
    assert scorer.state_checksum() == pytest.approx(checksum(other.named_parameters()), rel=1e-12)
    batch = _batch(3)
    _, old = scorer.score(batch)  # scores now come from the received weights
    for row, lp in zip(batch.to_pylist(), old):
        assert lp == pytest.approx(_reference(other, row["prompt_ids"], row["response_ids"], 1.0),
                                   abs=1e-5)
