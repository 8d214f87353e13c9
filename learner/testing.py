"""Small fixtures for the learner, weight-sync and scorer tests: a tiny random Qwen2 and a batch.

Kept in the package (not in a conftest) so multi-process tests can import them in spawned children.
"""
from __future__ import annotations


import torch


def make_batch(num_groups: int = 2, group_size: int = 4, vocab: int = 128, seed: int = 0,
               max_prompt: int = 6, max_response: int = 10, model=None,
               noise: float = 0.05) -> dict[str, torch.Tensor]:
    """A right-padded batch shaped like ``buffer.tensors.to_tensors`` output.

    Rewards vary within each group so GRPO advantages are non-zero. With ``model`` the old
    log-probs are that model's own (so PPO ratios start at 1) and sampler log-probs are a noisy copy
    (a small sparse/dense mismatch); without it both are random negatives.
    """
    g = torch.Generator().manual_seed(seed)
    b = num_groups * group_size
    p_len = torch.randint(2, max_prompt + 1, (b,), generator=g)
    r_len = torch.randint(1, max_response + 1, (b,), generator=g)
    t = int((p_len + r_len).max())
    ids = torch.zeros(b, t, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.long)
    resp = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        n = int(p_len[i] + r_len[i])
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=g)
        attn[i, :n] = 1
        resp[i, int(p_len[i]):n] = True
    if model is not None:
        from common.modeling import token_logprobs
        with torch.no_grad():
            old = token_logprobs(model, ids, attn, 1.0).float()
    else:
        old = -torch.rand(b, t, generator=g) * 3
    old = old * resp
    sampler = (old + noise * torch.randn(b, t, generator=g)) * resp
    return {"input_ids": ids, "attention_mask": attn, "response_mask": resp,
            "sampler_logprobs": sampler, "old_logprobs": old,
            "rewards": torch.randint(0, 2, (b,), generator=g).float(),
            "group_index": torch.arange(num_groups).repeat_interleave(group_size),
            "policy_version": torch.zeros(b, dtype=torch.long)}


class WeightSource:
    """Stand-in for learner rank 0 in weight-sync tests: a plain model with the ``Learner``'s
    weight-sync methods, without DeepSpeed (whose start-up takes seconds per actor). ``step()``
    changes the weights and bumps the version, as a train step would."""

    def __init__(self, model_path: str):
        from common.modeling import load_model

        torch.set_num_threads(1)
        self.model = load_model(model_path)
        self.version = 0
        self._sender = self._ws_endpoint = None

    def named_weights(self):
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def state_checksum(self) -> float:
        from common.modeling import checksum

        return checksum(self.named_weights())

    def open_weight_sync(self, port: int = 0) -> tuple[str, int]:
        from cluster.rendezvous import close_endpoint, open_endpoint

        close_endpoint(self._ws_endpoint)
        self._ws_endpoint = open_endpoint(port)
        return self._ws_endpoint.address

    def init_weight_sync(self, host: str, port: int, world_size: int, backend: str = "gloo",
                         bucket_mb: int = 64, timeout_s: float = 300.0) -> None:
        from cluster.rendezvous import take_endpoint
        from cluster.weight_sync import WeightSender, weight_spec

        if self._sender is not None:
            self._sender.close()
        self._sender = None
        sock, self._ws_endpoint = take_endpoint(self._ws_endpoint, host, port), None
        self._sender = WeightSender(host, port, world_size, weight_spec(self.model),
                                    backend=backend, bucket_bytes=int(bucket_mb) << 20,
                                    timeout_s=float(timeout_s), listen_sock=sock)

    def broadcast_weights(self) -> int:
        self._sender.send(self.named_weights(), self.version)
        return self.version

    @torch.no_grad()
    def step(self, seed: int = 0, scale: float = 1e-2) -> int:
        g = torch.Generator().manual_seed(seed)
        for p in self.model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
        self.version += 1
        return self.version


def train(learner, batch: dict, temperature: float = 1.0) -> dict:
    """What the driver does for one learner on the whole batch: ``prepare_batch`` with the
    learner's correction config, then ``train_step``; the metrics of both."""
    from learner.batch import prepare_batch

    prepared, corr = prepare_batch(batch, learner.correction_cfg, learner.version,
                                   learner.cfg.mini_batches)
    return {**learner.train_step(prepared, temperature), **corr}


def naive_token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The textbook computation ``common.modeling.token_logprobs`` replaces, as the reference of
    its tests and of ``bench/learner_memory.py``: the model's full forward, fp32 logits for every
    position and the whole vocabulary, ``log_softmax``, gather. Returns ([B, T] log-probs, [B, T]
    entropies), position 0 = 0."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    zero = picked.new_zeros(picked.shape[0], 1)
    return torch.cat([zero, picked], dim=1), torch.cat([zero, entropy], dim=1)
