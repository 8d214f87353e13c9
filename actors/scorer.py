"""Dense scorer: teacher-forced "old policy" log-probs of sampled responses under the full-KV model.

Sparse rollouts record log-probs of a compressed-KV model; the correction needs the same tokens'
log-probs under the dense model at (ideally) the same policy version, rho_t = pi_old / pi_sparse.
The scorer computes them in one forward per micro-batch (no generation, no KV eviction) with
``common.modeling.token_logprobs`` at the rollout temperature, exactly as the learner computes its
new log-probs, so ratios are 1 when nothing changed.

A plain class: the driver wraps it with ``ray.remote``. It receives weights like the rollout actors
(``actors.weights``: ``init_weight_sync`` once, then ``stage_weights`` per broadcast; the next
``score`` swaps the staged weights in first) and reports the version it scored with.

Reference policy: with ``ref_model_path`` (the driver passes ``rollout.model_path`` when
``correction.loss.kl_coef > 0``) the actor also holds a frozen copy of the *initial* policy, in the
scorer's dtype and on its device, and ``score`` returns its log-probs too, for the KL penalty
KL(pi_theta || pi_ref). Weight sync never touches it: it is loaded from the model directory, not
from a broadcast, so a resumed run or a replacement actor still has the initial policy as reference.

Batch composition: a row's log-probs do not depend on the other rows of its forward beyond
floating-point noise. In float32 they agree within 1e-5 whether a row is scored alone or with
longer/shorter rows (measured: 5e-7). In bfloat16 the matmul kernels' blocking depends on the
batch shape - the same row repeated 8 times, without any padding, already differs from the row
alone - so a row moves by up to ``BF16_BATCH_TOL`` = 1.5e-2 (measured on CPU: at most 5.9e-3 over
random rows of 3-80 tokens, hidden 256, 4 layers; ``tests/test_scorer.py``). Bucketing by length
cannot remove it; the learner's bf16 forward carries the same noise, so in bf16 the PPO ratio
starts within about exp(+-1.5e-2) of 1.
"""
from __future__ import annotations

import pyarrow as pa
import torch

from common.devices import assigned_device
from common.dtypes import torch_dtype
from common.modeling import checksum, load_model, load_tokenizer, token_logprobs
from actors.weights import ReceivesWeights
from common.tokens import pad_token_id

# Largest change of a token's log-prob with the batch it is scored in (module docstring)
BF16_BATCH_TOL = 1.5e-2
FP32_BATCH_TOL = 1e-5


def _dtype(cfg) -> torch.dtype:
    return torch_dtype(getattr(cfg, "dtype", "float32"))


def _rows(batch: pa.RecordBatch | pa.Table) -> tuple[list[str], list[list[int]], list[list[int]]]:
    names = set(batch.schema.names)
    missing = {"sample_id", "prompt_ids", "response_ids"} - names
    if missing:
        raise ValueError(f"scorer batch lacks column(s) {sorted(missing)}; has {sorted(names)}")
    ids = [str(s) for s in batch.column("sample_id").to_pylist()]
    prompts = batch.column("prompt_ids").to_pylist()
    responses = [r or [] for r in batch.column("response_ids").to_pylist()]
    for sid, p in zip(ids, prompts):
        if not p:  # the first response token would have no context to be scored against
            raise ValueError(f"scorer: sample {sid} has an empty prompt")
    return ids, prompts, responses


@torch.no_grad()
def dense_logprobs(model, prompts: list[list[int]], responses: list[list[int]],
                   temperature: float, pad_id: int, micro_batch: int) -> list[list[float]]:
    """Dense teacher-forced log-probs of every response token, one list per row, in row order.

    ``common.modeling.token_logprobs`` over prompt + response at ``temperature`` (the scorer's
    old log-probs; the rollout actor's ``dense_sampler_logprobs`` at its own weights). Rows are
    grouped by length into forwards of ``micro_batch`` rows so padding stays small; the order is
    restored afterwards. Every prompt must be non-empty.
    """
    out: list[list[float] | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(responses[i]))
    for start in range(0, len(order), micro_batch):
        chunk = order[start:start + micro_batch]
        for i, lp in zip(chunk, _score_rows(model, [prompts[i] for i in chunk],
                                            [responses[i] for i in chunk], temperature, pad_id)):
            out[i] = lp
    return out


