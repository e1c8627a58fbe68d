"""`mmrl eval vlm`: a local VLM on published high-resolution benchmarks, read from local files in the
benchmarks' own formats (`vlm_rl.benchmark_files`), with the pixel tool on (`auto`, `always`) or off
(`never`), scored by `vlm_rl.scoring`.

Every row read is either scored or reported skipped (with its row number, line, id and reason); how
many were left out is printed beside the score and stored in ``eval_vlm.json``.

    mmrl eval vlm benchmark=data/hr_bench_4k.tsv model=runs/pretrain/vlm/model "modes=[auto,never]"
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm.auto import tqdm

from mmrl.config import (
    ConfigError,
    apply_overrides,
    build,
    check_device,
    check_output_dir,
    option,
    shipped_path,
)
from mmrl.registry import EVALUATORS
from vlm_rl.benchmark_files import load_benchmark
from vlm_rl.benchmark_rows import EXPECTED, FORMATS, IMAGE_ERRORS, BenchmarkRow, SkippedRow
from vlm_rl.config import DEFAULT_MODEL, TOOL_MODES, ToolRolloutConfig
from vlm_rl.loading import load
from vlm_rl.models import ImageSizeError, VLMAdapter
from vlm_rl.rollout import rollout
from vlm_rl.scoring import Outcome, RowResult, extract_choice, score_results
from vlm_rl.tasks import OPTION_LETTERS

GROUP_ROWS_PRINTED = 20  # a grouping with more values than this is left to the JSON
SKIPPED_PRINTED = 20
SHOWN_CHARS = 400  # model output kept per prediction


def _load_image(row: BenchmarkRow) -> Image.Image:
    image = row.question.image
    image.load()
    return image


def run_benchmark(
    adapter: VLMAdapter,
    rows: Sequence[BenchmarkRow],
    cfg: ToolRolloutConfig,
    modes: Sequence[str],
    batch_size: int = 16,
    progress: bool = True,
) -> tuple[list[RowResult], list[SkippedRow]]:
    """Greedy rollouts of every row under every mode, a batch at a time (each image decoded once per
    batch and shared by the modes). Rows whose prompt cannot be built, whose image does not decode or
    whose image the model's processor cannot resize (`ImageSizeError`: one side over 200 times the
    other, for Qwen2-VL) are returned as skipped, not scored."""
    results: list[RowResult] = []
    skipped: list[SkippedRow] = []
    askable = []
    for row in rows:
        if len(row.question.options) > len(OPTION_LETTERS):
            reason = f"{len(row.question.options)} options: at most {len(OPTION_LETTERS)} can be lettered"
            skipped.append(SkippedRow(row.row, row.id, reason, row.line))
            continue
        askable.append(row)
    bar = tqdm(total=len(askable) * len(modes), desc="eval vlm", disable=not progress, unit="rollout")
    for start in range(0, len(askable), batch_size):
        batch, images = [], []
        for row in askable[start : start + batch_size]:
            try:
                image = _load_image(row)
                adapter.resized_size(image)  # refused here, the batch's other rows go on
            except ImageSizeError as err:
                skipped.append(SkippedRow(row.row, row.id, str(err), row.line))
                continue
            except IMAGE_ERRORS as err:
                reason = f"image fails to decode ({type(err).__name__}: {err})"
                skipped.append(SkippedRow(row.row, row.id, reason, row.line))
                continue
            batch.append(row)
            images.append(image)
        questions = [
            dataclasses.replace(row.question, load_image=lambda image=image: image)
            for row, image in zip(batch, images, strict=True)
        ]
        outcomes: list[dict[str, Outcome]] = [{} for _ in batch]
        for mode in modes:
            trajectories = rollout(adapter, questions, cfg, keys=None, tool_mode=mode)  # type: ignore[arg-type]
            for per_row, trajectory, question in zip(outcomes, trajectories, questions, strict=True):
                predicted = (
                    extract_choice(trajectory.answer_text, question.options)
                    if trajectory.ended == "answer"
                    else None
                )
                per_row[mode] = Outcome(
                    predicted,
                    predicted == question.answer,
                    trajectory.used_tool,
                    trajectory.tool_stats,
                    trajectory.turns,
                    trajectory.generated_tokens,
                    trajectory.ended,
                    trajectory.answer_text[-SHOWN_CHARS:],
                )
            bar.update(len(batch))
        results += [RowResult(row, per_row) for row, per_row in zip(batch, outcomes, strict=True)]
    bar.close()
    skipped.sort(key=lambda s: s.row)
    return results, skipped


@dataclass
class VLMEvalConfig:
    benchmark: str = option("", "benchmark file or folder (V*, HR-Bench TSV, MME-RealWorld JSON, a jsonl)")
    format: str = option("auto", "how to read it; auto picks by the path", choices=FORMATS)
    image_root: str | None = option(
        None, "folder image paths are relative to (default: the benchmark's folder)"
    )
    model: str | None = option(
        None, "local VLM checkpoint (default: the shipped tiny model, vlm_rl/assets/tiny_vlm)"
    )
    modes: list[str] = option(
        ["auto", "never"], "tool modes: auto (as trained), always, never", choices=TOOL_MODES
    )
    limit: int | None = option(None, "read only the first N rows (skipped ones count)", min=1)
    batch_size: int = option(16, "conversations generated together", min=1)
    shuffle_options: bool = option(
        True, "V* folder form: shuffle options (the files put the right one first)"
    )
    seed: int = option(0, "seed of the V* option shuffle", min=0)
    device: str = option("auto", "auto (cuda when available), cpu, cuda, cuda:1, ...")
    progress: bool = option(True, "show a progress bar")
    output_dir: str = option("runs/eval/vlm", "where eval_vlm.json and eval_vlm_predictions.jsonl go")
    rollout: ToolRolloutConfig = field(default_factory=ToolRolloutConfig)


def resolve_model(model: str | None) -> Path:
    return shipped_path(model or DEFAULT_MODEL)


def load_model(path: Path, device: str) -> VLMAdapter:
    """The checkpoint at `path` on `device` (one `check_device` resolved), in eval mode."""
    try:
        adapter = load(path)
    except (FileNotFoundError, OSError, ValueError) as err:
        raise ConfigError(
            f"config error: model = {str(path)!r} cannot be loaded: {err}; give model= a local checkpoint "
            "folder (config.json, weights, tokenizer, preprocessor_config.json) or run `mmrl pretrain vlm`"
        ) from None
    adapter.to(device)
    adapter.model.eval()
    return adapter


def _finite(value: Any) -> Any:
    """NaN (e.g. accuracy with the tool when no row used it) becomes null: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def evaluate_vlm(cfg: VLMEvalConfig) -> dict[str, Any]:
    """Load the benchmark (reporting its bad rows), then the model; roll out every mode; write
    ``eval_vlm.json`` and ``eval_vlm_predictions.jsonl`` under `output_dir`; return the results."""
    if not cfg.benchmark:
        expected = "; ".join(f"{name}: {text}" for name, text in EXPECTED.items())
        raise ConfigError(f"config error: benchmark is empty; pass benchmark=PATH, one of: {expected}")
    if not cfg.modes:
        raise ConfigError(f"config error: modes is empty; choose from {', '.join(TOOL_MODES)}")
    # checked before the benchmark and the model are read, so that a bad value fails at once
    device = check_device(cfg.device, "device")
    out = check_output_dir(cfg.output_dir, "output_dir")
    bench = load_benchmark(
        cfg.benchmark, cfg.format, cfg.image_root, cfg.limit, cfg.shuffle_options, cfg.seed
    )
    print_skipped(bench.skipped, "at load")
    model_path = resolve_model(cfg.model)
    adapter = load_model(model_path, device)
    modes = list(dict.fromkeys(cfg.modes))
    results, late = run_benchmark(adapter, bench.rows, cfg.rollout, modes, cfg.batch_size, cfg.progress)
    print_skipped(late, "while evaluating")
    skipped = sorted(bench.skipped + late, key=lambda s: s.row)
    if not results:
        raise ConfigError(
            f"config error: no row of {cfg.benchmark!r} could be evaluated ({len(skipped)} skipped; first: "
            f"{skipped[0] if skipped else 'none read'}); expected {EXPECTED[bench.format]}"
        )
    report: dict[str, Any] = {
        "benchmark": str(bench.path),
        "format": bench.format,
        "scoring": bench.scoring,
        "model": str(model_path),
        "modes": modes,
        "limit": cfg.limit,
        "rows_read": bench.rows_read,
        "scored": len(results),
        "skipped": len(skipped),
        "skipped_rows": [dataclasses.asdict(s) for s in skipped],
        "rollout": dataclasses.asdict(cfg.rollout),
        "results": score_results(results, modes, bench.scoring),
    }
    out.mkdir(parents=True, exist_ok=True)  # checked before the model ran, made only now
    (out / "eval_vlm.json").write_text(json.dumps(_finite(report), indent=1))
    with (out / "eval_vlm_predictions.jsonl").open("w") as file:
        for result in results:
            for mode, o in result.outcomes.items():
                line = {
                    "row": result.row.row,
                    "id": result.row.id,
                    "mode": mode,
                    "answer": result.row.question.answer,
                    "predicted": o.predicted,
                    "correct": o.correct,
                    "tool_calls": o.tool_stats.calls,
                    "ended": o.ended,
                    "output": o.output,
                    **result.row.groups,
                }
                file.write(json.dumps(line) + "\n")
    return report


