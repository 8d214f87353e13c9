"""Small pieces the training script calls: prompt order, fan-out over actor pools, eval, metrics log.

Kept out of ``launch/train.py`` so that file reads as the data flow and nothing else.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path


class PromptSampler:
    """Deterministic epochs over the training problems: shuffled per epoch from ``seed``.

    ``position`` (epoch, index, requeued) is the data position a checkpoint stores for exact
    resume. Problems handed back by ``requeue`` (``buffer.stale_policy=requeue``: their groups went
    stale) open the next batches, before fresh draws.
    """

    def __init__(self, problems: list, per_step: int, seed: int):
        if not problems:
            raise ValueError("the task has no training problems (task.n_train?)")
        self.problems, self.per_step, self.seed = problems, per_step, seed
        self.epoch, self.index, self.drawn = 0, 0, 0   # drawn: batches handed out so far
        self.requeued: list[int] = []                  # prompt_idx waiting to be drawn again
        self._by_idx = {getattr(p, "idx", p): p for p in problems}
        self._order = self._shuffle(0)

    def requeue(self, prompt_idx: list[int]) -> None:
        """Draw these problems (their ``idx``, the rows' ``prompt_idx``) again, first."""
        unknown = [i for i in prompt_idx if i not in self._by_idx]
        if unknown:
            raise ValueError(f"requeued prompt_idx {unknown[:5]} are not training problems")
        self.requeued += [int(i) for i in prompt_idx]

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> list:
        take = self.requeued[:self.per_step]
        self.requeued = self.requeued[self.per_step:]
        out = [self._by_idx[i] for i in take]
        while len(out) < self.per_step:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            out.append(self.problems[self._order[self.index]])
            self.index += 1
        self.drawn += 1
        return out

    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "drawn": self.drawn,
                "requeued": list(self.requeued)}

    def restore(self, position: dict) -> None:
        """Continue from a ``position()`` (a checkpoint's): the same batches follow."""
        epoch, index = int(position["epoch"]), int(position["index"])
        if not 0 <= index <= len(self.problems):
            raise ValueError(f"sampler position index {index} is outside the {len(self.problems)} "
                             "training problems: the checkpoint comes from another task config")
        self.epoch, self.index, self.drawn = epoch, index, int(position["drawn"])
        self.requeued = []
        self.requeue(position.get("requeued", []))  # older checkpoints have none
        self._order = self._shuffle(epoch)


def split(items, n: int) -> list:
    """``items`` in ``n`` contiguous, nearly equal chunks (some may be empty when n > len)."""
    k, r = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + k + (1 if i < r else 0)
        out.append(items[start:end])
        start = end
    return out


def split_rows(batch, n: int) -> list:
    """Contiguous row slices of an Arrow batch, one per actor (empty slices left out)."""
    out, start = [], 0
    for part in split(range(batch.num_rows), n):
        if len(part):
            out.append(batch.slice(start, len(part)))
        start += len(part)
    return out


def launch(actors: list, method: str, items: list, *args) -> list:
    """Start ``method(chunk, *args)`` on each actor with its share of ``items``; returns the refs."""
    return [getattr(a, method).remote(chunk, *args)
            for a, chunk in zip(actors, split(items, len(actors))) if chunk]


def launch_rollouts(pools, sampler: PromptSampler, version: int) -> list[tuple]:
    """The sampler's next prompts to the rollout actors, tagged with the batch number, which seeds
    the sampling and names the samples (so a resumed run, or a replacement actor, draws the very
    same ones). Returns one (actor index, chunk, batch, ref) per call, for ``gather_rollouts``.
    With rollouts ahead (``pools.rollouts_ahead > 1``) each actor tags its rows with the version
    of the weights it holds when the call starts (it swaps in staged weights first): that version
    depends on timing, between ``version`` and the learner's version when the batch is gathered."""
    if pools.requeue:  # buffer.stale_policy=requeue: stale groups' prompts are generated again
        from launch.recovery import call

        sampler.requeue(call(pools, "take_requeued"))
    problems, batch = sampler.next(), sampler.drawn
    tag = _row_version(pools, version)
    return [(i, chunk, batch, pools.rollout[i].rollout.remote(chunk, tag, batch))
            for i, chunk in enumerate(split(problems, len(pools.rollout))) if chunk]


