"""The project's benchmark jsonl: one multiple-choice question per line plus an images folder.

`write_benchmark` writes tiny-task examples in it; `read_benchmark` / `read_row` read it back, for
training on a question file (`data.source`) and for `mmrl eval vlm` (format ``jsonl``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from vlm_rl.tasks import Box, ZoomExample

# what PIL raises for a file or bytes that are not an image it can read
IMAGE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


@dataclass(frozen=True)
class MCQuestion:
    """One row of a multiple-choice benchmark; the image is read from disk on access."""

    question_id: str
    image_path: Path
    question: str
    options: tuple[str, ...]
    answer: str  # a letter
    category: str = ""
    needs_zoom: bool | None = None
    target_box: Box | None = None

    @property
    def image(self) -> Image.Image:
        with Image.open(self.image_path) as image:
            return image.convert("RGB")


def write_benchmark(
    examples: Sequence[ZoomExample], out_dir: Path | str, name: str = "questions.jsonl"
) -> Path:
    """Write `out_dir/name` (one JSON row per example) and `out_dir/images/<id>.png`; returns the jsonl."""
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    with path.open("w") as file:
        for example in examples:
            relative = f"images/{example.id}.png"
            example.image.save(out_dir / relative)
            row = {
                "question_id": example.id,
                "image": relative,
                "question": example.question,
                "options": list(example.options),
                "answer": example.answer,
                "category": example.category,
                "needs_zoom": example.needs_zoom,
                "target_box": list(example.target_box),
            }
            file.write(json.dumps(row) + "\n")
    return path


def read_benchmark(path: Path | str) -> list[MCQuestion]:
    """Every row of a benchmark jsonl (blank lines skipped); the first bad row raises ValueError.

    To skip bad rows instead, call `read_row` on each line and catch its ValueError.
    """
    path = Path(path)
    lines = path.read_text().splitlines()
    return [read_row(line, index, path.parent) for index, line in enumerate(lines) if line.strip()]


def read_row(line: str, index: int, root: Path | str) -> MCQuestion:
    """One jsonl row (`index` counts lines from 0; image paths are relative to `root`); ValueError
    naming the row and what is wrong with it."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"row {index}: not valid JSON ({error})") from None
    if not isinstance(row, dict):
        raise ValueError(f"row {index}: expected a JSON object, got {type(row).__name__}")
    where = f"row {index} (question_id={row.get('question_id')!r})"
    for key in ("question_id", "image", "question", "options", "answer"):
        if row.get(key) in (None, "", []):
            raise ValueError(f"{where}: no {key!r}")
    for key in ("image", "question", "answer"):
        if not isinstance(row[key], str):
            raise ValueError(f"{where}: {key!r} must be a string, got {row[key]!r}")
    options = row["options"]
    strings = isinstance(options, list) and all(isinstance(option, str) for option in options)
    if not strings or not 2 <= len(options) <= 26:
        raise ValueError(f"{where}: 'options' must be a list of 2-26 strings, got {options!r}")
    letters = "".join(chr(ord("A") + i) for i in range(len(options)))
    if len(row["answer"]) != 1 or row["answer"] not in letters:
        raise ValueError(f"{where}: answer {row['answer']!r} is not one of the letters {letters}")
    if row.get("needs_zoom") not in (None, True, False):
        raise ValueError(f"{where}: 'needs_zoom' must be true, false or null, got {row['needs_zoom']!r}")
    try:  # links followed: a row must not make training open ../../etc/passwd or a link out
        image_path = (Path(root) / row["image"]).resolve()
        inside = image_path.is_relative_to(Path(root).resolve())
    except (OSError, RuntimeError) as err:
        raise ValueError(f"{where}: image {row['image']!r} cannot be resolved ({err})") from None
    if not inside:
        raise ValueError(f"{where}: image {row['image']!r} leads outside {str(root)!r}; refused")
    if not image_path.is_file():
        raise ValueError(f"{where}: image {row['image']!r} not found at {image_path}")
    return MCQuestion(
        question_id=str(row["question_id"]),
        image_path=image_path,
        question=row["question"],
        options=tuple(options),
        answer=row["answer"],
        category=str(row.get("category", "")),
        needs_zoom=row.get("needs_zoom"),
        target_box=_read_box(row.get("target_box"), where),
    )


def _read_box(value: Any, where: str) -> Box | None:
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 4 and all(isinstance(v, int | float) for v in value)):
        raise ValueError(f"{where}: 'target_box' must be a list of 4 numbers, got {value!r}")
    x1, y1, x2, y2 = (float(v) for v in value)
    if not (0 <= x1 < x2 <= 1 and 0 <= y1 < y2 <= 1):
        raise ValueError(
            f"{where}: 'target_box' must satisfy 0 <= x1 < x2 <= 1 and 0 <= y1 < y2 <= 1, got {value}"
        )
    return (x1, y1, x2, y2)
