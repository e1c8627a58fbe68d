"""Held-out success over a training run: the curve of `eval.json` and `metrics.jsonl` against env steps,
the training episodes it took to reach a rate, and its plot with Wilson 95% intervals (success.png)."""

from __future__ import annotations

import json
from pathlib import Path

from mmrl.runlog import read_metrics
from vla_rl.evaluate import wilson_interval


def success_curve(run_dir: Path, counters: dict[str, int]) -> list[tuple[int, int, float]]:
    """(env steps, episodes, held-out success) at every evaluation of a run: before training (0, 0),
    each `eval_every` row of metrics.jsonl, and after training (the final counters)."""
    evaluations = json.loads((run_dir / "eval.json").read_text())
    curve = [(0, 0, evaluations["before"]["success_rate"])] if "before" in evaluations else []
    for row in read_metrics(run_dir):
        if "eval_success_rate" in row:
            curve.append((row["env_steps"], row["episodes"], row["eval_success_rate"]))
    if "after" in evaluations and (not curve or curve[-1][0] != counters["env_steps"]):
        curve.append((counters["env_steps"], counters["episodes"], evaluations["after"]["success_rate"]))
    return curve


def episodes_to(curve: list[tuple[int, int, float]], rate: float) -> int | None:
    """Training episodes before the first evaluation at or above `rate` (None: never reached)."""
    return next((episodes for _, episodes, success in curve if success >= rate), None)


def plot_success(curve: list[tuple[int, int, float]], episodes: int, method: str, path: Path) -> None:
    """Held-out success against env steps with Wilson 95% intervals, episodes marked on the points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, rollouts, rates = zip(*curve, strict=True) if curve else ((), (), ())
    intervals = [wilson_interval(round(rate * episodes), episodes) for rate in rates]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.errorbar(
        steps,
        rates,
        yerr=[
            [r - lo for r, (lo, _) in zip(rates, intervals, strict=True)],
            [hi - r for r, (_, hi) in zip(rates, intervals, strict=True)],
        ],
        marker="o",
        capsize=3,
        label=f"{method}: held-out success ({episodes} episodes, Wilson 95%)",
    )
    for x, y, n in zip(steps, rates, rollouts, strict=True):
        ax.annotate(f"{n} ep.", (x, y), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=7)
    ax.axhline(0.8, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="environment steps (policy and expert)", ylabel="success rate", ylim=(0, 1.05))
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