def _row_version(pools, version: int) -> int | None:
    """The version a rollout call tags its rows with: the driver's, or with rollouts ahead None
    (the actor tags them with the weights it swapped in, which depends on timing)."""
    return version if pools.rollouts_ahead == 1 else None


def fill_rollouts(in_flight, pools, sampler: PromptSampler, version: int, steps: int) -> None:
    """Launch batches until ``in_flight`` (a deque, oldest first) holds ``pools.rollouts_ahead``
    of them, never beyond batch ``steps`` (batch k is trained at step k). Entries may be ``[]``:
    a batch already landed in the buffer (a checkpoint's), gathered as no rows."""
    while len(in_flight) < pools.rollouts_ahead and sampler.drawn < steps:
        in_flight.append(launch_rollouts(pools, sampler, version))


def land_rollouts(in_flight, pools, cfg, version: int, note=None) -> int:
    """Every batch in flight into the buffer (before a checkpoint or a resize); ``in_flight`` then
    holds as many landed (empty) entries, so the run goes on as if they were still running. Returns
    how many batches it holds (``trainer_state.json``'s ``in_flight``: resume refills from it).
    ``note(rows)``: sees each landed batch's rows first (``launch.faults.Faults.note_rewards``)."""
    from launch.recovery import call

    n = len(in_flight)
    for calls in list(in_flight):
        rows = gather_rollouts(calls, pools, cfg, version)
        if note is not None:
            note(rows)
        call(pools, "append", rows)
    in_flight.clear()
    in_flight.extend([] for _ in range(n))
    return n


def gather_rollouts(in_flight: list[tuple], pools, cfg, version: int) -> list:
    """The rows of ``launch_rollouts``' calls, in actor order. When a rollout actor has died, it
    is replaced (``cluster.elastic.replace_dead``: the weight group re-forms and every actor gets
    the learner's current weights) and its chunk is generated again with the same batch number,
    tagged with the current ``version``, whose weights the replacement holds (with rollouts
    ahead: tagged by the actor, like ``launch_rollouts``)."""
    import ray
    from ray.exceptions import RayActorError

    from cluster.elastic import replace_dead

    rows = []
    for i, chunk, batch, ref in in_flight:
        try:
            rows += ray.get(ref)
        except RayActorError as err:
            print(f"[elastic] rollout actor {i} lost ({type(err).__name__}): "
                  f"{replace_dead(pools, cfg)}", flush=True)
            rows += ray.get(pools.rollout[i].rollout.remote(chunk, _row_version(pools, version),
                                                             batch))
    return rows


def score_pending(pools, cfg, version: int) -> None:
    """Dense old-policy log-probs (and reference log-probs when the scorers hold the reference
    policy, ``cluster.pools.needs_reference``) for every buffer row waiting for them, split over
    the scorers. A scorer that died is replaced; the rows it held are released and scored again."""
    import ray
    from ray.exceptions import RayActorError

    from cluster.elastic import replace_dead
    from launch.recovery import call

    for attempt in range(2):
        pending = call(pools, "pending_scoring", cfg.buffer.capacity)
        calls = [s.score.remote(part) for s, part in
                 zip(pools.scorer, split_rows(pending, len(pools.scorer)))]
        try:
            for ids, old, ref in ray.get(calls):
                call(pools, "set_scores", ids, old, version, ref_logprobs=ref)
            return
        except RayActorError as err:
            if attempt:
                raise
            print(f"[elastic] scorer lost ({type(err).__name__}): {replace_dead(pools, cfg)}",
                  flush=True)
            call(pools, "release", pending.column("sample_id").to_pylist())


def sync_weights(pools, cfg) -> tuple[int, dict]:
    """``broadcast_weights``; when a receiver died on the way, replace it (the group re-forms) and
    send again, so the job goes on without a restart. A dead peer fails the broadcast on every
    live member within ``cluster.weight_sync_timeout_s``, on gloo and NCCL alike
    (``cluster.sync_guard``): here as the learner's or a receiver's task error."""
    from ray.exceptions import RayActorError, RayTaskError

    from cluster.elastic import replace_dead
    from cluster.pools import broadcast_weights

    try:
        return broadcast_weights(pools)
    except (RayActorError, RayTaskError) as err:
        print(f"[elastic] weight broadcast failed ({type(err).__name__}): "
              f"{replace_dead(pools, cfg)}", flush=True)
        return broadcast_weights(pools)


