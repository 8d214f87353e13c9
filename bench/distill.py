"""DistillSparse measurement: exact sparse-vs-dense agreement at a fixed KV budget, with and without
a quickly trained sampler adapter (issue 14: a smaller budget should reach the same p5 threshold).

    python bench/distill.py --model .cache/models/tiny-base --budget 24 --steps 20

Agreement is exact: on rollouts drawn by each sampler (base, or base + adapter) from held-out
prompts, the full next-token distribution of the sparse sampler (teacher-forced under the row's
recorded kept sets, ``learner/distill.py``) against the dense base model's, per response token
1 - TV (``correction.metrics.tv_agreement``); reported as the mean and the Sparrow tail (5th
percentile, ``sparrow_tail``). The base weights stay frozen here: only the adapter trains, with
the DistillSparse loss on the sampler's own rollouts of the training prompts.

``train_adapter`` and ``agreement`` are the functions ``bench/schedule.py`` calls for its
DistillSparse rows; ``common.lora.read_adapter`` reads one a run saved (``final/distill_sparse``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
# Run as a script, bench/ leads sys.path and `import buffer` would find bench/buffer.py: drop that
# folder, put the repo first (as bench/compare.py does).
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [str(REPO)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from actors.config import DistillSparseConfig, KVConfig, RolloutConfig  # noqa: E402
from tasks.config import TaskConfig  # noqa: E402


def rollout_config(model: str, budget: int, policy: str = "rkv", compress_every: int = 16,
                   max_new_tokens: int = 80, samples: int = 8, seed: int = 0,
                   distill: DistillSparseConfig | None = None,
                   protect_prompt: bool = False) -> RolloutConfig:
    """The default job's sampler (launch/configs/default.yaml) at ``budget``, adapter on."""
    d = distill or DistillSparseConfig()
    d.enabled = True
    return RolloutConfig(model_path=str(model), samples_per_prompt=samples,
                         max_new_tokens=max_new_tokens, seed=seed, distill_sparse=d,
                         kv=KVConfig(policy=policy, budget=budget, compress_every=compress_every,
                                     protect_prompt=protect_prompt))


def make_actor(cfg: RolloutConfig, task_cfg: TaskConfig | None = None):
    from actors.rollout import RolloutActor

    return RolloutActor(cfg, task_cfg or TaskConfig(), cfg.model_path)


def scored_batch(actor, base, problems, batch: int, correction=None,
                 mini_batches: int = 1) -> dict:
    """One rollout batch as the learner trains on it: the actor's rows (``kv_evictions``
    included), dense old log-probs of ``base``, padded tensors, advantages (``prepare_batch``)."""
    from actors.scorer import dense_logprobs
    from buffer.schema import rows_to_batch
    from buffer.tensors import to_tensors
    from common.tokens import pad_token_id
    from correction import CorrectionConfig
    from learner.batch import prepare_batch

    pad = pad_token_id(actor.tokenizer)
    rows = actor.rollout(problems, version=0, batch=batch)
    old = dense_logprobs(base, [r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows],
                         float(actor.cfg.temperature), pad, 16)
    for r, lp in zip(rows, old):
        r["old_logprobs"] = lp
    tensors = to_tensors(rows_to_batch(rows), pad_id=pad)
    return prepare_batch(tensors, correction or CorrectionConfig(), 0, mini_batches)[0]


def new_adapter(cfg: RolloutConfig, base):
    """A learner-side adapter over the frozen ``base`` model (float32)."""
    from learner.distill import SparseAdapter

    return SparseAdapter(cfg.distill_sparse, cfg.model_path, dict(base.named_parameters()),
                         torch.float32)