def print_skipped(skipped: Sequence[SkippedRow], when: str) -> None:
    for item in skipped[:SKIPPED_PRINTED]:
        print(f"skipped {when}: {item}", file=sys.stderr)
    if len(skipped) > SKIPPED_PRINTED:
        print(
            f"... and {len(skipped) - SKIPPED_PRINTED} more skipped {when} (all in eval_vlm.json)",
            file=sys.stderr,
        )


def _number(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_table(report: dict[str, Any]) -> str:
    """The scores per mode, then a table per grouping (category, cycle, ...) and HR-Bench's cycles."""
    rule = (
        "accuracy per cycle_category, averaged (HR-Bench)" if report["scoring"] == "hrbench" else "accuracy"
    )
    lines = [
        f"{report['benchmark']} ({report['format']}); model {report['model']}; score: {rule}",
        f"rows: {report['rows_read']} read, {report['skipped']} skipped, {report['scored']} scored"
        + (" (skipped rows with reasons: eval_vlm.json)" if report["skipped"] else ""),
        f"{'mode':<8}{'score':>8}{'accuracy':>10}{'unanswered':>12}{'tool use':>10}{'calls':>7}"
        f"{'tool errors':>13}{'acc tool':>10}{'acc no tool':>13}",
    ]
    results = report["results"]
    for mode, r in results.items():
        lines.append(
            f"{mode:<8}{_number(r['score']):>8}{_number(r['accuracy']):>10}{r['unanswered']:>12}"
            f"{_number(r['tool_ratio'], '.3f'):>10}{r['tool_calls']:>7}{r['tool_errors']:>13}"
            f"{_number(r['accuracy_with_tool'], '.3f'):>10}{_number(r['accuracy_without_tool'], '.3f'):>13}"
        )
    for mode, r in results.items():
        ended = ", ".join(f"{reason} {count}" for reason, count in sorted(r["ended"].items()))
        lines.append(f"{mode}: rollouts ended by {ended}")
    first = next(iter(results.values()))
    for key, table in first["groups"].items():
        if len(table) > GROUP_ROWS_PRINTED:
            lines.append(f"per {key}: {len(table)} values (see eval_vlm.json)")
            continue
        width = max(len(key), *(len(value) for value in table)) + 2
        header = f"  {key:<{width}}{'n':>6}" + "".join(
            f"{mode + ' acc':>12}{'unans':>7}{'tool':>7}" for mode in results
        )
        lines += [f"per {key}:", header]
        for value in table:
            cells = "".join(
                f"{_number(results[mode]['groups'][key][value]['accuracy']):>12}"
                f"{results[mode]['groups'][key][value]['unanswered']:>7}"
                f"{_number(results[mode]['groups'][key][value]['tool_ratio'], '.2f'):>7}"
                for mode in results
            )
            lines.append(f"  {value:<{width}}{table[value]['n']:>6}{cells}")
    if report["scoring"] == "hrbench":
        for mode, r in results.items():
            average = r["hrbench"]["average"]
            lines.append(
                f"HR-Bench ({mode}), cycle average: "
                + ", ".join(f"{k} {_number(v)}" for k, v in average.items())
            )
    return "\n".join(lines)


@EVALUATORS.register("vlm")
def eval_vlm(overrides: list[str]) -> dict[str, Any]:
    """`mmrl eval vlm benchmark=PATH [model=DIR] [modes=[auto,never]] [limit=N] ...`"""
    cfg = build(VLMEvalConfig, apply_overrides({}, overrides))
    report = evaluate_vlm(cfg)
    print(format_table(report))
    return report
