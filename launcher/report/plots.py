"""The report's plots of one example's runs (matplotlib, Agg; imported only when plotting).

Each function draws one figure over ``records`` (oldest first; x = the run's position, labelled
by its date), writes it as a PNG and returns a ``Plot``: the matplotlib ``Figure`` itself (its
lines, bands and bars are what the tests read back) and the file.  Artists carry labels:

  accuracy     "accuracy", "95% interval" (Wilson, a band), "lower_bound", "baseline", "gate failed"
  drop         "paired drop", "95% interval" (McNemar exact, a band), "max_drop"
  kl           "mean KL"
  stage_times  one stacked bar series per stage, labelled by the stage
  size_ratio   "export / bf16"

A value a run does not have (no gate, no baseline) is NaN: a gap in the line, not a zero.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from launcher.contract import STAGE_ORDER

FIGSIZE = (6.4, 3.0)
DPI = 100
MAX_TICKS = 12
STAGE_COLORS = {"quantize": "#4c72b0", "mmlu": "#dd8452", "export": "#55a868", "vllm_smoke": "#8172b3"}
NAN = float("nan")


@dataclass
class Plot:
    kind: str
    title: str
    path: str
    figure: Any                       # matplotlib.figure.Figure
    x_labels: list[str] = field(default_factory=list)
    empty: Optional[str] = None       # why nothing is drawn (e.g. no paired baseline in these runs)

    @property
    def axes(self):
        return self.figure.axes[0]


def run_label(record: dict) -> str:
    created = str(record.get("created") or "")
    if len(created) >= 16:            # 2026-12-04T02:10:33 -> 12-04 02:10
        return created[5:10] + " " + created[11:16]
    return str(record.get("run_id", "?"))[:13]


def _value(record: dict, *path: str, index: Optional[int] = None) -> float:
    v: Any = record
    for key in path:
        v = v.get(key) if isinstance(v, dict) else None
    if index is not None:
        v = v[index] if isinstance(v, (list, tuple)) and len(v) > index else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else NAN


def _new_figure(title: str, ylabel: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _finish(kind: str, title: str, fig, ax, records: list[dict], out_dir: str, stem: str,
            empty: Optional[str] = None) -> Plot:
    labels = [run_label(r) for r in records]
    n = len(labels)
    step = max(1, math.ceil(n / MAX_TICKS))
    ticks = list(range(0, n, step))
    ax.set_xticks(ticks, [labels[i] for i in ticks], rotation=30, ha="right", fontsize=7)
    ax.set_xlim(-0.6, max(n - 0.4, 0.6))
    ax.tick_params(axis="y", labelsize=8)
    if empty:
        ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", fontsize=9, color="#666")
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best", framealpha=0.8)
    path = os.path.join(out_dir, f"{stem}-{kind}.png")
    fig.savefig(path, format="png")
    return Plot(kind=kind, title=title, path=path, figure=fig, x_labels=labels, empty=empty)


def _band(ax, x, lo, hi, label: str, color: str) -> None:
    """A shaded interval between ``lo`` and ``hi`` (NaN: no band there); one run: a short box."""
    import numpy as np

    lo_a, hi_a = np.array(lo, dtype=float), np.array(hi, dtype=float)
    ok = ~(np.isnan(lo_a) | np.isnan(hi_a))
    style = dict(color=color, alpha=0.22, linewidth=0, label=label)
    if ok.sum() == 1:
        i = int(np.flatnonzero(ok)[0])
        ax.fill_between([x[i] - 0.25, x[i] + 0.25], [lo_a[i]] * 2, [hi_a[i]] * 2, **style)
    elif ok.any():
        ax.fill_between(x, lo_a, hi_a, where=ok, **style)


def plot_accuracy(records: list[dict], out_dir: str, stem: str) -> Plot:
    fig, ax = _new_figure("MMLU gate: accuracy", "accuracy")
    x = list(range(len(records)))
    acc = [_value(r, "gate", "accuracy") for r in records]
    lo = [_value(r, "gate", "interval", index=0) for r in records]
    hi = [_value(r, "gate", "interval", index=1) for r in records]
    bound = [_value(r, "gate", "lower_bound") for r in records]
    base = [_value(r, "gate", "baseline_accuracy") for r in records]
    _band(ax, x, lo, hi, "95% interval", "#4c72b0")
    ax.plot(x, acc, marker="o", color="#4c72b0", label="accuracy")
    if any(not math.isnan(b) for b in bound):
        ax.plot(x, bound, color="#c44e52", linestyle="--", drawstyle="steps-mid", marker="_", markersize=14,
                label="lower_bound")
    if any(not math.isnan(b) for b in base):
        ax.plot(x, base, color="#555555", linestyle=":", marker="s", markersize=4, label="baseline")
    failed = [(i, a) for i, (a, r) in enumerate(zip(acc, records)) if (r.get("gate") or {}).get("pass") is False]
    if failed:
        ax.plot([i for i, _ in failed], [a for _, a in failed], linestyle="none", marker="X", markersize=10,
                color="#c44e52", label="gate failed")
    empty = None if any(not math.isnan(a) for a in acc) else "no gate results in these runs"
    return _finish("accuracy", "MMLU gate: accuracy", fig, ax, records, out_dir, stem, empty)


def plot_drop(records: list[dict], out_dir: str, stem: str) -> Plot:
    fig, ax = _new_figure("Paired drop vs max_drop", "baseline - quantized")
    x = list(range(len(records)))
    drop = [_value(r, "gate", "drop") for r in records]
    lo = [_value(r, "gate", "drop_interval", index=0) for r in records]
    hi = [_value(r, "gate", "drop_interval", index=1) for r in records]
    max_drop = [_value(r, "gate", "max_drop") for r in records]
    ax.axhline(0.0, color="#999999", linewidth=0.8)
    _band(ax, x, lo, hi, "95% interval", "#dd8452")
    ax.plot(x, drop, marker="o", color="#dd8452", label="paired drop")
    if any(not math.isnan(m) for m in max_drop):
        ax.plot(x, max_drop, color="#c44e52", linestyle="--", drawstyle="steps-mid", marker="_", markersize=14,
                label="max_drop")
    empty = None if any(not math.isnan(d) for d in drop) else "no baseline (no drop) in these runs"
    return _finish("drop", "Paired drop vs max_drop", fig, ax, records, out_dir, stem, empty)


def plot_kl(records: list[dict], out_dir: str, stem: str) -> Plot:
    fig, ax = _new_figure("Mean KL(baseline || quantized), A-D", "nats")
    kl = [_value(r, "gate", "mean_kl") for r in records]
    ax.plot(list(range(len(records))), kl, marker="o", color="#55a868", label="mean KL")
    empty = None if any(not math.isnan(v) for v in kl) else "no per-question baseline in these runs"
    return _finish("kl", "Mean KL(baseline || quantized), A-D", fig, ax, records, out_dir, stem, empty)


def plot_stage_times(records: list[dict], out_dir: str, stem: str) -> Plot:
    fig, ax = _new_figure("Stage times (stacked)", "seconds")
    x = list(range(len(records)))
    names = [s for s in STAGE_ORDER if any(not math.isnan(_value(r, "stages", s, "duration_s")) for r in records)]
    bottom = [0.0] * len(records)
    for s in names:
        secs = [_value(r, "stages", s, "duration_s") for r in records]
        secs = [0.0 if math.isnan(v) else v for v in secs]
        ax.bar(x, secs, bottom=bottom, width=0.7, color=STAGE_COLORS.get(s), label=s)
        bottom = [b + v for b, v in zip(bottom, secs)]
    empty = None if names else "no stage finished in these runs"
    return _finish("stage_times", "Stage times (stacked)", fig, ax, records, out_dir, stem, empty)


def plot_size_ratio(records: list[dict], out_dir: str, stem: str) -> Plot:
    fig, ax = _new_figure("Export size / bf16", "ratio")
    ratio = [_value(r, "export", "size_ratio") for r in records]
    ax.plot(list(range(len(records))), ratio, marker="o", color="#8172b3", label="export / bf16")
    ax.set_ylim(bottom=0)
    empty = None if any(not math.isnan(v) for v in ratio) else "no verified export in these runs"
    return _finish("size_ratio", "Export size / bf16", fig, ax, records, out_dir, stem, empty)


PLOTS: tuple[Callable[[list[dict], str, str], Plot], ...] = (
    plot_accuracy, plot_drop, plot_kl, plot_stage_times, plot_size_ratio)


def plot_example(records: list[dict], out_dir: str, stem: str) -> list[Plot]:
    """Every plot of one example's runs (oldest first), written under ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    return [fn(records, out_dir, stem) for fn in PLOTS]