def train_adapter(cfg: RolloutConfig, problems, steps: int, prompts_per_step: int = 8,
                  log=print) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Train an adapter for ``steps`` steps on the sampler's own rollouts of ``problems`` (taken
    in order, ``prompts_per_step`` per step), the base frozen. Returns (adapter tensors by wire
    name, per-step distill/* metrics)."""
    from common.modeling import load_model

    base = load_model(cfg.model_path)
    base.requires_grad_(False)
    adapter, actor = new_adapter(cfg, base), make_actor(cfg)
    history = []
    for step in range(steps):
        a = (step * prompts_per_step) % max(1, len(problems))
        chunk = (problems[a:] + problems[:a])[:prompts_per_step]
        tensors = scored_batch(actor, base, chunk, batch=step)
        m = adapter.train_step(tensors, _correction(), float(cfg.temperature), 16)
        m["reward"] = float(tensors["rewards"].mean())
        actor.load_weights(adapter.named(), step + 1)      # the next rollouts use it
        history.append(m)
        if log:
            log(f"  adapter step {step + 1}: kl_dense={m.get('distill/kl_dense', 0):.4f} "
                f"tv_dense={m.get('distill/tv_dense', 0):.4f} "
                f"pg={m.get('distill/pg', 0):+.4f} reward={m['reward']:.3f}")
    return dict(adapter.named()), history


def _correction():
    from correction import CorrectionConfig

    return CorrectionConfig()


@torch.no_grad()
def agreement(cfg: RolloutConfig, problems, adapter: dict[str, torch.Tensor] | None = None,
              batch: int = 10_000) -> dict[str, float]:
    """Exact sparse-vs-dense agreement (module doc) on the sampler's rollouts of ``problems``;
    ``adapter`` None: the base sampler."""
    from common.modeling import load_model
    from correction.metrics import sparrow_tail, tv_agreement

    base = load_model(cfg.model_path)
    actor, sparse = make_actor(cfg), new_adapter(cfg, base)
    if adapter is not None:
        actor.load_weights(list(adapter.items()), 1)
        for name, p in sparse.params.items():
            p.copy_(adapter[name])
    t = scored_batch(actor, base, problems, batch)
    ids, mask = t["input_ids"], t["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    temp = float(cfg.temperature)
    dense = base(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float() / temp
    sp = sparse.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                      kv_evictions=t["kv_evictions"]).logits.float() / temp
    agree = tv_agreement(torch.log_softmax(sp[:, :-1], -1), torch.log_softmax(dense[:, :-1], -1))
    resp = t["response_mask"][:, 1:].bool()
    return {"agreement_mean": float(agree[resp].mean()), "agreement_p5": sparrow_tail(agree, resp),
            "tokens": float(resp.sum()), "reward": float(t["rewards"].mean())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / ".cache/models/tiny-base"))
    ap.add_argument("--budget", type=int, default=24)
    ap.add_argument("--policy", default="rkv")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--heldout", type=int, default=64, help="held-out prompts measured")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--kl-coef", type=float, default=0.001)
    ap.add_argument("--divergence", default="k3", choices=["k3", "tv"],
                    help="the divergence term kl-coef weighs (rollout.distill_sparse.divergence)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    import tasks

    task = tasks.make_task(TaskConfig())
    train, held = task.problems("train"), task.problems("heldout")[:a.heldout]
    cfg = rollout_config(a.model, a.budget, a.policy, distill=DistillSparseConfig(
        rank=a.rank, lr=a.lr, kl_coef=a.kl_coef, divergence=a.divergence))
    t0 = time.time()
    before = agreement(cfg, held)
    adapter, history = train_adapter(cfg, train, a.steps, a.prompts_per_step)
    after = agreement(cfg, held, adapter)
    rows = [("base sampler", before), (f"+ adapter ({a.steps} steps)", after)]
    print(f"\nbudget {a.budget} ({a.policy}), {len(held)} held-out prompts x "
          f"{cfg.samples_per_prompt} samples, {time.time() - t0:.0f} s")
    print("| sampler | agreement mean | agreement p5 | tokens | reward |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['agreement_mean']:.4f} | {r['agreement_p5']:.4f} | "
              f"{r['tokens']:.0f} | {r['reward']:.3f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "base": before, "adapter": after,
                                           "history": history}, indent=1))
    return 0


if __name__ == "__main__":
    from common.cpu_isa import pin_cpu_isa

    pin_cpu_isa()
    sys.exit(main())
