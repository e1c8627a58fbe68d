"""`mmrl report RUN_DIR`: one self-contained HTML page per run (curves, evaluations, media, config).

The page inlines everything (PNG/GIF/video data URIs, CSS) so it can be mailed, archived or opened
on a machine without the run directory or network access. Embedded media are capped so that a long
run with thousands of sample grids still gives a page a browser opens quickly; what was left out is
listed by name. The curves are drawn by `mmrl.report_curves`.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
from pathlib import Path
from typing import Any

from mmrl.report_curves import constant_metrics, metric_curves
from mmrl.runlog import METRICS_FILE, check_run_dir, metric_number, read_launches, read_metric_rows

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp")
VIDEO_SUFFIXES = (".mp4", ".webm")
MIME = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".gif": "image/gif",
    ".webp": "image/webp",
    ".mp4": "video/mp4",
    ".webm": "video/webm",
}
# Directories of a run that hold model state or other tools' output, never samples to show (with
# `final-before-step-N/`, an earlier result set aside when a run continues past it).
SKIPPED_DIRS = {"checkpoints", "tensorboard", "wandb", "final", "__pycache__"}
SKIPPED_PREFIXES = (".", "final-before-step-")
MAX_IMAGES = 48  # sample images embedded (spread over the run when there are more)
MAX_VIDEOS = 8  # GIFs and videos embedded
MAX_FILE_BYTES = 8 * 2**20  # one media file larger than this is listed, not embedded
MAX_MEDIA_BYTES = 32 * 2**20  # all embedded media together
MAX_JSON_BYTES = 2 * 2**20  # JSON records larger than this are named, not rendered
MAX_TABLE_ROWS = 200

STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1400px;padding:0 1em;color:#222}
h1{font-size:1.4em;word-break:break-all} h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
h3{font-size:1.05em;margin:1.2em 0 .4em} h4,h5,h6{font-size:.95em;margin:.8em 0 .3em}
table{border-collapse:collapse;margin:.3em 0 .8em;font-size:.9em}
td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;vertical-align:top}
td.num{text-align:right;font-variant-numeric:tabular-nums} th{background:#f4f4f4}
.curves img{max-width:100%;display:block;margin:.2em 0 1em}
.grid{display:flex;flex-wrap:wrap;gap:8px} figure{margin:0;max-width:100%}
figure img,figure video{max-width:100%;image-rendering:pixelated;border:1px solid #eee}
figure.sample img{min-width:160px} figcaption{font-size:.75em;color:#555;word-break:break-all;max-width:320px}
pre{background:#f7f7f7;padding:.8em;overflow:auto;font-size:.85em;max-height:40em}
.note{color:#555;font-size:.9em} .warn{background:#fff4e5;border:1px solid #f0b429;padding:.6em 1em}
details{margin:.4em 0}
"""


# ----------------------------------------------------------------------------------------- helpers


def _esc(value: object) -> str:
    return html.escape(str(value))


def _fmt(value: Any) -> str:
    """One table cell's text: floats to 4 significant digits, the rest as written."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _cell(value: Any) -> str:
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    return f"<td class='num'>{_esc(_fmt(value))}</td>" if numeric else f"<td>{_esc(_fmt(value))}</td>"


def _natural_key(path: Path) -> list[Any]:
    """Sort step_9 before step_10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def _data_uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 2**10:.0f} kB"


# ------------------------------------------------------------------------------------------ tables


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _short_list(values: list[Any], limit: int = 20) -> str:
    shown = ", ".join(_fmt(v) for v in values[:limit])
    more = f", … ({len(values) - limit} more)" if len(values) > limit else ""
    return f"[{shown}{more}]"


