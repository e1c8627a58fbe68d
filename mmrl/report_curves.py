"""The training curves of `mmrl report RUN_DIR`: every metric of metrics.jsonl that changes during the
run, drawn in groups by what its name says (a figure per group, PNG data URIs for the page), and
those that never change, for a table."""

from __future__ import annotations

import base64
import io
import math
import re
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mmrl.runlog import metric_number  # noqa: E402

PLOTS_PER_FIGURE = 12  # a metric group with more curves is split over several figures
SMOOTH_FROM = 60  # curves with at least this many points also get a moving average
CURVE_COLOR = "C0"

# Metric groups, first match wins (names with a "/" are grouped by their prefix instead).
GROUPS = [
    ("Held-out evaluation during training", re.compile(r"^(eval_|heldout)")),
    ("Reward and task", re.compile(r"reward|accuracy|success|score|tool|answer|align|tau|return")),
    ("Optimisation", re.compile(r"loss|kl|clip|grad|ratio|weight|lr$|^lr|entropy|adv|norm|value")),
    (
        "Cost and throughput",
        re.compile(r"nfe|second|time|token|fps|memory|mem_|step|leaves|frames|sequences"),
    ),
]
OTHER_GROUP = "Other"


def _png_data_uri(fig: plt.Figure, tight: bool = True) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight" if tight else None)
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def metric_group(name: str) -> str:
    """The section a metric is drawn in: its "prefix/" if it has one, else by what its name says."""
    if "/" in name:
        return name.split("/", 1)[0]
    lowered = name.lower()
    return next((group for group, pattern in GROUPS if pattern.search(lowered)), OTHER_GROUP)


def metric_series(rows: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """(step, value) points of every numeric metric, in first-logged order."""
    series: dict[str, list[tuple[float, float]]] = {}
    for index, row in enumerate(rows):
        step = row.get("step", index)
        for key, value in row.items():
            number = metric_number(value)
            if key != "step" and number is not None:
                series.setdefault(key, []).append((float(step), number))
    return series


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total, count, queue = [], 0.0, 0, []
    for value in values:
        finite = math.isfinite(value)
        queue.append(value if finite else None)
        total, count = total + (value if finite else 0.0), count + finite
        if len(queue) > window:
            old = queue.pop(0)
            if old is not None:
                total, count = total - old, count - 1
        out.append(total / count if count else float("nan"))
    return out


def _group_figure(names: list[str], series: dict[str, list[tuple[float, float]]]) -> str:
    """One PNG with a small plot per metric, three per row."""
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    width, height = 4.3 * cols, 2.7 * rows
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    # Fixed margins in inches instead of tight_layout: each layout pass redraws every axis, which
    # tripled the time of a page with many metrics.
    fig.subplots_adjust(left=0.6 / width, right=1 - 0.15 / width, bottom=0.45 / height, top=1 - 0.3 / height)
    fig.subplots_adjust(wspace=0.28, hspace=0.45)
    for ax in axes.flat[len(names) :]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names, strict=False):
        steps = [p[0] for p in series[name]]
        values = [p[1] for p in series[name]]
        sparse = len(values) <= 20
        if len(values) >= SMOOTH_FROM:
            ax.plot(steps, values, color=CURVE_COLOR, lw=0.8, alpha=0.35)
            smooth = _moving_average(values, max(2, len(values) // 30))
            ax.plot(steps, smooth, color=CURVE_COLOR, lw=1.6)
        else:
            ax.plot(steps, values, color=CURVE_COLOR, lw=1.6, marker="o" if sparse else None, ms=3)
        finite = [v for v in values if math.isfinite(v)]
        last = f"last {values[-1]:.4g}" if values else ""
        if finite and len(finite) < len(values):
            last += f", {len(values) - len(finite)} non-finite"
        ax.set_title(f"{name}  ({last})", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    return _png_data_uri(fig, tight=False)


def _is_constant(points: list[tuple[float, float]]) -> bool:
    """One value throughout (NaN/inf count as values), or nothing finite at all: no curve to draw."""
    values = [p[1] for p in points]
    finite = {v for v in values if math.isfinite(v)}
    return not finite or len(finite) == 1 and len(finite) == len(set(map(str, values)))


def metric_curves(rows: list[dict]) -> list[tuple[str, list[str], str]]:
    """(group, metric names, PNG data URI) for every group of metrics that change during the run.
    Metrics that never change are left to the caller's table (see `constant_metrics`)."""
    series = metric_series(rows)
    groups: dict[str, list[str]] = {}
    for name, points in series.items():
        if not _is_constant(points):
            groups.setdefault(metric_group(name), []).append(name)
    order = [g for g, _ in GROUPS] + sorted(g for g in groups if g not in dict(GROUPS) and g != OTHER_GROUP)
    order.append(OTHER_GROUP)
    figures = []
    for group in order:
        names = groups.get(group, [])
        chunks = [names[i : i + PLOTS_PER_FIGURE] for i in range(0, len(names), PLOTS_PER_FIGURE)]
        for i, chunk in enumerate(chunks):
            title = group if len(chunks) == 1 else f"{group} ({i + 1}/{len(chunks)})"
            figures.append((title, chunk, _group_figure(chunk, series)))
    return figures


def constant_metrics(rows: list[dict]) -> dict[str, Any]:
    """Metrics with one value through the whole log (e.g. skipped_steps = 0): a table, not a flat line."""
    return {name: points[0][1] for name, points in metric_series(rows).items() if _is_constant(points)}
