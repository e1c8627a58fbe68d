"""`mmrl bench all`: every registered bench in one run, their side-by-side ratios in one table.

Benches return rows of their own shapes; this module reads the common convention from them: a row
holds one or more side-by-side ratios, the key ``ratio`` (with optional ``target``, ``target_op`` and
``verdict``) or a key ``<stem>_ratio`` that comes with a ``<stem>_target`` key (None when there is no
target; optional ``<stem>_target_op`` and ``<stem>_verdict``), so that other fractions such as a
``tool_ratio`` are not taken for ratios. ``target_op`` is ``"<="`` (the default) or ``">="``. A ratio
with a target but no verdict gets one computed from the target; rows without a ratio (plain timings)
stay in the JSON but not in the table. A bench that raises (a missing optional extra, no
model on disk, ...) becomes one ERROR row with the reason, and the others still run.

Options reach benches from the command line: ``mmrl bench NAME key=value ...`` passes keyword
arguments to that bench (checked against its signature), and ``mmrl bench all core.repeats=1
vla.steps=20 only=[core,vla] output=runs/bench/all.json`` passes each bench its own section.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import sys
import time
import typing
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mmrl.config import ConfigError, build, check_output_dir, option
from mmrl.registry import BENCHES, closest

DEFAULT_OUTPUT = "runs/bench/all.json"
LABEL_KEYS = ("section", "name", "variant", "case")  # joined into a row's label, in this order
DETAIL_KEYS = ("shape", "size", "input")  # appended to the label when present


def print_table(title: str, header: list[str], lines: list[list[str]]) -> None:
    """A rich table when rich is installed, else plain text with aligned columns."""
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        widths = [max(len(cell) for cell in column) for column in zip(header, *lines, strict=True)]
        print(title)
        for line in [header, *lines]:
            print("  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)))
        return
    table = Table(title=title)
    for column in header:  # a cell too wide for a terminal folds onto more lines, never loses text
        table.add_column(column, justify="right", overflow="fold")
    for line in lines:
        table.add_row(*map(escape, line))  # "[nfe_ratio]" is text, not a style tag
    # in a log or a pipe, as wide as the table: every row on one line
    widths = [max(len(cell) for cell in column) for column in zip(header, *lines, strict=True)]
    Console(width=None if sys.stdout.isatty() else max(sum(widths) + 3 * len(widths) + 1, 80)).print(table)


def bench_kwargs(fn: Callable[..., Any], data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Keyword arguments for bench `fn` from parsed ``key=value`` overrides, checked like a config:
    unknown keys, wrong types and bad values fail before any work with the key named. Keys beyond
    the named parameters pass through only when `fn` takes ``**kwargs``."""
    signature = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    fields, takes_any = [], False
    for name, param in signature.parameters.items():
        if param.kind is param.VAR_KEYWORD:
            takes_any = True
        elif param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            default = None if param.default is param.empty else param.default
            fields.append((name, hints.get(name, Any), option(default)))
    cls = dataclasses.make_dataclass(f"{getattr(fn, '__name__', 'bench')}_options", fields)
    named = {f[0] for f in fields}
    extra = {k: v for k, v in data.items() if k not in named} if takes_any else {}
    own = {k: v for k, v in data.items() if k not in extra}
    if prefix:  # a section of a wider config: nest it, so errors name (and suggest) the dotted key
        section = prefix.rstrip(".")
        outer = dataclasses.make_dataclass(
            "options", [(section, cls, dataclasses.field(default_factory=cls))]
        )
        checked = getattr(build(outer, {section: own}), section)
    else:
        checked = build(cls, own)
    return {**{k: v for k, v in vars(checked).items() if k in data}, **extra}


def check_counts(**counts: int) -> None:
    """A bench's count options (repeats, steps, ...) at least 1, else a ConfigError naming the key,
    raised before any work: a count of 0 would time nothing and fail later on an empty median."""
    for key, value in counts.items():
        if value < 1:
            raise ConfigError(f"config error: {key} = {value}: must be at least 1")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _label(row: dict[str, Any]) -> str:
    parts = [str(row[key]) for key in LABEL_KEYS if row.get(key) not in (None, "")]
    for key in DETAIL_KEYS:
        value = row.get(key)
        if isinstance(value, list | tuple):
            parts.append("x".join(map(str, value)))
        elif value not in (None, ""):
            parts.append(str(value))
    return " ".join(parts) or "-"