def _flatten(value: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts to dotted keys; lists of scalars to short text."""
    flat: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, dict):
            flat.update(_flatten(item, name + "."))
        elif isinstance(item, list):
            flat[name] = _short_list(item) if all(_is_scalar(v) for v in item) else f"({len(item)} items)"
        else:
            flat[name] = item
    return flat


def _table(header: list[str], rows: list[list[Any]], first_is_label: bool = True) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = []
    for row in rows[:MAX_TABLE_ROWS]:
        cells = [f"<th>{_esc(row[0])}</th>"] if first_is_label else [_cell(row[0])]
        body.append("<tr>" + "".join(cells + [_cell(v) for v in row[1:]]) + "</tr>")
    note = (
        f"<p class='note'>{len(rows) - MAX_TABLE_ROWS} more rows not shown.</p>"
        if len(rows) > MAX_TABLE_ROWS
        else ""
    )
    return f"<table><tr>{head}</tr>{''.join(body)}</table>{note}"


def _dict_of_dicts_table(value: dict[str, dict]) -> str | None:
    """A table of {row: {column: value}}, turned so that the longer side runs down the page."""
    flat = {str(k): _flatten(v) for k, v in value.items()}
    columns = list(dict.fromkeys(c for row in flat.values() for c in row))
    if not columns or min(len(columns), len(flat)) > 40:
        return None
    if len(flat) >= len(columns):
        return _table(["", *columns], [[k, *(row.get(c) for c in columns)] for k, row in flat.items()])
    return _table(["", *flat], [[c, *(row.get(c) for row in flat.values())] for c in columns])


def json_html(value: Any, depth: int = 0) -> str:
    """Any JSON value as HTML tables: scalars in a key/value table, {name: {metric: value}} as one
    table, lists of records as a table with a row per record, deeper levels under sub-headings."""
    if _is_scalar(value):
        return f"<p>{_esc(_fmt(value))}</p>"
    if isinstance(value, list):
        if all(_is_scalar(v) for v in value):
            return f"<p>{_esc(_short_list(value, 100))}</p>"
        if all(isinstance(v, dict) for v in value):
            flat = [_flatten(v) for v in value]
            columns = list(dict.fromkeys(c for row in flat for c in row))
            return _table(["#", *columns], [[i, *(r.get(c) for c in columns)] for i, r in enumerate(flat)])
        return "".join(json_html(v, depth + 1) for v in value[:MAX_TABLE_ROWS])
    if depth > 5:
        return f"<pre>{_esc(json.dumps(value, indent=1)[:20000])}</pre>"
    if value and all(isinstance(v, dict) for v in value.values()):
        table = _dict_of_dicts_table(value)
        if table is not None:
            return table
    leaves = {
        k: v for k, v in value.items() if _is_scalar(v) or isinstance(v, list) and all(map(_is_scalar, v))
    }
    parts = []
    if leaves:
        rows = [[k, _short_list(v) if isinstance(v, list) else v] for k, v in leaves.items()]
        parts.append(_table(["key", "value"], rows))
    heading = f"h{min(4 + depth, 6)}"
    for key, item in value.items():
        if key not in leaves:
            parts.append(f"<{heading}>{_esc(key)}</{heading}>" + json_html(item, depth + 1))
    return "".join(parts) or "<p class='note'>(empty)</p>"


def eval_table(evals: dict[str, Any]) -> str:
    """eval.json ({"before": {...}, "after": {...}, ...}): a row per metric, a column per moment, and
    the change after - before where both are numbers."""
    if not evals or not all(isinstance(v, dict) for v in evals.values()):
        return json_html(evals)
    moments = list(evals)
    metrics = list(dict.fromkeys(m for v in evals.values() for m in _flatten(v)))
    flat = {k: _flatten(v) for k, v in evals.items()}
    delta = "before" in flat and "after" in flat
    head = "".join(f"<th>{_esc(m)}</th>" for m in moments) + ("<th>after − before</th>" if delta else "")
    body = []
    for metric in metrics:
        cells = "".join(_cell(flat[m].get(metric)) for m in moments)
        if delta:
            before, after = (
                metric_number(flat["before"].get(metric)),
                metric_number(flat["after"].get(metric)),
            )
            if before is not None and after is not None and not isinstance(flat["after"].get(metric), bool):
                cells += f"<td class='num'>{after - before:+.4g}</td>"
            else:
                cells += "<td></td>"
        body.append(f"<tr><th>{_esc(metric)}</th>{cells}</tr>")
    return f"<table><tr><th>metric</th>{head}</tr>{''.join(body)}</table>"


# ------------------------------------------------------------------------------------------- media


def _run_files(run: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files with these suffixes anywhere in the run directory, without walking into model state
    (checkpoints can be large trees) or hidden folders."""
    found = []
    for root, dirs, files in os.walk(run):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(SKIPPED_PREFIXES)]
        found += [Path(root, f) for f in files if f.lower().endswith(suffixes)]
    return sorted(found, key=_natural_key)