def batch_metrics(batch, learner_version: int, bin_tokens: int = 16) -> dict:
    """Reward, lengths, kept ratio, KV bytes and staleness of a training batch; checks log-prob
    lengths. ``rollout/kv_bytes_per_seq``: the mean over rows of the most KV bytes the engine
    stored for the sequence (all layers, K and V).
    ``time/rollout_gen_s``: engine seconds that generated the batch, summed over rollout actors
    (each row carries its share of its engine call); ``rollout/tokens_per_s``: response tokens per
    engine second, i.e. one actor's generation throughput. (The driver's wait for a batch is no
    measure of either: in sync mode the rollouts run while the previous step logs and evaluates.)"""
    import pyarrow.compute as pc

    lengths_ok = all(pc.all(pc.equal(pc.list_value_length(batch.column(c)),
                                     batch.column("response_len"))).as_py()
                     for c in ("sampler_logprobs", "old_logprobs"))
    lag = learner_version - 1 - batch.column("policy_version").to_numpy()  # version trained on
    out = {"reward": float(pc.mean(batch.column("reward")).as_py()),
            "response_len": float(pc.mean(batch.column("response_len")).as_py()),
            "kept_ratio": float(pc.mean(batch.column("kept_ratio")).as_py()),
            "batch/logprob_lengths_match": lengths_ok,
            "batch/staleness_mean": float(lag.mean()), "batch/staleness_max": int(lag.max())}
    tokens = int(pc.sum(batch.column("response_len")).as_py() or 0)
    gen_s = float(pc.sum(batch.column("gen_time_s")).as_py() or 0.0)
    out.update({"batch/response_tokens": tokens, "time/rollout_gen_s": gen_s,
                "rollout/tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0})
    kv = pc.mean(batch.column("peak_kv_bytes")).as_py()  # rows of older segments: null
    if kv is not None:
        out["rollout/kv_bytes_per_seq"] = float(kv)
    return out | kv_schedule_metrics(batch, bin_tokens)


def kv_schedule_metrics(batch, width: int) -> dict:
    """Budget schedule and probe figures of a batch (issue 14): ``rollout/kv_budget_mean``, the
    budget in force at each response token's position, averaged over tokens; from probe rows
    (``kv_agreement``) the exact agreement per position bin, ``mismatch/agreement_p5/bin<k>`` and
    ``mismatch/agreement_mean/bin<k>``, and ``mismatch/probe_agreement_p5_min_bin`` (Sparrow's
    stability statistic: the worst bin, bins of few tokens pooled as ``schedule.plan.pooled``) with ``mismatch/probe_agreement_mean``. ``width``:
    ``rollout.kv.bin_tokens``."""
    from schedule.plan import bin_alphas, bin_stats, pooled

    names = batch.schema.names
    if "kv_bin_budgets" not in names:
        return {}
    budgets, plens = batch.column("kv_bin_budgets").to_pylist(), batch.column("prompt_len")
    plens, rlens = plens.to_pylist(), batch.column("response_len").to_pylist()
    out, used = {}, [(b, p, r) for b, p, r in zip(budgets, plens, rlens) if b]
    if used and width:
        tok = [b[min((p + t) // width, len(b) - 1)] for b, p, r in used for t in range(r)]
        out["rollout/kv_budget_mean"] = sum(tok) / max(1, len(tok))
    probes = [(p, a) for p, a in zip(plens, batch.column("kv_agreement").to_pylist()) if a]
    if probes and width:
        by_bin = bin_alphas([p for p, _ in probes], [a for _, a in probes], width)
        for k, st in bin_stats(by_bin).items():
            out[f"mismatch/agreement_p5/bin{k}"] = st["p5"]
            out[f"mismatch/agreement_mean/bin{k}"] = st["mean"]
        # bins with too few tokens for a 5th percentile are judged with the bin before them
        out["mismatch/probe_agreement_p5_min_bin"] = min(
            st["p5"] for st in bin_stats(pooled(by_bin)[0]).values())
        alphas = [x for _, a in probes for x in a]
        out["mismatch/probe_agreement_mean"] = sum(alphas) / len(alphas)
    return out


def replan_schedule(pools, cfg, step: int) -> dict:
    """``rollout.kv.schedule=dynamic``: every ``replan_every`` steps, the rollout actors' probes
    since the last re-plan and the engine's cost model give the next budget per bin
    (``rollout.kv.planner``: ``_search_schedule`` or ``_table_schedule``), sent to every rollout
    actor and kept in ``cfg.rollout.kv.budgets`` (so replacement actors and checkpoints carry
    it). Returns the ``schedule/*`` metrics."""
    import ray

    from actors.config import KVObjective, KVPlanner, KVSchedule
    from schedule.cost import CostModel, bin_cost

    kv = cfg.rollout.kv
    if KVSchedule(kv.schedule) != KVSchedule.dynamic or step % kv.replan_every:
        return {}
    cost = CostModel.from_dict(ray.get(pools.rollout[0].kv_cost_model.remote()))

    def per_bin(counts: dict[int, int]):
        return bin_cost(KVObjective(kv.objective).value, cost, kv.bin_tokens, kv.compress_every,
                        cfg.rollout.batch_size, counts)

    exact = KVPlanner(kv.planner) == KVPlanner.exact
    found = (_search_schedule if exact else _table_schedule)(pools, kv, per_bin)
    if found is None:
        return {"schedule/replanned": 0}
    budgets, info = found
    ray.get([a.set_budgets.remote(budgets) for a in pools.rollout])
    kv.budgets = list(budgets)
    out = {"schedule/replanned": 1, "schedule/unmet_bins": len(info["unmet_bins"]),
           "schedule/predicted_cost": info["predicted_cost"],
           "schedule/cost_error_step": cost.error.get("step", 0.0),
           "schedule/cost_error_compress": cost.error.get("compress", 0.0)}
    if exact:
        out["schedule/replays"] = info["replays"]
    out.update({f"schedule/budget_bin{k}": b for k, b in enumerate(budgets)})
    return out


def _search_schedule(pools, kv, per_bin):
    """``planner=exact``: ``schedule.plan.search`` over the probe sequences the rollout actors
    kept, each candidate schedule replayed by every actor on its own; None without probes."""
    import ray

    from actors.probes import candidate_budgets
    from schedule.plan import merge, search

    summary = ray.get([a.probe_summary.remote() for a in pools.rollout])
    counts: dict[int, int] = {}
    for s in summary:
        for k, n in s["counts"].items():
            counts[k] = counts.get(k, 0) + n

    def replay(schedules: list[list[int]]) -> list[dict]:
        runs = ray.get([a.replay_probes.remote(schedules) for a in pools.rollout])
        return [merge([{0: r[i]} for r in runs])[0] for i in range(len(schedules))]

    found = None
    if counts:
        longest = max(s["longest"] for s in summary)
        found = search(replay, candidate_budgets(kv, longest), kv.bin_tokens, per_bin(counts),
                       kv.threshold, kv.margin)
    ray.get([a.take_probes.remote() for a in pools.rollout])     # done with them
    return found


def _table_schedule(pools, kv, per_bin):
    """``planner=table``: ``schedule.plan.plan`` over the actors' candidate-budget tables and
    the realised agreement at the schedule in use; None without probes."""
    import ray

    from schedule.plan import merge, plan

    probes = ray.get([a.take_probes.remote() for a in pools.rollout])
    table = merge([p["table"] for p in probes])
    if not table:
        return None
    realized = merge([{0: p["realized"]} for p in probes]).get(0, {})
    counts = {k: len(v) for k, v in next(iter(table.values())).items()}
    return plan(table, per_bin(counts), kv.threshold, kv.margin, realized, kv.bin_budgets())


def buffer_depth(pools) -> dict:
    """How full the replay buffer is after a step (rows held, whole scored groups ready)."""
    from launch.recovery import call

    st = call(pools, "stats")
    return {"buffer/live_rows": st["live_rows"], "buffer/ready_groups": st["ready_groups"],
            "buffer/fill_fraction": st["fill_fraction"]}


def evaluate_sets(rollout_actors: list, sets: dict[str, list], greedy: bool,
                  progress: bool = False) -> dict[str, float]:
    """Accuracy on each evaluation set (``launch.preflight.task_prompts``): ``eval/accuracy`` for
    the task's held-out problems, ``eval/<name>/accuracy`` for each of ``task.eval_sets``.
    ``progress``: a bar per set on a terminal (``launch.observe.progress_on``)."""
    return {("eval/accuracy" if name == "heldout" else f"eval/{name}/accuracy"):
            evaluate(rollout_actors, problems, greedy, progress=progress, desc=f"eval {name}")
            for name, problems in sets.items()}


def evaluate(rollout_actors: list, problems: list, greedy: bool, *, dense: bool = True,
             progress: bool = False, desc: str = "eval") -> float:
    """Held-out accuracy over all actors (weighted by how many problems each scored); decoded
    with a dense cache, or with the rollout KV policy when ``dense=False``. The bar advances as
    each actor's share comes back (the shares are not split further: that would change the
    sampling seeds, and so the accuracy, of sampled evaluation)."""
    import ray

    from launch.observe import bar

    refs = launch(rollout_actors, "evaluate", problems, greedy, dense)
    pbar, results = bar(len(problems), desc, progress), []
    while refs:
        done, refs = ray.wait(refs, num_returns=1)
        results.append(ray.get(done[0]))
        if pbar is not None:
            pbar.update(results[-1]["num_problems"])
    if pbar is not None:
        pbar.close()
    total = sum(r["num_problems"] for r in results)
    return sum(r["accuracy"] * r["num_problems"] for r in results) / max(total, 1)


class MetricsLog:
    """One JSON object per line in ``run_dir/metrics.jsonl`` and a short line on stdout; which
    samples each step trained on, and at which version, in ``run_dir/trained_samples.jsonl``.
    With ``run`` (the ``run:`` config section) every record also goes to TensorBoard / wandb / Ray
    gauges (``launch.observe.Sinks``) and ``steps()`` draws a bar on a terminal."""

    def __init__(self, run_dir: Path, run=None, config: dict | None = None):
        from launch.observe import Sinks

        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._f = self.path.open("a")
        self._trained = (run_dir / "trained_samples.jsonl").open("a")
        self.t0 = time.time()
        self.progress = bool(run is not None and run.progress)
        self.sinks = Sinks(run_dir, tensorboard=run is not None and run.tensorboard,
                           wandb=run is not None and run.wandb,
                           name=run_dir.name, config=config)
        if run is not None and run.tensorboard:
            print(f"[tensorboard] tensorboard --logdir {run_dir}", flush=True)
        self._bar = None

    def steps(self, first: int, last: int):
        """``range(first, last + 1)``, behind a progress bar when ``progress_on``."""
        from launch.observe import bar

        self._bar = bar(last, "steps", self.progress, initial=first - 1)
        for step in range(first, last + 1):
            yield step
            if self._bar is not None:
                self._bar.update(1)
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def trained(self, step: int, version: int, sample_ids: list[str]) -> None:
        self._trained.write(json.dumps({"step": step, "version": version,
                                        "sample_ids": sample_ids}) + "\n")
        self._trained.flush()

    def write(self, record: dict, show: tuple[str, ...] = ()) -> None:
        record = {"time_s": round(time.time() - self.t0, 2), **record}
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        self.sinks.write(record)
        if show:
            line = " ".join(f"{k}={_fmt(record[k])}" for k in show if k in record)
            if self._bar is not None:  # above the bar, which keeps the latest line too
                self._bar.set_postfix_str(line, refresh=False)
                self._bar.write(line)
            else:
                print(line, flush=True)

    def close(self) -> None:
        self._f.close()
        self._trained.close()
        self.sinks.close()

    def summary(self, summary: dict) -> None:
        """The run's ``summary.json``, its closing lines on stdout (the last one is
        ``held-out accuracy: A -> B``), and close the logs."""
        (self.path.parent / "summary.json").write_text(json.dumps(summary, indent=2))
        self.close()
        print(f"steps: {summary['steps']} (policy version {summary['version']})")
        print(f"time: {summary['time_s']:.0f} s; metrics: {self.path}")
        for name, acc in summary.get("eval_after", {}).items():
            if name != "eval/accuracy":
                print(f"{name}: {acc:.3f}")
        print(f"held-out accuracy: {summary['accuracy_before']:.2f} -> "
              f"{summary['accuracy_after']:.2f}")


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
