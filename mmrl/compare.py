"""`mmrl report RUN ... --compare PNG`: learning curves (held out, or a training metric) of several runs
in one plot, runs whose configs differ only in their seed drawn as one method (the mean over seeds
with a band; `mmrl.method_groups` groups them), and the plotted numbers with each method's final mean
and 95% interval in a JSON file beside the PNG."""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mmrl.config import ConfigError, check_output_dir, read_json_object  # noqa: E402
from mmrl.method_groups import chosen_labels, distinct_runs, group_methods  # noqa: E402
from mmrl.runlog import metric_number, read_launches, read_metric_rows  # noqa: E402


def check_plot_path(out: str | Path) -> Path:
    """`out` as a Path a figure can be saved to, checked before any run is read and without making
    its folder: a suffix matplotlib cannot write, a directory or an unwritable folder fails in one
    line, and a refused command leaves nothing behind."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(out)
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if path.suffix.lower().removeprefix(".") not in formats:
        raise ConfigError(
            f"--compare {str(out)!r}: matplotlib cannot write a {path.suffix or 'suffix-less'} file: give "
            f"a .png path (or one of .{', .'.join(formats)})"
        )
    if path.is_dir():
        raise ConfigError(
            f"--compare {str(out)!r} is a directory: give a file path, e.g. {path / 'compare.png'}"
        )
    check_output_dir(path.parent, "--compare (its folder)")
    return path


# ------------------------------------------------------------------------------------- comparison

# X axes of `compare_runs`, in panel order: what each counts (cumulated from metrics.jsonl up to each
# held-out evaluation) and the metric a run must have logged for the axis to exist.
X_AXES = {
    "wall_clock_s": ("training wall-clock (s)", "sum of step_seconds"),
    "nfe": ("full-precision denoiser evaluations per prompt", "sum of nfe"),
    "all_nfe": ("all denoiser evaluations per prompt", "sum of nfe + low-precision explore_nfe"),
    "env_steps": ("environment steps", "policy and expert, the trainer's env_steps count"),
    "step": ("training steps", "logged step"),  # only when the runs logged none of the above
}
# Student t quantile 0.975 for 1..30 degrees of freedom (two-sided 95% interval of a mean).
T_975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)  # fmt: skip
STD_BAND_FROM = 3  # seeds from which the band is mean +- std (fewer: min-max)


def t_975(df: float) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom: the table up to 30, beyond it
    the Cornish-Fisher expansion around the normal quantile (within 1e-4 of the exact value). Between
    whole degrees (Welch's interval has them) it is linear in 1/df, never below the exact quantile,
    so an interval is never too narrow, and within 0.4% of it from 3 degrees."""
    if df < 1:
        raise ValueError(f"t quantile needs at least 1 degree of freedom, got {df}")
    if df <= len(T_975):
        low, high = math.floor(df), math.ceil(df)
        if low == high:
            return T_975[low - 1]
        share = (1 / low - 1 / df) / (1 / low - 1 / high)
        return T_975[low - 1] + share * (T_975[high - 1] - T_975[low - 1])
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci95(mean: float, std: float, n: int) -> list[float]:
    """The t-based 95% interval of a mean over `n` >= 2 values with sample standard deviation `std`."""
    half = t_975(n - 1) * std / math.sqrt(n)
    return [mean - half, mean + half]


@dataclass
class Curve:
    """A finished run's metric at each point compared (held out: before training, every `eval_every`
    steps and after; training: every step that logged it), the training step of each, and the x value
    of each on every axis the run logged."""

    run: Path
    steps: list[float]
    values: list[float]
    x: dict[str, list[float]]
    explore: bool = False  # the run logged low-precision exploration (explore_nfe)

    def add_point(self, step: float, value: float, totals: dict[str, float]) -> None:
        self.steps.append(step)
        self.values.append(value)
        for axis, total in totals.items():
            self.x[axis].append(total)


def _metric_value(run: Path, metric: str, raw: Any, where: str) -> float:
    number = metric_number(raw)
    if number is None:
        raise ConfigError(f"{str(run)!r}: {metric!r} in {where} is {raw!r}, not a number")
    return number


