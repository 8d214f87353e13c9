"""Teacher-forced recomputation of a sparse rollout's log-probs under its recorded kept sets.

``NativeEngine(..., trace=True)`` records the kept sets of every compression; the visibility rule
they imply lives in ``common.kept`` (the learner reads it too). Running the whole sequence at once
under that per-layer, per-head mask must give the sampler's log-probs: this is what makes them
exactly the sparse policy's (tests/test_kv_reference.py).
"""
from __future__ import annotations

import torch

from actors.native.model import Decoder
from actors.native.sampling import processed_logprobs
from common.kept import visibility


@torch.no_grad()
def recompute_logprobs(model, prompt: list[int], response: list[int], trace,
                       temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                       mode: str = "processed", sparse: bool = True) -> torch.Tensor:
    """Log-probs of ``response`` given ``prompt`` attending only to the kept sets in ``trace``
    (``sparse=False`` ignores the trace: the dense teacher-forced log-probs)."""
    dec = Decoder(model)
    device = next(model.parameters()).device   # the model's device (tests/test_gpu.py: CUDA)
    ids = torch.tensor([prompt + response], device=device)
    total = ids.shape[1]
    masks = [m.to(device) for m in visibility(trace if sparse else [], dec.n_layers, dec.n_kv,
                                              total)]
    positions = torch.arange(total, device=device)[None]
    logits = dec.forward_full(ids, positions, lambda i: masks[i][None, :, None])[0]
    logits = logits[len(prompt) - 1:total - 1]
    if temperature == 0 or mode == "processed":
        logp = processed_logprobs(logits, temperature, top_k, top_p)
    else:
        logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(-1, torch.tensor(response, device=device)[:, None]).squeeze(-1).cpu()
