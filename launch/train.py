"""sparse-rl training, the whole data flow from top to bottom.

    python launch/train.py [--config launch/configs/X.yaml] [key=value ...]
    python launch/train.py resume=runs/<run>[/checkpoints/step-N] [key=value ...]   (or resume=latest)
    ray job submit --working-dir . -- python launch/train.py cluster.address=auto

Each step: rollout actors generate G samples per prompt with a compressed KV cache and record the
sampler's log-probs -> rows go into the Arrow buffer -> dense scorer actors fill in old-policy log-probs
-> the learner corrects the sparse/dense mismatch (rejection sampling + importance weights), takes a
GRPO/PPO step -> learner rank 0 broadcasts the new weights to every rollout and scorer actor.
Checkpoints (every run.checkpoint_every steps, after the last, on SIGTERM) resume exactly.
"""
from __future__ import annotations

import sys
from collections import deque
import time
from pathlib import Path


def main(argv: list[str]) -> dict:
    # 1. Config: merged and validated before anything starts (a bad key stops here, naming it).
    # resume=DIR starts from the checkpoint's own config; command-line keys still win. The model
    # directory, chat template and prompt + max_new_tokens vs max_position_embeddings too.
    from common.tokens import pad_token_id
    from launch import checkpoint
    from launch.config import RunMode, to_yaml
    from launch.preflight import check_model, check_shared_paths, task_prompts
    from tasks import make_task

    cfg, ckpt = checkpoint.load_run_config(argv)
    check_shared_paths(cfg)  # under `ray job submit`: absolute paths (each node has its own copy)
    tokenizer, encoder = check_model(cfg)
    pad_id = pad_token_id(tokenizer)  # the rollout and scorer pad by the same rule

    # 2. The task: training prompts in a seeded order, a fixed held-out slice for evaluation;
    # prompts longer than rollout.max_prompt_tokens are dropped, truncated or refused, and counted.
    task = make_task(cfg.task)
    train, evals, overlong = task_prompts(task, encoder, cfg.run.eval_problems, cfg.task.eval_sets)

    # 3. Ray (in-process on 127.0.0.1 unless cluster.address is set); pools a local Ray can never
    # place stop here. SIGTERM ends the run at once until the first step, then checkpoints.
    from cluster.resources import check_plan
    from cluster.ray_setup import start_ray

    run_dir = Path(cfg.run.out_dir) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    ray = start_ray(cfg.cluster, run_dir)
    check_plan(cfg, ray)
    stop = checkpoint.StopRequest()
    # A fresh folder per run, so a second run never mixes with (or deletes) an earlier one's files.
    run_dir.mkdir(parents=True, exist_ok=False)
    stop.discard_until_started(run_dir)  # a run that ends before its first step leaves no folder
    (run_dir / "config.yaml").write_text(to_yaml(cfg))

    from buffer.tensors import to_tensors
    from cluster.pools import broadcast_weights, build_pools, connect_weight_sync, on_learners
    from launch.faults import Faults
    from launch.evaluate import accuracy_before, evaluate_sets
    from launch.metrics import STEP_COLUMNS, MetricsLog, batch_metrics, buffer_depth
    from launch.recovery import buffer  # a lost buffer actor is re-created, the call repeated
    from launch.resize import apply_requested
    from launch.rollouts import PromptSampler, fill_rollouts, gather_rollouts, land_rollouts
    from launch.scoring import score_pending, sync_weights
    from schedule.replan import replan_schedule

    t_start = time.time()
    log = MetricsLog(run_dir, cfg.run)  # + TensorBoard (run.tensorboard), wandb, Ray gauges
    sampler = PromptSampler(train, cfg.run.prompts_per_step, cfg.run.seed)

    pools = build_pools(cfg, str(run_dir))  # waits for every actor: cluster.placement_timeout_s
    store = buffer(pools)  # the replay buffer actor, re-created from its segments if it dies
    kv_bpt = ray.get(pools.rollout[0].kv_bytes_per_token.remote())  # a dense cache, per token
    faults = Faults(run_dir, cfg.run.max_consecutive_skips, pools.faults)  # + skips, failed rewards

    # 4. Resuming: learners (weights, optimiser, RNG), buffer rows and data position come back.
    # Then one broadcast group, separate from DeepSpeed's: learner rank 0 -> rollout + scorer actors.
    state = checkpoint.restore(ckpt, pools, sampler) if ckpt else {"step": 0, "in_flight": 0}
    faults.restore(state)  # fault counts go on where the checkpoint left them
    connect_weight_sync(pools, cfg)
    version, sync = broadcast_weights(pools)  # everyone starts from the learner's exact weights
    log.write({"step": state["step"], "version": version, **sync, **overlong,
               "resumed_from": str(ckpt or "")})

    # 5. Held-out accuracy before RL, logged as step 0 (a resumed run keeps the first run's).
    acc_before = accuracy_before(state, pools.rollout, evals, cfg.run.eval_greedy, log)

    # 6. RL steps. sync: generate, then train. async: the next rollouts start as soon as the current
    # batch is in, overlapping scoring and the learner step; with run.rollouts_ahead=s, s batches
    # stay in flight (samples lag up to s versions; with s > 1 which one depends on timing).
    overlap = cfg.run.mode == RunMode.async_
    in_flight = deque([] for _ in range(state["in_flight"]))  # batches a checkpoint landed
    fill_rollouts(in_flight, pools, sampler, version, cfg.run.steps)  # resumed: landed ones count
    stop.steps_started()  # SIGTERM from now on: checkpoint after the current step, then exit
    for step in log.steps(state["step"] + 1, cfg.run.steps):  # a bar on a terminal
        t0 = time.time()
        # 6a. Sparse rollouts: G samples per prompt, sampler log-probs, rewards, policy version.
        # (A rollout actor that died is replaced and its share regenerated: cluster/elastic.py.)
        rows = gather_rollouts(in_flight.popleft(), pools, cfg, version)  # the oldest batch
        faults.note_rewards(step, rows)  # rewards that raised or timed out: 0, marked, counted
        if overlap:  # async: the next rollouts start now, with the current weights, and
            fill_rollouts(in_flight, pools, sampler, version, cfg.run.steps)  # overlap training
        store.append(rows)
        t_roll = time.time() - t0

        # 6b. Dense scorer: old-policy log-probs for the rows waiting (none when scorer.num_actors=0:
        # the rollout actors' dense pass scored their own samples, at the sampler's version).
        score_pending(pools, cfg, version)

        # 6c. A batch of whole groups within the staleness bound -> padded tensors; GRPO advantages
        # and the correction (IS weights, rejection) over the whole batch, then whole groups per
        # learner, so the update does not depend on how the batch is split.
        batch = store.sample_batch(cfg.run.prompts_per_step, version)
        if batch is None:
            raise RuntimeError(f"step {step}: the buffer had no complete scored groups to train on")

        # 6d. PPO: learner.mini_batches optimiser steps on every data-parallel learner. A NaN/inf
        # input, loss or gradient skips the step instead (counted, named; launch/faults.py).
        metrics, trained = faults.train(pools, cfg, batch, to_tensors(batch, pad_id), step, version)

        # 6e. New weights to every rollout and scorer actor: staged beside any rollout still
        # running (never waited for), swapped in before each actor's next batch. A dynamic KV
        # schedule (rollout.kv.schedule) re-plans its budgets from the probes first.
        kv_plan = replan_schedule(pools, cfg, step)
        version, sync = sync_weights(pools, cfg)
        sync |= apply_requested(run_dir, in_flight, pools, cfg, version,  # python -m launch.resize
                                faults.rewards_of(step))
        if not overlap:
            fill_rollouts(in_flight, pools, sampler, version, cfg.run.steps)

        # 6f. Metrics: reward, mismatch and correction statistics, timings.
        record = {"step": step, "version": version, **kv_plan,
                  **batch_metrics(batch, version, cfg.rollout.kv.bin_tokens, kv_bpt),
                  "time/rollout_wait_s": t_roll, "time/step_s": time.time() - t0, **sync,
                  **buffer_depth(pools), **faults.metrics(),
                  **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
        if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step < cfg.run.steps:
            record.update(evaluate_sets(pools.rollout, evals, cfg.run.eval_greedy, log.progress))
        log.write(record, show=STEP_COLUMNS if step % cfg.run.log_every == 0 else ())
        log.trained(step, version, trained)

        # 6g. Checkpoint (every N steps, after the last, on SIGTERM). Rollouts in flight land in
        # the buffer first, so the checkpoint holds them and a resumed run trains on the same rows.
        if stop or checkpoint.due(cfg.run, step):
            landed = land_rollouts(in_flight, pools, cfg, version, faults.rewards_of(step))
            ckpt = checkpoint.save(run_dir, cfg, pools, step=step, version=version, sampler=sampler,
                                   accuracy_before=acc_before, in_flight=landed,
                                   faults=faults.state())
        if stop:  # the checkpoint is this run's result; exit code 143 (128 + SIGTERM)
            print(f"stopped by {stop.signal} after step {step}; resume={ckpt}", flush=True)
            log.close(), ray.shutdown()
            return {"stopped": stop.signal, "step": step, "version": version, "checkpoint": str(ckpt)}

    # 7. Held-out accuracy after RL, the trained model in HF format, and the summary.
    after = evaluate_sets(pools.rollout, evals, cfg.run.eval_greedy, log.progress)
    acc_after = after["eval/accuracy"]
    log.write({"step": cfg.run.steps, **after})
    on_learners(pools, "save_hf", str(run_dir / "final"))
    summary = {"steps": cfg.run.steps, "version": version, "time_s": round(time.time() - t_start, 1),
               "accuracy_before": acc_before, "accuracy_after": acc_after, "eval_after": after,
               "run_dir": str(run_dir), **overlong, **faults.metrics()}
    log.summary(summary)
    ray.shutdown()
    return summary


if __name__ == "__main__":  # exit codes: launch/cli.py (0 done, 2 bad input, 3 fault, 143 SIGTERM)
    from common.cpu_isa import pin_cpu_isa
    from launch.cli import exit_code

    pin_cpu_isa()  # the same kernels on every x86-64 machine; the actors inherit it (worker_env)
    sys.exit(exit_code(main, sys.argv[1:], __doc__))
