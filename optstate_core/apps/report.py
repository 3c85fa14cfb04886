"""The demo's outputs: metrics.csv, the summary table and the loss/memory plot."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import List, Sequence

from .demo_config import RunResult

#: metrics.csv columns, in order
CSV_COLUMNS = ("run", "step", "loss", "val_loss", "step_time_ms", "tensor_mem_mb", "materialize_ms",
               "inner_step_ms", "commit_ms", "overhead_ms", "cpu_mem_mb", "gpu_mem_mb", "gpu_peak_mb",
               "compression_active")


# -- outputs --------------------------------------------------------------------------------
def write_csv(results: Sequence[RunResult], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in results:
            for row in r.rows:
                writer.writerow({k: _csv_value(row[k]) for k in CSV_COLUMNS})


def _csv_value(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def gap_percent(value: float, reference: float) -> float:
    """Relative difference to the reference, in percent."""
    return 100.0 * (value - reference) / reference


def summary_rows(results: Sequence[RunResult]) -> List[dict]:
    ref = next(r for r in results if r.preset is None)
    return [{"run": r.name, "state_mb": r.state_bytes / 2**20, "bits_per_param": r.bits_per_param,
             "step_ms": r.step_ms, "time_ratio": r.step_ms / ref.step_ms, "val_loss": r.final_val_loss,
             "gap_pct": gap_percent(r.final_val_loss, ref.final_val_loss)} for r in results]


def format_summary(results: Sequence[RunResult]) -> str:
    lines = ["| run | state MB | bits/param | step ms | x AdamW | final val loss | gap to AdamW |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for s in summary_rows(results):
        lines.append(f"| {s['run']} | {s['state_mb']:.2f} | {s['bits_per_param']:.1f} | {s['step_ms']:.1f} | "
                     f"{s['time_ratio']:.2f} | {s['val_loss']:.4f} | {s['gap_pct']:+.2f}% |")
    return "\n".join(lines)


def plot(results: Sequence[RunResult], path: Path, title: str = "") -> None:
    """Loss curves (train, smoothed, and held-out) beside optimizer-state memory per run."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    summary = summary_rows(results)
    for i, r in enumerate(results):
        c = colors[i % len(colors)]
        steps = [row["step"] for row in r.rows]
        ax_loss.plot(steps, _smooth([row["loss"] for row in r.rows]), color=c, alpha=0.6, lw=1,
                     label=f"{r.name} train")
        val = [(row["step"], row["val_loss"]) for row in r.rows if row["val_loss"] is not None]
        if val:
            ax_loss.plot(*zip(*val), color=c, marker="o", ls="--", label=f"{r.name} held-out")
    vals = [row["val_loss"] for r in results for row in r.rows if row["val_loss"] is not None]
    if vals:  # the first steps' large losses would flatten the part worth seeing
        ax_loss.set_ylim(top=max(vals) + 0.5 * (max(vals) - min(vals)) + 0.05)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (nats / byte)")
    ax_loss.set_title("loss")
    ax_loss.legend(fontsize=8)
    ax_loss.grid(alpha=0.3)
    names = [s["run"] for s in summary]
    bars = ax_mem.bar(names, [s["state_mb"] for s in summary], color=colors[:len(names)])
    for bar, s in zip(bars, summary):
        ax_mem.annotate(f"{s['bits_per_param']:.1f} bits/param\n{s['time_ratio']:.2f}x step time",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax_mem.set_ylabel("optimizer state (MiB)")
    ax_mem.set_title("optimizer-state memory")
    ax_mem.margins(y=0.25)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _smooth(values: Sequence[float]) -> List[float]:
    """Centered moving average (no lag) over about 1/40 of the run."""
    half = len(values) // 80
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half): i + half + 1]
        out.append(sum(window) / len(window))
    return out


# -- command line ---------------------------------------------------------------------------