def _walk_metrics(rows: list[dict]) -> tuple[list[str], list[tuple[float, dict, dict[str, float]]]]:
    """The x axes the rows logged, and per row (its step, the row, each axis's total up to and with
    it): wall-clock, nfe and explore_nfe summed over the rows, env_steps the trainer's cumulative
    count as logged, and the step itself."""
    logged = {key for row in rows for key, item in row.items() if metric_number(item) is not None}
    axes = [
        axis
        for axis, needs in (
            ("wall_clock_s", {"step_seconds"}),
            ("nfe", {"nfe"}),
            ("all_nfe", {"nfe", "explore_nfe"}),
            ("env_steps", {"env_steps"}),
        )
        if needs & logged
    ] + ["step"]
    totals = dict.fromkeys(axes, 0.0)
    walked = []
    for index, row in enumerate(rows):
        step = metric_number(row.get("step"))
        step = float(index + 1) if step is None else step
        seconds, nfe = metric_number(row.get("step_seconds")) or 0.0, metric_number(row.get("nfe")) or 0.0
        if "wall_clock_s" in totals:
            totals["wall_clock_s"] += seconds
        if "nfe" in totals:
            totals["nfe"] += nfe
        if "all_nfe" in totals:
            totals["all_nfe"] += nfe + (metric_number(row.get("explore_nfe")) or 0.0)
        if "env_steps" in totals and metric_number(row.get("env_steps")) is not None:
            totals["env_steps"] = float(row["env_steps"])
        totals["step"] = step
        walked.append((step, row, dict(totals)))
    return axes, walked


def _explored(rows: list[dict]) -> bool:
    return any(metric_number(row.get("explore_nfe")) is not None for row in rows)


def read_evals(run: Path) -> dict[str, Any]:
    """A run's eval.json ({} without one); ConfigError naming the file when it is not a JSON object or
    its "before" or "after" is not an object of metrics."""
    path = run / "eval.json"
    if not path.is_file():
        return {}
    fix = "a finished run writes it whole: copy it again from where the run ran, or leave the run out"
    evals = read_json_object(path, fix)
    for moment in ("before", "after"):
        if moment in evals and not isinstance(evals[moment], dict):
            raise ConfigError(
                f"{str(path)!r}: {moment!r} is {evals[moment]!r}, not an object of held-out metrics: {fix}"
            )
    return evals


def held_out_curve(run: Path, metric: str) -> Curve:
    """The held-out `metric` curve of a finished run; FileNotFoundError when the run has not finished."""
    rows = read_metric_rows(run)
    evals = read_evals(run)
    if not rows or any(metric not in (evals.get(key) or {}) for key in ("before", "after")):
        raise FileNotFoundError(
            f"{str(run)!r} has no finished run with held-out {metric!r} (metrics.jsonl and eval.json "
            "with before/after); train it to the end first"
        )
    axes, walked = _walk_metrics(rows)
    curve = Curve(run, [], [], {axis: [] for axis in axes}, explore=_explored(rows))
    curve.add_point(
        0.0, _metric_value(run, metric, evals["before"][metric], "eval.json before"), dict.fromkeys(axes, 0.0)
    )
    for step, row, totals in walked[:-1]:  # an evaluation at the last step is eval.json's "after"
        if f"eval_{metric}" in row:
            curve.add_point(
                step,
                _metric_value(run, metric, row[f"eval_{metric}"], f"metrics.jsonl step {step:g}"),
                totals,
            )
    step, _, totals = walked[-1]
    curve.add_point(step, _metric_value(run, metric, evals["after"][metric], "eval.json after"), totals)
    return curve


def training_curve(run: Path, metric: str) -> Curve:
    """`metric` as the run's training steps logged it in metrics.jsonl (a robot run's rollout success,
    say), at every step that has it; FileNotFoundError when the run logged no step."""
    rows = read_metric_rows(run)
    if not rows:
        raise FileNotFoundError(f"{str(run)!r} has no metrics.jsonl with training steps; train it first")
    axes, walked = _walk_metrics(rows)
    curve = Curve(run, [], [], {axis: [] for axis in axes}, explore=_explored(rows))
    for step, row, totals in walked:
        if metric in row:
            curve.add_point(
                step, _metric_value(run, metric, row[metric], f"metrics.jsonl step {step:g}"), totals
            )
    if not curve.steps:
        names = sorted({key for row in rows for key, item in row.items() if metric_number(item) is not None})
        raise ConfigError(
            f"{str(run)!r}: no training step logged {metric!r}; its metrics.jsonl has: {', '.join(names)}"
        )
    return curve


