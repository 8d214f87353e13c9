"""Where a run's metrics go besides ``metrics.jsonl``: TensorBoard, optional wandb, Ray gauges,
and progress bars on a terminal.

``MetricsLog`` (launch/metrics.py) owns one ``Sinks`` and hands it every record it writes, so every
number in ``metrics.jsonl`` also lands in the TensorBoard event file under the same name.
"""
from __future__ import annotations

import sys
from pathlib import Path

# The figures the Ray dashboard shows (ray.util.metrics gauges), by metrics.jsonl name. Gauge names
# allow only [a-zA-Z0-9_:], hence the second column.
HEADLINE = {
    "reward": "sparse_rl_reward",
    "eval/accuracy": "sparse_rl_eval_accuracy",
    "mismatch/k3": "sparse_rl_mismatch_k3",
    "mismatch/agreement_mean": "sparse_rl_agreement_mean",
    "mismatch/agreement_p5": "sparse_rl_agreement_p5",
    "correction/frac_rejected": "sparse_rl_frac_rejected",
    "correction/frac_vetoed": "sparse_rl_frac_vetoed",
    "kept_ratio": "sparse_rl_kept_ratio",
    "rollout/tokens_per_s": "sparse_rl_rollout_tokens_per_s",
    "buffer/live_rows": "sparse_rl_buffer_live_rows",
    "batch/staleness_mean": "sparse_rl_staleness_mean",
    "time/step_s": "sparse_rl_step_seconds",
}


def scalars(record: dict) -> dict[str, float]:
    """The numeric entries of a metrics record (bools as 0/1; strings and ``step`` left out)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and v == v}  # v == v: not NaN


def progress_on(enabled: bool, stream=None) -> bool:
    """Bars only when asked for and ``stream`` (stderr, where tqdm draws) is a terminal: in a log
    file or a CI capture a bar is noise, and the per-step line carries the same numbers."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(enabled and isatty is not None and isatty())


def bar(total: int, desc: str, enabled: bool, stream=None, initial: int = 0):
    """A tqdm bar on ``stream`` (stderr), or None where ``progress_on`` says no."""
    if not progress_on(enabled, stream):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, file=stream or sys.stderr,
                dynamic_ncols=True, leave=False)


class Sinks:
    """TensorBoard writer (``run.tensorboard``), wandb run (``run.wandb``) and Ray gauges (when
    this process is connected to Ray, so the dashboard shows the headline figures)."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, wandb: bool = False,
                 name: str = "", config: dict | None = None):
        self.run_dir, self.name = Path(run_dir), name or Path(run_dir).name
        self.tb = self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), flush_secs=10)
        if wandb:
            self._wandb = _start_wandb(self.run_dir, self.name, config)
        self._gauges: dict | None = None

    def write(self, record: dict) -> None:
        step = int(record.get("step", 0))
        values = scalars(record)
        if self.tb is not None:
            for key, v in values.items():
                self.tb.add_scalar(key, v, global_step=step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        gauges = self._ray_gauges()
        for key, gauge in gauges.items():
            if key in values:
                gauge.set(values[key], tags={"run": self.name})

    def _ray_gauges(self) -> dict:
        """Created once Ray is up (the log starts before Ray does); none without Ray."""
        if self._gauges is None:
            ray = sys.modules.get("ray")
            if ray is None or not ray.is_initialized():
                return {}
            from ray.util.metrics import Gauge

            self._gauges = {k: Gauge(name, description=f"metrics.jsonl {k}", tag_keys=("run",))
                            for k, name in HEADLINE.items()}
        return self._gauges

    def flush(self) -> None:
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _start_wandb(run_dir: Path, name: str, config: dict | None):
    """A wandb run in ``run_dir``; wandb is optional (never in the lock), so the config check
    (``RunConfig.validate``) has already refused ``run.wandb=true`` when it is not installed."""
    import wandb
    import yaml

    cfg_file = run_dir / "config.yaml"  # train.py writes it before the log starts
    if config is None and cfg_file.is_file():
        config = yaml.safe_load(cfg_file.read_text())
    return wandb.init(project="sparse-rl", name=name, dir=str(run_dir), config=config or {})
