"""`mmrl report RUN_DIR`: one self-contained HTML page with metric curves, evaluations and samples."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mmrl.runlog import read_metrics  # noqa: E402

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif")


def _png_data_uri(fig: plt.Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def metric_curves(rows: list[dict]) -> list[tuple[str, str]]:
    """(metric name, PNG data URI) for every numeric metric in the log."""
    names = sorted({k for row in rows for k, v in row.items() if k != "step" and isinstance(v, int | float)})
    curves = []
    for name in names:
        points = [(row["step"], row[name]) for row in rows if isinstance(row.get(name), int | float)]
        fig, ax = plt.subplots(figsize=(4.2, 2.6))
        ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.2)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        curves.append((name, _png_data_uri(fig)))
    return curves


def write_report(run_dir: str | Path) -> Path:
    """Write ``RUN_DIR/report.html``; raise FileNotFoundError if RUN_DIR is not a run directory."""
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise FileNotFoundError(
            f"{str(run)!r} is not a run directory (no config.yaml); give the output_dir of a run"
        )
    rows = read_metrics(run)
    parts = [f"<h1>mmrl run: {html.escape(str(run))}</h1>"]
    eval_path = run / "eval.json"
    if eval_path.is_file():
        evals = json.loads(eval_path.read_text())
        metrics = sorted({m for v in evals.values() for m in v})
        header = "".join(f"<th>{html.escape(k)}</th>" for k in evals)
        body = "".join(
            f"<tr><td>{html.escape(m)}</td>"
            + "".join(
                f"<td>{evals[k].get(m, ''):.4g}</td>"
                if isinstance(evals[k].get(m), float)
                else f"<td>{evals[k].get(m, '')}</td>"
                for k in evals
            )
            + "</tr>"
            for m in metrics
        )
        parts.append(f"<h2>Held-out evaluation</h2><table><tr><th>metric</th>{header}</tr>{body}</table>")
    parts.append(f"<h2>Training curves ({len(rows)} logged steps)</h2>")
    parts += [f'<img alt="{html.escape(n)}" src="{uri}">' for n, uri in metric_curves(rows)]
    images = (
        sorted(p for p in (run / "samples").rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        if (run / "samples").is_dir()
        else []
    )
    if images:
        parts.append("<h2>Samples</h2><div class='grid'>")
        for image in images[-64:]:
            mime = "jpeg" if image.suffix.lower() in (".jpg", ".jpeg") else image.suffix.lower()[1:]
            data = base64.b64encode(image.read_bytes()).decode()
            parts.append(
                f'<figure><img src="data:image/{mime};base64,{data}">'
                f"<figcaption>{html.escape(str(image.relative_to(run)))}</figcaption></figure>"
            )
        parts.append("</div>")
    config_text = html.escape((run / "config.yaml").read_text())
    parts.append(f"<h2>Config</h2><pre>{config_text}</pre>")
    style = (
        "body{font-family:sans-serif;margin:2em} table{border-collapse:collapse} td,th{border:1px solid #ccc;"
        "padding:3px 8px} .grid{display:flex;flex-wrap:wrap} figure{margin:4px} figure img{width:128px}"
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><style>{style}</style></head><body>"
        + "\n".join(parts)
        + "</body></html>"
    )
    out = run / "report.html"
    out.write_text(page)
    return out


def compare_runs(run_dirs: list[str | Path], metric: str, out: str | Path) -> Path:
    """One PNG comparing runs: held-out `metric` (before, every `eval_every` steps, after) against
    training wall-clock (sum of `step_seconds`) and against model evaluations (sum of `nfe` plus
    `explore_nfe`, per prompt). Raise FileNotFoundError / KeyError naming what is missing."""
    fig, (by_time, by_nfe) = plt.subplots(1, 2, figsize=(10, 3.8))
    for run_dir in run_dirs:
        run = Path(run_dir)
        rows = read_metrics(run) if (run / "metrics.jsonl").is_file() else []
        evals = json.loads((run / "eval.json").read_text()) if (run / "eval.json").is_file() else {}
        if not rows or metric not in evals.get("after", {}):
            raise FileNotFoundError(
                f"{str(run)!r} has no finished run with held-out {metric!r} (metrics.jsonl and eval.json "
                "with before/after); train it to the end first"
            )
        seconds, nfe, points = 0.0, 0.0, [(0.0, 0.0, evals["before"][metric])]
        for row in rows:
            seconds += float(row.get("step_seconds", 0.0))
            nfe += float(row.get("nfe", 0.0)) + float(row.get("explore_nfe", 0.0))
            if f"eval_{metric}" in row:
                points.append((seconds, nfe, float(row[f"eval_{metric}"])))
        points.append((seconds, nfe, evals["after"][metric]))
        label = run.name
        by_time.plot([p[0] for p in points], [p[2] for p in points], marker="o", ms=3, label=label)
        by_nfe.plot([p[1] for p in points], [p[2] for p in points], marker="o", ms=3, label=label)
    by_time.set_xlabel("training wall-clock (s)")
    by_nfe.set_xlabel("denoiser evaluations per prompt (rollouts)")
    for ax in (by_time, by_nfe):
        ax.set_ylabel(f"held-out {metric}")
        ax.grid(alpha=0.3)
    by_nfe.legend(fontsize=8)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out