def _spread(paths: list[Path], limit: int) -> list[Path]:
    """At most `limit` paths evenly spread over the list, first and last kept (the start and end of
    training when samples are named by step)."""
    if len(paths) <= limit:
        return paths
    if limit == 1:
        return [paths[-1]]
    picks = sorted({round(i * (len(paths) - 1) / (limit - 1)) for i in range(limit)})
    return [paths[i] for i in picks]


def _is_animation(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_SUFFIXES or path.suffix.lower() == ".gif"


def media_html(run: Path) -> tuple[str, str]:
    """(samples section, videos/GIFs section) with the capped media inlined and the rest named."""
    files = _run_files(run, IMAGE_SUFFIXES + VIDEO_SUFFIXES)
    sections = []
    budget = MAX_MEDIA_BYTES
    for animated, limit in ((False, MAX_IMAGES), (True, MAX_VIDEOS)):
        group = [p for p in files if _is_animation(p) == animated]
        chosen = set(_spread(group, limit))
        parts, left_out = [], []
        for path in group:
            rel = str(path.relative_to(run))
            size = path.stat().st_size
            if path not in chosen:
                left_out.append(f"{rel} (over the limit of {limit})")
                continue
            if size > MAX_FILE_BYTES or size > budget:
                why = "file too large" if size > MAX_FILE_BYTES else "page size limit reached"
                left_out.append(f"{rel} ({_size(size)}, {why})")
                continue
            budget -= size
            uri = _data_uri(MIME[path.suffix.lower()], path.read_bytes())
            if path.suffix.lower() in VIDEO_SUFFIXES:
                element = f'<video controls loop muted src="{uri}"></video>'
            else:
                element = f'<img alt="{_esc(rel)}" src="{uri}">'
            css = "" if animated else " class='sample'"
            parts.append(f"<figure{css}>{element}<figcaption>{_esc(rel)}</figcaption></figure>")
        html_out = f"<div class='grid'>{''.join(parts)}</div>" if parts else ""
        if left_out:
            items = "".join(f"<li>{_esc(x)}</li>" for x in left_out[:MAX_TABLE_ROWS])
            if len(left_out) > MAX_TABLE_ROWS:
                items += f"<li>… and {len(left_out) - MAX_TABLE_ROWS} more</li>"
            html_out += (
                f"<details><summary class='note'>{len(left_out)} of {len(group)} files not embedded "
                f"(open them from the run directory)</summary><ul>{items}</ul></details>"
            )
        sections.append(html_out)
    return sections[0], sections[1]


# -------------------------------------------------------------------------------------------- page


def _read_json(path: Path) -> tuple[Any, str | None]:
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        return None, f"{path.name} is {_size(size)}; too large to show here"
    try:
        return json.loads(path.read_text()), None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return None, f"{path.name} is not valid JSON ({err})"


def _launch_text(launch: dict) -> str:
    return (
        f"from step {launch.get('from_step', '?')} at {launch.get('started_at', '?')}: "
        f"{launch.get('device', '?')}, {launch.get('processes', '?')} process(es), "
        f"{launch.get('cpu_threads', '?')} CPU thread(s), torch {launch.get('torch', '?')}"
    )


def _summary(run: Path, rows: list[dict]) -> str:
    facts: list[tuple[str, Any]] = []
    config_path = run / "config.yaml"
    if config_path.is_file():
        import yaml

        try:
            config = yaml.safe_load(config_path.read_text()) or {}
        except yaml.YAMLError:
            config = {}
        if isinstance(config, dict):
            facts += [
                (k, config[k])
                for k in ("trainer", "recipe", "seed", "steps")
                if k in config and _is_scalar(config[k])
            ]
    launches = read_launches(run)
    if launches:
        facts.append(("launches (launches.jsonl)", "; ".join(_launch_text(launch) for launch in launches)))
    if rows:
        facts.append(("logged steps", len(rows)))
        facts.append(("last step", rows[-1].get("step", "?")))
        seconds = sum(metric_number(r.get("step_seconds")) or 0.0 for r in rows)
        if seconds:
            facts.append(("training wall-clock (sum of step_seconds)", f"{seconds:.1f} s"))
    return _table(["", ""], [[k, v] for k, v in facts]) if facts else ""


def build_report(run_dir: str | Path) -> str:
    """The report page of a run directory as one HTML string."""
    run = check_run_dir(run_dir)
    rows = read_metric_rows(run)
    parts = [f"<h1>mmrl run: {_esc(run.resolve())}</h1>", _summary(run, rows)]

    stopped = run / "stopped.json"
    if stopped.is_file():
        record, problem = _read_json(stopped)
        parts.append(
            "<div class='warn'><b>This run stopped early</b> (stopped.json):"
            + (json_html(record) if problem is None else _esc(problem))
            + "</div>"
        )

    evals = []
    if (run / "eval.json").is_file():
        record, problem = _read_json(run / "eval.json")
        evals.append("<h3>eval.json</h3>" + (eval_table(record) if problem is None else _esc(problem)))
    for path in _run_files(run, (".json",)):
        if not path.name.startswith("eval_"):
            continue
        record, problem = _read_json(path)
        title = _esc(path.relative_to(run))
        evals.append(f"<h3>{title}</h3>" + (json_html(record) if problem is None else _esc(problem)))
    parts.append("<h2>Held-out evaluation</h2>")
    parts += evals or ["<p class='note'>No eval.json or eval_*.json in this directory.</p>"]

    parts.append(f"<h2>Training curves ({len(rows)} logged steps)</h2>")
    if rows:
        parts.append("<div class='curves'>")
        for group, names, uri in metric_curves(rows):
            parts.append(f"<h3>{_esc(group)}</h3><img alt='{_esc(', '.join(names))}' src='{uri}'>")
        parts.append("</div>")
        constant = constant_metrics(rows)
        if constant:
            parts.append("<h3>Unchanged through the run, or logged once</h3>")
            parts.append(_table(["metric", "value"], [[k, v] for k, v in constant.items()]))
    else:
        parts.append(f"<p class='note'>No {METRICS_FILE} (or it is empty).</p>")

    samples, videos = media_html(run)
    parts.append("<h2>Samples</h2>" + (samples or "<p class='note'>No images in this directory.</p>"))
    if videos:
        parts.append("<h2>Videos and animations</h2>" + videos)

    others = [
        p
        for p in sorted(run.glob("*.json"))
        if p.name not in ("eval.json", "stopped.json") and not p.name.startswith("eval_")
    ]
    if others:
        parts.append("<h2>Other records</h2>")
        for path in others:
            record, problem = _read_json(path)
            parts.append(
                f"<h3>{_esc(path.name)}</h3>" + (json_html(record) if problem is None else _esc(problem))
            )

    parts.append("<h2>Config</h2>")
    if (run / "config.yaml").is_file():
        parts.append(f"<pre>{_esc((run / 'config.yaml').read_text())}</pre>")
    else:
        parts.append("<p class='note'>No config.yaml (an evaluation directory, not a training run).</p>")

    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>mmrl report: {_esc(run.name)}</title><style>{STYLE}</style></head><body>"
        + "\n".join(parts)
        + "</body></html>\n"
    )


def write_report(run_dir: str | Path) -> Path:
    """Write ``RUN_DIR/report.html``; raise FileNotFoundError if RUN_DIR is not a run directory and
    ConfigError for a metrics.jsonl row whose step is not a number."""
    page = build_report(run_dir)
    out = Path(run_dir) / "report.html"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page)
    tmp.replace(out)  # a browser reloading the page never sees half of it
    return out
