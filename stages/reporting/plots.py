"""The report's figures (matplotlib, written as PNG files):

- `training.png`: per training stage (pretrain, sft, lora, prefix: those with a train_log.csv),
  the training loss (each step, and a moving average), the dev loss where evaluation ran during
  training, and the learning rate, against the optimizer step;
- `quantization.png`: the quantization trade-off per variant: size on disk against corpus
  perplexity, against dev exact match, and the decode speed where it was measured;
- `stages.png`: every rule's wall time and peak memory from Snakemake's benchmark files.

Figures are drawn with the non-interactive Agg backend (no display needed, as on a cluster node).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Sequence

import matplotlib
import pandas as pd

matplotlib.use("Agg")  # files only, never a window; before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402

from stages.checkpoint.atomic import atomic_file
from stages.reporting.tables import MB, is_number

TRAINING_STAGES = ("pretrain", "sft", "lora", "prefix", "align")
SMOOTHING_STEPS = 20  # moving-average window of the training loss curve


def read_train_log(path: str | Path) -> pd.DataFrame:
    """train_log.csv as numbers (empty cells, e.g. steps without evaluation, become NaN)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return pd.DataFrame(rows).apply(pd.to_numeric, errors="coerce") if rows else pd.DataFrame()


def training_logs(experiment_dir: str | Path) -> dict[str, pd.DataFrame]:
    """{stage: its train_log.csv} for the experiment's training stages that have one."""
    logs = {}
    for stage in TRAINING_STAGES:
        path = Path(experiment_dir) / stage / "train_log.csv"
        if path.is_file():
            df = read_train_log(path)
            if len(df):
                logs[stage] = df
    return logs


def _save(fig, out: str | Path) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out, mode="wb") as f:
        # no timestamp in the PNG: the same numbers give the same file
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def _empty(fig_ax, text: str) -> None:
    fig_ax.text(0.5, 0.5, text, ha="center", va="center", transform=fig_ax.transAxes)
    fig_ax.set_axis_off()


def plot_training(logs: dict[str, pd.DataFrame], out: str | Path, experiment: str) -> None:
    stages = list(logs) or ["none"]
    fig, axes = plt.subplots(2, len(stages), figsize=(4.2 * len(stages), 6), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.4]}, sharex="col")
    for col, stage in enumerate(stages):
        loss_ax, lr_ax = axes[0][col], axes[1][col]
        if stage not in logs:
            _empty(loss_ax, "no training stage logged")
            lr_ax.set_axis_off()
            continue
        df = logs[stage]
        loss_ax.plot(df["step"], df["loss"], color="tab:blue", alpha=0.25, linewidth=0.8, label="train (each step)")
        window = max(1, min(SMOOTHING_STEPS, len(df) // 10))
        loss_ax.plot(df["step"], df["loss"].rolling(window, min_periods=1).mean(), color="tab:blue",
                     linewidth=1.6, label=f"train ({window}-step mean)")
        if "eval_loss" in df and df["eval_loss"].notna().any():
            evaluated = df[df["eval_loss"].notna()]
            loss_ax.plot(evaluated["step"], evaluated["eval_loss"], "o-", color="tab:orange", markersize=3,
                         label="dev")
        loss_ax.set_title(stage)
        loss_ax.set_ylabel("loss (nats/token)")
        loss_ax.grid(alpha=0.3)
        loss_ax.legend(fontsize="small")
        lr_ax.plot(df["step"], df["lr"], color="tab:green")
        lr_ax.set_xlabel("optimizer step")
        lr_ax.set_ylabel("learning rate")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        lr_ax.grid(alpha=0.3)
    fig.suptitle(f"{experiment}: training and dev loss, learning rate")
    _save(fig, out)


def _annotated_scatter(ax, points: Sequence[tuple[str, float, float]], marked: Sequence[str]) -> None:
    """Named points; a label whose point sits on an earlier one (e.g. wint4 and gptq-w4: the same
    size, nearly the same perplexity) moves down a line instead of printing over it."""
    xs, ys = [p[1] for p in points], [p[2] for p in points]
    x_span, y_span = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    for i, (name, x, y) in enumerate(points):
        ax.scatter([x], [y], s=40, color="tab:red" if name in marked else "tab:blue", zorder=3)
        overlaps = sum(abs(x - px) < 0.06 * x_span and abs(y - py) < 0.06 * y_span for _, px, py in points[:i])
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4 - 11 * overlaps), fontsize="small")
    ax.margins(x=0.15, y=0.12)  # room for the labels of the points at the edges
    ax.grid(alpha=0.3)


def plot_quantization(evals: dict[str, dict[str, Any]], variants: Sequence[str], out: str | Path,
                      experiment: str, marked: Sequence[str] = ()) -> None:
    """`variants`: the float source and its quantized variants, in display order; `marked` (the
    source) drawn in red."""
    shown = [v for v in variants if v in evals and is_number(evals[v].get("size_bytes"))]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("ppl", "corpus perplexity (lower is better)"), ("exact_match", "dev exact match"))
    for ax, (key, label) in zip(axes, panels):
        points = [(v, evals[v]["size_bytes"] / MB, evals[v][key]) for v in shown if is_number(evals[v].get(key))]
        if points:
            _annotated_scatter(ax, points, marked)
            ax.set_xlabel("size on disk (MB)")
            ax.set_ylabel(label)
        else:
            _empty(ax, f"no {label}")
    speed = [(v, evals[v]["decode_tokens_per_s_b1"]) for v in shown
             if is_number(evals[v].get("decode_tokens_per_s_b1"))]
    if speed:
        names, values = zip(*speed)
        axes[2].barh(names, values, color=["tab:red" if n in marked else "tab:blue" for n in names])
        axes[2].invert_yaxis()
        axes[2].set_xlabel("decode tokens/s, batch 1")
        axes[2].grid(alpha=0.3, axis="x")
    else:
        _empty(axes[2], "decode speed not measured")
    fig.suptitle(f"{experiment}: quantization trade-off (red: {', '.join(marked) or 'none'})")
    _save(fig, out)


def plot_stages(timings: pd.DataFrame, out: str | Path, experiment: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.6 + 0.28 * max(len(timings), 3)))
    if len(timings):
        ordered = timings.sort_values("s")
        names = list(ordered.index)
        axes[0].barh(names, ordered["s"], color="tab:blue")
        axes[0].set_xlabel("wall time (s)")
        rss = ordered["max_rss"] if "max_rss" in ordered else pd.Series(float("nan"), index=ordered.index)
        axes[1].barh(names, rss.fillna(0), color="tab:purple")
        axes[1].set_xlabel("peak resident memory (MB)")
        axes[1].set_yticklabels([])
        for ax in axes:
            ax.grid(alpha=0.3, axis="x")
    else:
        for ax in axes:
            _empty(ax, "no benchmark files")
    fig.suptitle(f"{experiment}: stage wall time and peak memory (Snakemake benchmarks)")
    _save(fig, out)
