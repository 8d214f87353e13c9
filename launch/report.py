"""Plots and a markdown summary of one or more runs, side by side.

    python launch/report.py RUN_DIR [RUN_DIR ...] [--out DIR] [--labels a,b,...]

Reads each run's ``metrics.jsonl`` (and ``summary.json`` when the run finished) and writes to
``--out`` (default: the first run's directory): ``report.png`` (one panel per figure below, every
run a line in each), ``report.json`` (the panels' titles and metric keys, the runs) and
``report.md`` (a table, a row per run). The PNG's own metadata also lists the panel titles.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (panel title, [(metrics.jsonl key, line style)]); a run without a key has no line there.
PANELS = [
    ("training reward", [("reward", "-")]),
    ("held-out accuracy", [("eval/accuracy", "-")]),
    ("agreement mean (-) / p5 (--)", [("mismatch/agreement_mean", "-"),
                                      ("mismatch/agreement_p5", "--")]),
    ("mismatch k3", [("mismatch/k3", "-")]),
    ("rejected (-) / vetoed (--) fraction", [("correction/frac_rejected", "-"),
                                             ("correction/frac_vetoed", "--")]),
    ("rollout KV bytes per sequence (peak)", [("rollout/kv_bytes_per_seq", "-")]),
    ("rollout tokens/s (per actor, engine time)", [("rollout/tokens_per_s", "-")]),
    ("staleness (mean lag, versions)", [("batch/staleness_mean", "-")]),
    ("buffer depth (live rows)", [("buffer/live_rows", "-")]),
]

# The markdown table: (column, metrics key, how the run's values reduce to one number)
TABLE = [("reward (last)", "reward", "last"),
         ("agreement p5 (mean)", "mismatch/agreement_p5", "mean"),
         ("k3 (mean)", "mismatch/k3", "mean"),
         ("rejected (mean)", "correction/frac_rejected", "mean"),
         ("vetoed (mean)", "correction/frac_vetoed", "mean"),
         ("signal dropped A>0 (mean)", "correction/signal_dropped_pos", "mean"),
         ("signal dropped A<0 (mean)", "correction/signal_dropped_neg", "mean"),
         ("KV kept (mean)", "kept_ratio", "mean"),
         ("KV bytes/seq (mean)", "rollout/kv_bytes_per_seq", "mean"),
         ("KV vs dense (mean)", "rollout/kv_vs_dense", "mean"),
         ("tokens/s (mean)", "rollout/tokens_per_s", "mean"),
         ("staleness (mean)", "batch/staleness_mean", "mean")]


def load_run(run_dir: Path, label: str | None = None) -> dict:
    """{label, dir, records (metrics.jsonl), summary (summary.json or {})}."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is it a run directory?)")
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return {"label": label or run_dir.name, "dir": str(run_dir), "records": records,
            "summary": summary}


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key``; a step logged twice (the last step's training record and the
    final evaluation) keeps its last value."""
    by_step = {int(r["step"]): float(r[key]) for r in records
               if key in r and isinstance(r[key], (int, float))}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def reduce(records: list[dict], key: str, how: str) -> float | None:
    _, values = series(records, key)
    if key == "eval/accuracy" or not values:
        return values[-1] if values else None
    train = [r[key] for r in records if key in r and "reward" in r]  # training steps only
    values = train or values
    return values[-1] if how == "last" else sum(values) / len(values)


def plot(runs: list[dict], out: Path) -> Path:
    """``report.png``: a 3 x 3 grid of PANELS, one line per run; the titles also go into the PNG's
    ``Description`` metadata (and ``report.json``) so tests and tools can check what is drawn."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display on a training box or in CI
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(15, 11), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, keys) in zip(axes.flat, PANELS):
        drawn = False
        for i, run in enumerate(runs):
            for key, style in keys:
                steps, values = series(run["records"], key)
                if steps:
                    ax.plot(steps, values, style, color=colors[i % len(colors)], marker=".",
                            label=run["label"] if style == "-" else None)
                    drawn = True
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    axes.flat[0].legend(fontsize=8)
    path = out / "report.png"
    titles = [t for t, _ in PANELS]
    fig.savefig(path, dpi=80, metadata={"Title": "sparse-rl report",
                                        "Description": json.dumps({"panels": titles})})
    plt.close(fig)
    return path


def markdown(runs: list[dict]) -> str:
    head = ["run", "steps", "held-out acc (before -> after)", *(c for c, _, _ in TABLE), "time (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        recs, summ = run["records"], run["summary"]
        _, acc = series(recs, "eval/accuracy")
        before = summ.get("accuracy_before", acc[0] if acc else None)
        after = summ.get("accuracy_after", acc[-1] if len(acc) > 1 else None)
        steps = max((int(r["step"]) for r in recs if "reward" in r), default=0)
        cells = [run["label"], str(steps), f"{_num(before)} -> {_num(after)}",
                 *(_num(reduce(recs, key, how)) for _, key, how in TABLE),
                 _num(summ.get("time_s"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _num(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def render(run_dirs: list[Path], out: Path | None = None, labels: list[str] | None = None) -> dict:
    """Plots, sidecar and summary of ``run_dirs`` into ``out``; returns the written paths."""
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    runs = [load_run(Path(d), labels[i] if labels else None) for i, d in enumerate(run_dirs)]
    out = Path(out or run_dirs[0])
    out.mkdir(parents=True, exist_ok=True)
    png = plot(runs, out)
    sidecar = out / "report.json"
    sidecar.write_text(json.dumps({"png": png.name, "panels": [
        {"title": t, "keys": [k for k, _ in keys]} for t, keys in PANELS],
        "runs": [{"label": r["label"], "dir": r["dir"]} for r in runs]}, indent=2))
    md = out / "report.md"
    md.write_text(f"# sparse-rl report\n\n![plots]({png.name})\n\n{markdown(runs)}")
    return {"png": png, "json": sidecar, "md": md}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="launch/report.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (with metrics.jsonl)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: first run)")
    ap.add_argument("--labels", default=None, help="comma-separated names, one per run")
    args = ap.parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    try:
        paths = render(args.runs, args.out, labels)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for p in paths.values():
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
