"""Step 6f of ``launch/train.py``: a step's metrics (reward, mismatch and correction statistics, the
KV schedule's bins, buffer depth) and the metrics log with its sinks (``metrics.jsonl``, the stdout
line and progress bar, TensorBoard / wandb / Ray gauges through ``launch/observe.py``).
"""
from __future__ import annotations

import json
import time
from pathlib import Path


def batch_metrics(batch, learner_version: int, bin_tokens: int = 16,
                  kv_bytes_per_token: int | None = None) -> dict:
    """Reward, lengths, kept ratio, KV bytes and staleness of a training batch; checks log-prob
    lengths. ``rollout/kv_bytes_per_seq``: the mean over rows of the most KV bytes the engine
    stored for the sequence (all layers, K and V). ``rollout/kv_vs_dense`` (given the engine's
    ``kv_bytes_per_token``): that mean over what a dense cache of the same rows holds, every
    prompt and response token (sum of peaks / sum of lengths x bytes per token); a dense run reads
    just under 1 (its last sampled token is never cached). ``batch/anchor_lag_max``: versions
    between the old log-probs (the PPO anchor) and the weights the step trained from: 0 with a
    scorer pool, the staleness without one (``scorer.num_actors=0``).
    ``time/rollout_gen_s``: engine seconds that generated the batch, summed over rollout actors
    (each row carries its share of its engine call); ``rollout/tokens_per_s``: response tokens per
    engine second, i.e. one actor's generation throughput. (The driver's wait for a batch is no
    measure of either: in sync mode the rollouts run while the previous step logs and evaluates.)"""
    import pyarrow.compute as pc

    lengths_ok = all(pc.all(pc.equal(pc.list_value_length(batch.column(c)),
                                     batch.column("response_len"))).as_py()
                     for c in ("sampler_logprobs", "old_logprobs"))
    trained = learner_version - 1                            # the version the step trained from
    lag = trained - batch.column("policy_version").to_numpy()
    anchor = trained - batch.column("scorer_version").to_numpy()
    out = {"reward": float(pc.mean(batch.column("reward")).as_py()),
            "response_len": float(pc.mean(batch.column("response_len")).as_py()),
            "kept_ratio": float(pc.mean(batch.column("kept_ratio")).as_py()),
            "batch/logprob_lengths_match": lengths_ok,
            "batch/staleness_mean": float(lag.mean()), "batch/staleness_max": int(lag.max()),
            "batch/anchor_lag_max": int(anchor.max())}
    tokens = int(pc.sum(batch.column("response_len")).as_py() or 0)
    gen_s = float(pc.sum(batch.column("gen_time_s")).as_py() or 0.0)
    out.update({"batch/response_tokens": tokens, "time/rollout_gen_s": gen_s,
                "rollout/tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0})
    kv = pc.mean(batch.column("peak_kv_bytes")).as_py()  # rows of older segments: null
    if kv is not None:
        out["rollout/kv_bytes_per_seq"] = float(kv)
        if kv_bytes_per_token:
            out["rollout/kv_vs_dense"] = kv_vs_dense(batch, kv_bytes_per_token)
    return out | kv_schedule_metrics(batch, bin_tokens)


def kv_vs_dense(batch, kv_bytes_per_token: int) -> float:
    """Peak KV bytes of the rows that carry them over a dense cache of those rows' tokens."""
    import pyarrow.compute as pc

    rows = batch.filter(pc.is_valid(batch.column("peak_kv_bytes")))
    tokens = pc.sum(pc.add(rows.column("prompt_len"), rows.column("response_len"))).as_py()
    return float(pc.sum(rows.column("peak_kv_bytes")).as_py()) / (tokens * kv_bytes_per_token)


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


def buffer_depth(pools) -> dict:
    """How full the replay buffer is after a step (rows held, whole scored groups ready)."""
    from launch.recovery import buffer

    st = buffer(pools).stats()
    return {"buffer/live_rows": st["live_rows"], "buffer/ready_groups": st["ready_groups"],
            "buffer/fill_fraction": st["fill_fraction"]}


# What a step prints on stdout every run.log_every steps (every key goes to metrics.jsonl).
STEP_COLUMNS = ("step", "reward", "response_len", "kept_ratio", "correction/frac_vetoed", "loss",
                "eval/accuracy", "time/step_s")
# The correction's shares the summary reports as step means (correction.method=none logs zeros):
# at a budget too tight for the policy the veto takes most of a batch and the run learns little,
# which the reward and loss alone do not tell apart from a hard task.
CORRECTION_SHARES = (("correction/frac_vetoed", "correction_frac_vetoed"),
                     ("correction/frac_rejected", "correction_frac_rejected"))
# Steps whose batch fell under correction.rejection.min_kept_share (trained on nothing).
FLOORED = "correction/batch_floored"


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
        self._kv: list[tuple[float, float]] = []  # (bytes per sequence, vs dense) per step
        self._shares: dict[str, list[float]] = {key: [] for key, _ in CORRECTION_SHARES}
        self._floored = 0   # steps under the correction's kept-share floor

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
        if "rollout/kv_vs_dense" in record:
            self._kv.append((record["rollout/kv_bytes_per_seq"], record["rollout/kv_vs_dense"]))
        for key, values in self._shares.items():
            if key in record:
                values.append(float(record[key]))
        self._floored += int(record.get(FLOORED, 0) > 0)
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
        ``held-out accuracy: A -> B``), and close the logs. The rollout KV against dense (means
        over the steps this process logged) goes in beside the accuracy, and above it the
        correction's vetoed and rejected shares (step means) where the run logged them."""
        if self._kv:
            summary = {**summary,
                       "rollout_kv_bytes_per_seq": sum(b for b, _ in self._kv) / len(self._kv),
                       "rollout_kv_vs_dense": sum(r for _, r in self._kv) / len(self._kv)}
        shares = {name: sum(self._shares[key]) / len(self._shares[key])
                  for key, name in CORRECTION_SHARES if self._shares[key]}
        summary = {**summary, **shares, **({"correction_steps_floored": self._floored}
                                           if self._floored else {})}
        (self.path.parent / "summary.json").write_text(json.dumps(summary, indent=2))
        self.close()
        print(f"steps: {summary['steps']} (policy version {summary['version']})")
        print(f"time: {summary['time_s']:.0f} s; metrics: {self.path}")
        for name, acc in summary.get("eval_after", {}).items():
            if name != "eval/accuracy":
                print(f"{name}: {acc:.3f}")
        if len(shares) == len(CORRECTION_SHARES):
            steps = len(self._shares[CORRECTION_SHARES[0][0]])
            floored = (f"; {self._floored} of {steps} steps under rejection.min_kept_share, "
                       "no optimizer step" if self._floored else "")
            print(f"correction: {shares['correction_frac_vetoed']:.1%} of sequences vetoed, "
                  f"{shares['correction_frac_rejected']:.1%} of tokens rejected (mean over "
                  f"{steps} steps){floored}")
        if self._kv:
            print(f"rollout KV: {summary['rollout_kv_bytes_per_seq'] / 1024:.0f} KiB per sequence "
                  f"at peak, {summary['rollout_kv_vs_dense']:.2f} of a dense cache (mean over "
                  f"{len(self._kv)} steps)")
        print(f"held-out accuracy: {summary['accuracy_before']:.2f} -> "
              f"{summary['accuracy_after']:.2f}")


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
