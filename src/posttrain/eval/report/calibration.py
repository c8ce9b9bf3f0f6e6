"""The report's calibration section, for runs that logged held-out calibration (`eval/ece`,
`eval/reliability/*`): ECE and confidence per choice before and after training, and the
reliability diagram (reliability.png)."""

from __future__ import annotations

import re
from pathlib import Path

from posttrain.eval.report.plots import pyplot
from posttrain.eval.report.runs import Run
from posttrain.eval.report.tables import column_cells, markdown_table, scaled

CALIBRATION_COLUMNS = (
    ("ECE start", lambda s: scaled(s, "eval/ece_start"), ".3f"),
    ("ECE end", lambda s: scaled(s, "eval/ece"), ".3f"),
    ("confidence start %", lambda s: scaled(s, "eval/confidence_start", 100), ".1f"),
    ("confidence end %", lambda s: scaled(s, "eval/confidence", 100), ".1f"),
    ("acc start %", lambda s: scaled(s, "eval/accuracy_start", 100), ".1f"),
    ("acc end %", lambda s: scaled(s, "eval/accuracy", 100), ".1f"),
)


def reliability_points(summaries: list[dict], suffix: str = "") -> tuple[list[float], list[float], list[float]]:
    """(mean confidence, accuracy, share) of each non-empty confidence bin, pooled over the
    summary.json of a choice's runs: each run's bin weighted by its share of that run's
    responses. Read from `eval/reliability/bin<b>/{share,confidence,accuracy}<suffix>` (suffix
    '_start': before training)."""
    pattern = re.compile(rf"eval/reliability/bin(\d+)/share{suffix}$")
    bins = sorted({int(m.group(1)) for summary in summaries for key in summary if (m := pattern.match(key))})
    confidence, accuracy, share = [], [], []
    for b in bins:
        prefix = f"eval/reliability/bin{b:02d}/"
        rows = [(summary[f"{prefix}share{suffix}"], summary[f"{prefix}confidence{suffix}"],
                 summary[f"{prefix}accuracy{suffix}"]) for summary in summaries if f"{prefix}share{suffix}" in summary]
        weight = sum(w for w, _, _ in rows)
        if weight <= 0:  # an empty bin in every run
            continue
        confidence.append(sum(w * c for w, c, _ in rows) / weight)
        accuracy.append(sum(w * a for w, _, a in rows) / weight)
        share.append(weight / len(rows))
    return confidence, accuracy, share


def write_reliability_plot(groups: dict[tuple, list[Run]], labels: list[str], out_dir: Path) -> str | None:
    """reliability.png: accuracy against confidence per bin, before and after training, one
    line per choice (its seeds pooled), marker area by the bin's share; the diagonal is a
    calibrated model. None when no run has reliability bins."""
    summaries = [[run.summary for run in members] for members in groups.values()]
    panels = [(suffix, title) for suffix, title in (("_start", "before training"), ("", "after training"))
              if any(reliability_points(choice, suffix)[0] for choice in summaries)]
    if not panels:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.0), squeeze=False)
    for ax, (suffix, title) in zip(axes[0], panels):
        ax.plot([0, 1], [0, 1], color="black", linestyle="--", linewidth=0.8)
        for i, choice in enumerate(summaries):
            confidence, accuracy, share = reliability_points(choice, suffix)
            if confidence:
                ax.plot(confidence, accuracy, color=f"C{i % 10}", linewidth=1.0)
                ax.scatter(confidence, accuracy, s=[20 + 200 * w for w in share], color=f"C{i % 10}", alpha=0.7)
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence (probability of the greedy response)",
               ylabel="accuracy")
        ax.set_title(f"reliability, {title}", fontsize=9)
        ax.xaxis.label.set_fontsize(8)
        ax.yaxis.label.set_fontsize(8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    # one legend below the panels, a row per choice (labels can be long)
    handles = [plt.Line2D([], [], color="black", linestyle="--", label="calibrated (accuracy = confidence)")]
    handles += [plt.Line2D([], [], color=f"C{i % 10}", marker="o", label=label) for i, label in enumerate(labels)]
    fig.legend(handles=handles, loc="lower center", ncol=1, fontsize=7, frameon=False)
    legend_height = 0.17 * len(handles) + 0.1  # inches
    fig.set_figheight(fig.get_figheight() + legend_height)
    fig.tight_layout(rect=(0, legend_height / fig.get_figheight(), 1, 1))
    fig.savefig(out_dir / "reliability.png", dpi=120)
    plt.close(fig)
    return "reliability.png"


def calibration_section(groups: dict[tuple, list[Run]], labels: list[str], by: list[str], out_dir: Path) -> list[str]:
    """The report's calibration section (runs that logged eval/ece): a table of ECE, confidence
    and accuracy per choice, and the reliability diagram; [] when no run has it."""
    if not any("eval/ece" in run.summary for members in groups.values() for run in members):
        return []
    body = [list(key) + [str(len(members))] + column_cells(members, CALIBRATION_COLUMNS)
            for key, members in groups.items()]
    picture = write_reliability_plot(groups, labels, out_dir)
    lines = [
        "## Calibration",
        "",
        "Held-out greedy responses: confidence is the policy's probability of its whole response "
        "(exp of the sum of its token log-probs), ECE the expected calibration error over equal-width "
        "confidence bins (0: confidence equals accuracy in every bin; confidence above accuracy: "
        "over-confident).",
        "",
        *markdown_table(by + ["n"] + [name for name, _, _ in CALIBRATION_COLUMNS], body),
        "",
    ]
    if picture:
        lines += [f"![reliability]({picture})", ""]
    return lines