def _stats(values: list[float]) -> dict[str, float | None]:
    """Mean, sample standard deviation (n - 1; None for one seed), min and max."""
    import statistics

    finite = all(math.isfinite(v) for v in values)
    mean = statistics.fmean(values) if finite else math.fsum(values) / len(values)
    std = None
    if len(values) > 1:  # statistics.stdev is exact on floats, so equal seeds give exactly 0
        std = statistics.stdev(values) if finite else math.nan
    return {"mean": mean, "std": std, "min": min(values), "max": max(values)}


def _finite_json(value: Any) -> Any:
    """JSON has no NaN or infinity: written as the strings metrics.jsonl uses for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(v) for v in value]
    return value


def method_summary(label: str, curves: list[Curve], seeds: list[Any], axes: list[str]) -> dict:
    """A method's numbers: per evaluation point the step, the mean over seeds of each x, and the
    metric's mean, std, min, max and per-seed values; the final point's mean with a t-based 95%
    interval over seeds (None for one seed)."""
    n = len(curves)
    have = [axis for axis in axes if all(axis in c.x for c in curves)]
    points = []
    for i, step in enumerate(curves[0].steps):
        values = [c.values[i] for c in curves]
        x = {axis: sum(c.x[axis][i] for c in curves) / n for axis in have}
        step = int(step) if step.is_integer() else step
        points.append({"step": step, "x": x, **_stats(values), "values": values})
    last = points[-1]
    final: dict[str, Any] = {"step": last["step"], "n": n, "mean": last["mean"], "std": last["std"]}
    if n > 1:
        final.update(t=t_975(n - 1), ci95=mean_ci95(last["mean"], last["std"], n))
    else:
        final.update(t=None, ci95=None)
    band = None if n == 1 else "mean +- std" if n >= STD_BAND_FROM else "min-max"
    return {
        "label": label,
        "n": n,
        "runs": [str(c.run) for c in curves],
        "seeds": seeds,
        "band": band,
        "points": points,
        "final": final,
    }


def _steps_text(steps: list[float]) -> str:
    return "[" + ", ".join(f"{step:g}" for step in steps) + "]"


def _legend(method: dict) -> str:
    band = {None: "", "min-max": ", band min-max", "mean +- std": ", band mean ± std"}[method["band"]]
    return f"{method['label']} (n={method['n']}{band})"


def warn_mixed_launches(runs: list[Path]) -> None:
    """Step seconds compare only between launches on the same kind of device with the same numbers of
    processes and CPU threads: warn when the recorded launches (``launches.jsonl``) of the runs differ."""
    made_with: dict[tuple, list[str]] = {}
    for run in runs:
        for launch in read_launches(run):
            setting = tuple(launch.get(key) for key in ("device", "processes", "cpu_threads"))
            made_with.setdefault(setting, []).append(str(run))
    if len(made_with) > 1:
        kinds = "; ".join(
            f"device {device}, {processes} process(es), {threads} CPU thread(s): "
            + ", ".join(dict.fromkeys(where))
            for (device, processes, threads), where in made_with.items()
        )
        warnings.warn(
            f"the runs were launched with different settings ({kinds}), so their wall-clock is compared "
            "only roughly (launches.jsonl in each run directory)",
            stacklevel=3,
        )


def compare_runs(
    run_dirs: list[str | Path],
    metric: str,
    out: str | Path,
    labels: list[str] | None = None,
    seed_keys: list[str] | None = None,
    training: bool = False,
) -> Path:
    """One PNG comparing methods by held-out `metric` (before, every `eval_every` steps, after), or
    with `training` by `metric` as every training step logged it, and its numbers in
    ``<png stem>.json`` beside it.

    Runs whose config.yaml is the same but for `NOT_METHOD_KEYS` (and `seed_keys`, such as the base
    each seed fine-tunes) are seeds of one method, drawn once: the
    mean over seeds with a band (min-max for two seeds, mean +- std from three), labelled by
    `method_labels` or `labels` (one per method, in the order their first run is given) and n. Seeds
    must have the metric at the same steps. Panels, one per x axis some run logged (`X_AXES`): training
    wall-clock, full-precision denoiser evaluations, all denoiser evaluations (when a run explored
    in low precision), environment steps; training steps when none was logged. X values are means
    over seeds. Everything is checked before anything is written."""
    out = check_plot_path(out)
    numbers = out.with_suffix(".json")
    if numbers.is_dir():
        raise ConfigError(f"--compare {str(out)!r}: its numbers go to {str(numbers)!r}, which is a directory")
    runs = distinct_runs(run_dirs)
    curves = [(training_curve if training else held_out_curve)(run, metric) for run in runs]
    members, seeds = group_methods(runs, seed_keys)
    for indices in members:
        first = curves[indices[0]]
        for i in indices[1:]:
            if curves[i].steps != first.steps:
                raise ConfigError(
                    f"runs {str(first.run)!r} and {str(curves[i].run)!r} have the same config (seeds of "
                    f"one method) but {metric!r} at different steps: "
                    f"{_steps_text(first.steps)} and {_steps_text(curves[i].steps)}; "
                    "train the seeds to the same steps" + ("" if training else " with the same eval_every")
                )
        repeated = [
            i for i in indices if seeds[i] is not None and [seeds[j] for j in indices].count(seeds[i]) > 1
        ]
        if repeated:
            warnings.warn(
                f"runs {', '.join(str(runs[i]) for i in repeated)} have the same config and the same seed; "
                "each counts as a seed of the method",
                stacklevel=2,
            )
    auto = chosen_labels(runs, members, labels)

    axes = [axis for axis in ("wall_clock_s", "nfe") if any(axis in c.x for c in curves)]
    if any(c.explore for c in curves):
        axes.append("all_nfe")
    axes += ["env_steps"] if any("env_steps" in c.x for c in curves) else []
    axes = axes or ["step"]
    if "wall_clock_s" in axes:
        warn_mixed_launches(runs)
    methods = [
        method_summary(label, [curves[i] for i in indices], [seeds[i] for i in indices], axes)
        for label, indices in zip(auto, members, strict=True)
    ]

    several = any(m["n"] > 1 for m in methods)
    fig, panels = plt.subplots(1, len(axes), figsize=(5 * len(axes), 3.8), squeeze=False)
    for ax, axis in zip(panels[0], axes, strict=True):
        for color, method in enumerate(methods):
            if axis not in method["points"][0]["x"]:
                continue  # this method did not log the axis (a robot run in an NFE panel, say)
            xs = [p["x"][axis] for p in method["points"]]
            means = [p["mean"] for p in method["points"]]
            ax.plot(xs, means, marker="o", ms=3, color=f"C{color}", label=_legend(method))
            if method["band"] == "min-max":
                low, high = [p["min"] for p in method["points"]], [p["max"] for p in method["points"]]
            elif method["band"] == "mean +- std":
                low = [p["mean"] - p["std"] for p in method["points"]]
                high = [p["mean"] + p["std"] for p in method["points"]]
            else:
                continue
            ax.fill_between(xs, low, high, color=f"C{color}", alpha=0.2, linewidth=0)
        name, detail = X_AXES[axis]
        ax.set_xlabel(
            f"{name}\n({detail}{', mean over seeds' if several and axis != 'step' else ''})", fontsize=8
        )
        ax.set_ylabel(f"{metric} (training steps)" if training else f"held-out {metric}")
        ax.grid(alpha=0.3)
    panels[0][-1].legend(fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    record = {
        "metric": metric,
        "source": "training steps (metrics.jsonl)" if training else "held-out evaluations",
        "plot": str(out),
        "x_axes": {axis: ": ".join(X_AXES[axis]) for axis in axes},
        "notes": {
            "x": "mean over seeds of each run's x at the evaluation",
            "std": "sample standard deviation over seeds (n - 1); null for one seed",
            "band": f"min-max below {STD_BAND_FROM} seeds, mean +- std from {STD_BAND_FROM}",
            "ci95": "final mean +- t(0.975, n - 1) * std / sqrt(n); null for one seed",
        },
        "methods": methods,
    }
    numbers.write_text(json.dumps(_finite_json(record), indent=1) + "\n")
    return out
