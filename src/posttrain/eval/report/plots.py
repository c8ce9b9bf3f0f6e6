"""The report's curves as PNGs: one per panel some run logged, and curves.png with them all; one
line per choice (the mean over its seeds) with a band from its lowest to its highest seed."""

from __future__ import annotations

import math
from pathlib import Path

from posttrain.eval.report.curves import X_AXES, seed_band, smoothed
from posttrain.eval.report.runs import Run

# (file stem, title, metrics in order of preference: the first one any run logged, scale)
PANELS = (
    ("reward", "reward (rollout mean)", ("rollout/reward_mean",), 1.0),
    ("eval_accuracy", "held-out accuracy % (greedy)", ("eval/accuracy",), 100.0),
    # beside the accuracy: a learned reward's score of the same responses (over-optimisation shows as a parting)
    ("proxy_reward", "held-out proxy reward (learned, greedy)", ("eval/proxy_reward",), 1.0),
    # calibration of the greedy responses: expected calibration error (0: confidence = accuracy)
    ("ece", "held-out calibration error (ECE, greedy)", ("eval/ece",), 1.0),
    ("response_length", "response length (tokens)", ("rollout/response_len_mean", "eval/response_len"), 1.0),
    ("kl", "KL to the reference", ("policy/kl",), 1.0),
    ("entropy", "entropy (nats / token)", ("policy/entropy",), 1.0),
    ("clip_fraction", "clip fraction", ("policy/clip_frac",), 1.0),
    ("mismatch_kl", "sampler-trainer mismatch KL", ("rollout/mismatch/kl",), 1.0),
)


def pyplot():
    """matplotlib.pyplot, drawing headless (Agg: no display on a cluster node)."""
    # start-up: plotting loads only when a report draws
    import matplotlib

    matplotlib.use("Agg")
    # start-up: plotting loads only when a report draws
    import matplotlib.pyplot as plt

    return plt


def draw_panel(ax, metric: str, title: str, scale: float, groups: dict[tuple, list[Run]], labels: list[str],
               smooth: int, x_label: str, interpolate: bool = False) -> None:
    # start-up: plotting loads only when a report draws
    from matplotlib.ticker import MaxNLocator

    # held-out metrics are a few points each (every val_check_interval): markers, no smoothing
    evaluated = metric.startswith("eval/")
    for i, members in enumerate(groups.values()):
        series = [smoothed({x: scale * v for x, v in run.history[metric].items()}, 1 if evaluated else smooth)
                  for run in members if metric in run.history]
        if not series:
            continue
        xs, mean, low, high = seed_band(series, interpolate)
        color = f"C{i % 10}"
        ax.plot(xs, mean, color=color, label=labels[i], marker="o" if evaluated else None, markersize=3,
                linewidth=1.2)
        if len(series) > 1:
            ax.fill_between(xs, low, high, color=color, alpha=0.2, linewidth=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # batches, samples and tokens are whole numbers
    ax.set_title(f"{title}\n{metric}", fontsize=9)
    ax.set_xlabel(x_label, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def write_plots(groups: dict[tuple, list[Run]], labels: list[str], out_dir: Path, smooth: int,
                x_axis: str = "batch") -> list[str]:
    """One PNG per panel some run logged, and curves.png with all of them; returns the files."""
    runs = [run for members in groups.values() for run in members]
    logged = {name for run in runs for name in run.history}
    panels = []
    for stem, title, candidates, scale in PANELS:
        metric = next((m for m in candidates if m in logged), None)
        if metric is not None:
            panels.append((stem, title, metric, scale))
    if not panels:
        return []
    plt = pyplot()
    x_label = X_AXES[x_axis][1] if x_axis != "batch" or "rollout/batch" in logged else "training batch"

    files = []
    for stem, title, metric, scale in panels:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        draw_panel(ax, metric, title, scale, groups, labels, smooth, x_label, interpolate=x_axis != "batch")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / f"{stem}.png", dpi=120)
        plt.close(fig)
        files.append(f"{stem}.png")

    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows + 0.4), squeeze=False)
    for ax, (stem, title, metric, scale) in zip(axes.flat, panels):
        draw_panel(ax, metric, title, scale, groups, labels, smooth, x_label, interpolate=x_axis != "batch")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    # one legend for the figure, every choice in it (a panel may lack some: no KL for dapo)
    handles = [plt.Line2D([], [], color=f"C{i % 10}", label=label) for i, label in enumerate(labels)]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), fontsize=8, frameon=False)
    legend_height = 0.25 * math.ceil(len(handles) / 4) + 0.1  # inches: a row per 4 choices
    fig.tight_layout(rect=(0, legend_height / fig.get_figheight(), 1, 1))
    fig.savefig(out_dir / "curves.png", dpi=120)
    plt.close(fig)
    return ["curves.png"] + files