def ratio_rows(bench: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ratios of one bench's rows in the common form: bench, row, ratio, target, verdict."""
    out = []
    for row in rows:
        label = _label(row)
        keys = [k for k in row if k == "ratio" or (k.endswith("_ratio") and f"{k[:-5]}target" in row)]
        for key in keys:
            ratio = _number(row[key])
            if ratio is None:
                continue
            stem = key[: -len("ratio")]
            target = _number(row.get(f"{stem}target"))
            op = row.get(f"{stem}target_op") or "<="
            verdict = row.get(f"{stem}verdict")
            if not verdict:
                if target is None or not math.isfinite(ratio):
                    verdict = "-"
                else:
                    verdict = "PASS" if (ratio <= target if op == "<=" else ratio >= target) else "FAIL"
            out.append(
                {
                    "bench": bench,
                    "row": label if key == "ratio" else f"{label} [{key}]",
                    "ratio": ratio,
                    "target": None if target is None else f"{op} {target:g}x",
                    "verdict": str(verdict),
                }
            )
    return out


def jsonable(value: Any) -> Any:
    """Rows may hold tuples, devices, numpy scalars: keep numbers and strings, stringify the rest."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if hasattr(value, "item"):
        try:
            return jsonable(value.item())
        except (TypeError, ValueError):
            pass
    return str(value)


@BENCHES.register("all")
def bench_all(
    output: str = DEFAULT_OUTPUT,
    only: list[str] | None = None,
    skip: list[str] | None = None,
    **options: dict,
) -> list[dict[str, Any]]:
    """Run every registered bench but this one (or those in `only`, minus `skip`), each with its
    section of `options` (e.g. ``core={"repeats": 1}``); print one table of all their ratios and
    write it, with every bench's raw rows, to `output` as JSON. Returns the table's rows."""
    registry = BENCHES
    names = [name for name in registry.names() if name != "all" and registry.get(name) is not bench_all]

    def unknown(name: str) -> str:
        hint = closest(str(name), names)
        return f"unknown bench {name!r}: choose from {', '.join(names)}" + (
            f"; did you mean {hint!r}?" if hint else ""
        )

    for key, chosen in (("only", only or []), ("skip", skip or [])):
        for name in chosen:
            if name not in names:
                raise ConfigError(f"config error: {key}: {unknown(name)}")
    for name, section in options.items():
        if name not in names:
            raise ConfigError(
                f"config error: unknown key {name!r}: options are output, only, skip, or a section "
                f"per bench; {unknown(name)}"
            )
        if not isinstance(section, dict):
            raise ConfigError(f"config error: {name} = {section!r} must be a section, e.g. {name}.repeats=1")
    check_output_dir(Path(output).parent, "output (its folder)")
    if Path(output).is_dir():
        raise ConfigError(
            f"config error: output = {output!r} is a directory: give a file path, e.g. {DEFAULT_OUTPUT}"
        )
    if Path(output).exists():
        raise ConfigError(
            f"config error: output = {output!r} exists already (an earlier bench's results?): give another "
            "output=PATH, or move that file away"
        )
    selected = [n for n in names if (only is None or n in only) and n not in (skip or [])]
    kwargs = {name: bench_kwargs(registry.get(name), options.get(name, {}), f"{name}.") for name in selected}

    table: list[dict[str, Any]] = []
    report: dict[str, Any] = {}
    for name in selected:
        print(f"\n=== mmrl bench {name} ===", flush=True)
        start = time.perf_counter()
        try:
            rows = registry.get(name)(**kwargs[name])
        except Exception as err:  # one broken bench must not hide the others' numbers
            reason = f"{type(err).__name__}: {err}".splitlines()[0]
            print(f"bench {name} failed: {reason}", flush=True)
            report[name] = {"status": "failed", "error": reason, "seconds": time.perf_counter() - start}
            failed = {"bench": name, "row": "(bench failed)", "ratio": None, "target": None}
            table.append({**failed, "verdict": f"ERROR: {reason}"})
            continue
        found = ratio_rows(name, list(rows or []))
        report[name] = {
            "status": "ok",
            "seconds": time.perf_counter() - start,
            "options": kwargs[name],
            "rows": list(rows or []),
        }
        table += found or [
            {"bench": name, "row": "(no ratios)", "ratio": None, "target": None, "verdict": "-"}
        ]

    print()
    print_table(
        "mmrl bench all: side-by-side ratios (ours / baseline)",
        ["bench", "row", "ratio", "target", "verdict"],
        [
            [
                row["bench"],
                row["row"],
                "-" if row["ratio"] is None else f"{row['ratio']:.3f}x",
                row["target"] or "-",
                row["verdict"],
            ]
            for row in table
        ],
    )
    verdicts = [row["verdict"].split(":")[0] for row in table]
    summary = {v: verdicts.count(v) for v in ("PASS", "FAIL", "ERROR")}
    print(
        f"{summary['PASS']} PASS, {summary['FAIL']} FAIL, {summary['ERROR']} ERROR; "
        f"{len(table) - sum(summary.values())} without a target"
    )
    path = Path(output)
    document = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "summary": summary,
        "ratios": table,
        "benches": report,
    }
    path.parent.mkdir(parents=True, exist_ok=True)  # checked before the benches ran, made only now
    path.write_text(json.dumps(jsonable(document), indent=1))
    print(f"wrote {path}")
    return table
