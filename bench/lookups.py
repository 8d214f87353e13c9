"""Which fact lookups a compressed KV cache loses, on the reasoning task (issue 28).

    python bench/lookups.py [--config launch/configs/reasoning.yaml] [--model DIR]
        [--problems 256] [--json PATH] [-- rollout.kv.budget=45 rollout.kv.protect_prompt=true ...]

Decodes the first ``--problems`` held-out problems greedily twice with the config's rollout
settings (model: ``--model``, else ``rollout.model_path``): with a dense cache, and with the
config's KV policy and budget, traced. In every response it finds the operand lookups
(``ReasoningTask.lookups``: each ``then`` line reads a fact by its letter, a *far* fact from the
prompt only, a *near* one from the restatements in the notes) and reports, per kind:

* ``share_right``: the share of lookups that wrote the fact's value (dense and sparse decode);
* for the sparse decode, per outcome (right / wrong), ``heads_seeing``: per layer, the share of
  KV heads for which at least one earlier statement of the value (a source) is still in the kept
  set of the query that writes the operand (``common.kept``'s visibility rule), and ``lost``: the
  share of lookups where no head of any layer sees a source.

A lookup whose sources are all evicted can only be guessed: this separates what the cache lost
from what the model got wrong with the value in view. ``--json PATH`` writes the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Run as a script, bench/ leads sys.path (bench/buffer.py would shadow the buffer package).
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [str(REPO)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

KINDS = ("near", "far")


def visible(ev, query: int, sources) -> "torch.Tensor":
    """bool [L, Hkv]: does the query at position ``query`` see at least one of ``sources`` under
    the evictions ``ev`` [L, Hkv, T] (``common.kept.evictions``)?"""
    import torch

    from common.kept import NEVER

    if not sources:
        return torch.zeros(ev.shape[:2], dtype=torch.bool)
    e = ev[:, :, list(sources)]
    return ((e == NEVER) | (query <= e)).any(dim=-1)


def tally(task, prompts: list[str], responses: list[str], evs: list | None = None) -> dict:
    """Per lookup kind: ``n``, ``share_right``; with the responses' evictions ``evs``, per
    outcome ``right`` / ``wrong``: ``n``, ``heads_seeing`` (per layer) and ``lost``."""
    import torch

    rows = {k: [] for k in KINDS}
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        for lk in task.lookups(prompt, response):
            # the query that writes the operand's first digit is the token before it
            vis = visible(evs[i], lk.at - 1, lk.sources) if evs is not None else None
            rows["far" if lk.far else "near"].append((lk.right, vis))
    out = {}
    for kind, items in rows.items():
        out[kind] = {"n": len(items),
                     "share_right": sum(r for r, _ in items) / len(items) if items else None}
        if evs is None:
            continue
        for outcome, want in (("right", True), ("wrong", False)):
            vis = [v.float() for r, v in items if r == want]
            cell = {"n": len(vis), "heads_seeing": None, "lost": None}
            if vis:
                v = torch.stack(vis)                                   # [n, L, H]
                cell["heads_seeing"] = [round(x, 4) for x in v.mean(dim=(0, 2)).tolist()]
                cell["lost"] = float((v.flatten(1).amax(dim=1) == 0).float().mean())
            out[kind][outcome] = cell
    return out


def decode(cfg, model: str, problems: int) -> dict:
    """The dense and the traced sparse greedy decodes of ``problems`` held-out problems."""
    from actors.rollout import RolloutActor
    from common.kept import evictions
    from launch.preflight import check_model, task_prompts
    from tasks import make_task

    cfg.rollout.model_path = model
    cfg.task.n_heldout = cfg.run.eval_problems = problems
    _, encoder = check_model(cfg)
    task = make_task(cfg.task)
    if not hasattr(task, "lookups"):
        raise SystemExit(f"bench/lookups.py: task {cfg.task.name.value!r} has no fact lookups "
                         f"(use the reasoning task: --config launch/configs/reasoning.yaml)")
    _, evals, _ = task_prompts(task, encoder, problems)
    held = evals["heldout"]
    actor = RolloutActor(cfg.rollout, cfg.task, model_path=model)
    prompts = [p.prompt for p in held]
    out = {"problems": len(held)}
    for name, dense in (("dense", True), ("sparse", False)):
        engine = actor._dense_engine() if dense else actor._sampler()
        engine.trace = not dense
        outs, _, _ = actor._generate(held, 1, greedy=True, dense=dense)
        texts = [actor.tokenizer.decode(o.response_ids, skip_special_tokens=True) for o in outs]
        for o, p, t in zip(outs, prompts, texts):   # offsets are token positions only if so
            if len(o.prompt_ids) != len(p) or len(t) > len(o.response_ids):
                raise SystemExit("bench/lookups.py: the model's tokenizer is not one token per "
                                 "character; lookup offsets would not be token positions")
        dec = engine.dec
        evs = None if dense else [evictions(o.trace, dec.n_layers, dec.n_kv,
                                            len(o.prompt_ids) + len(o.response_ids))
                                  for o in outs]
        out[name] = {"accuracy": sum(task.reward(t, p.answer) > 0
                                     for t, p in zip(texts, held)) / len(held),
                     "lookups": tally(task, prompts, texts, evs)}
    kv = cfg.rollout.kv
    out.update(policy=kv.policy.value, budget=kv.budget, protect_prompt=kv.protect_prompt,
               model=model)
    return out


def table(res: dict) -> str:
    f = lambda x: "–" if x is None else f"{x:.3f}"  # noqa: E731
    lines = [f"{res['model']}: {res['problems']} held-out problems, greedy; sparse = "
             f"{res['policy']} at {res['budget']} tokens"
             + (", prompt kept" if res["protect_prompt"] else ""), "",
             "| decode | accuracy | near lookups right | far lookups right |", "|---|---|---|---|"]
    for name in ("dense", "sparse"):
        lk = res[name]["lookups"]
        lines.append(f"| {name} | {res[name]['accuracy']:.3f} | "
                     + " | ".join(f"{f(lk[k]['share_right'])} of {lk[k]['n']}" for k in KINDS)
                     + " |")
    lines += ["", "| sparse decode, lookups | n | KV heads seeing a source, per layer | "
              "no head sees one |", "|---|---|---|---|"]
    for kind in KINDS:
        for outcome in ("right", "wrong"):
            c = res["sparse"]["lookups"][kind][outcome]
            heads = " ".join(f"{x:.2f}" for x in c["heads_seeing"] or []) or "–"
            lines.append(f"| {kind}, {outcome} | {c['n']} | {heads} | {f(c['lost'])} |")
    return "\n".join(lines)


def main(argv: list[str]) -> dict:
    argv = list(argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="bench/lookups.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "launch/configs/reasoning.yaml")
    ap.add_argument("--model", default=None, help="default: the config's rollout.model_path")
    ap.add_argument("--problems", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.problems < 1:
        ap.error(f"--problems must be >= 1, got {args.problems}")
    import torch

    from launch.config import load_config

    torch.set_num_threads(args.threads)
    cfg = load_config(["--config", str(args.config), *overrides], default=False)
    res = decode(cfg, args.model or cfg.rollout.model_path, args.problems)
    print(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    from common.cpu_isa import pin_cpu_isa

    pin_cpu_isa()
    main(sys.argv[1:])