def _score_rows(model, prompts: list[list[int]], responses: list[list[int]], temperature: float,
                pad_id: int) -> list[list[float]]:
    device = next(model.parameters()).device
    lens = [len(p) + len(r) for p, r in zip(prompts, responses)]
    t = max(lens)
    input_ids = torch.full((len(lens), t), pad_id, dtype=torch.long)
    attn = torch.zeros((len(lens), t), dtype=torch.long)
    resp = torch.zeros((len(lens), t), dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[b, :lens[b]] = torch.tensor(p + r, dtype=torch.long)
        attn[b, :lens[b]] = 1
        resp[b, len(p):lens[b]] = 1
    logp = token_logprobs(model, input_ids.to(device), attn.to(device), temperature,
                          response_mask=resp.to(device)).float().cpu()  # response tokens only
    return [logp[b, len(p):lens[b]].tolist() for b, p in enumerate(prompts)]


class ScorerActor(ReceivesWeights):
    """Dense teacher-forced scorer. ``cfg`` needs ``micro_batch`` (rows per forward) and
    optionally ``dtype`` ("float32" | "bfloat16"). ``ref_model_path``: also score reference
    log-probs under a frozen copy of that model (the initial policy; module docstring)."""

    def __init__(self, cfg, model_path: str, temperature: float = 1.0,
                 ref_model_path: str | None = None, adapter=None):
        if temperature <= 0:
            raise ValueError(f"scorer temperature must be > 0 (the rollout's), got {temperature}")
        torch.set_num_threads(1)  # one thread per actor process: 2-core machines oversubscribe
        self.cfg, self.model_path, self.temperature = cfg, str(model_path), float(temperature)
        self.micro_batch = int(cfg.micro_batch)
        self.device = assigned_device()  # Ray's GPUs, not the visible ones (common/devices.py)
        self.model = load_model(model_path, dtype=_dtype(cfg)).to(self.device)
        self.pad_id = pad_token_id(load_tokenizer(model_path))  # the rule every part pads by
        self.ref = None
        if ref_model_path is not None:
            self.ref = load_model(ref_model_path, dtype=_dtype(cfg)).to(self.device)
            self.ref.requires_grad_(False)
        self.version = 0
        self._label = "scorer"
        # The broadcast also carries the sparse sampler's LoRA adapter (rollout.distill_sparse):
        # the scorer receives it (one spec for every receiver) and never applies it, since the
        # old log-probs must be the dense policy's; it only enters the checksum.
        from common.lora import adapter_spec

        self._adapter = {n: torch.zeros(shape, dtype=dt, device=self.device)
                         for n, shape, dt in adapter_spec(self.model, adapter)}

    # ---- scoring ----------------------------------------------------------------------------

    def score(self, batch: pa.RecordBatch | pa.Table
              ) -> tuple[list[str], list[list[float]], list[list[float]] | None]:
        """Log-probs of every response token given its prompt and preceding response tokens.

        Returns (sample_ids, old_logprobs, ref_logprobs) in the batch's row order;
        ``old_logprobs[i]`` has one float per response token of row i (see ``dense_logprobs``),
        ``ref_logprobs`` likewise under the reference model, or None without one.
        """
        self._swap_staged()  # between batches: a batch is never scored with mixed weights
        ids, prompts, responses = _rows(batch)
        old = dense_logprobs(self.model, prompts, responses, self.temperature, self.pad_id,
                             self.micro_batch)
        ref = None if self.ref is None else dense_logprobs(
            self.ref, prompts, responses, self.temperature, self.pad_id, self.micro_batch)
        return ids, old, ref

    # ---- weights ----------------------------------------------------------------------------

    def weight_spec(self):
        from cluster.weight_sync import weight_spec

        return weight_spec(self.model) + [(n, tuple(t.shape), t.dtype)
                                          for n, t in self._adapter.items()]

    def _weight_template(self) -> dict:
        return {**dict(self.model.named_parameters()), **self._adapter}

    @torch.no_grad()
    def load_weights(self, named_tensors, version: int) -> None:
        """Copy named tensors (HF names) into the model, casting to its dtype and device."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name in self._adapter:   # kept, never applied (see __init__)
                self._adapter[name].copy_(tensor)
                continue
            if name not in params:
                raise KeyError(f"scorer load_weights: model has no parameter {name!r}")
            params[name].copy_(tensor.to(device=params[name].device, dtype=params[name].dtype))
        self.version = int(version)

    def state_checksum(self) -> float:
        return checksum(list(self.model.named_parameters()) + list(self._adapter.items()))
