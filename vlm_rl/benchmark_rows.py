"""What every benchmark format reads into: rows to ask, rows skipped with the reason, and the checks
and line reading the formats share (`vlm_rl.benchmark_files` reads the formats)."""

from __future__ import annotations

import codecs
import re
import string
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from PIL import Image

from vlm_rl.data import Question
from vlm_rl.question_jsonl import IMAGE_ERRORS as IMAGE_ERRORS  # the formats check images with it

# the formats `vlm_rl.benchmark_files.load_benchmark` reads, and what each looks like (for messages)
FORMATS = ("auto", "vstar", "vstar_jsonl", "tsv", "mme_realworld", "jsonl")
EXPECTED = {
    "vstar": "a V* Bench folder: direct_attributes/ and relative_position/, each image with a same-named "
    ".json holding question and options (the right one first)",
    "vstar_jsonl": "V* Bench test_questions.jsonl: one JSON object per line with question_id, image, text "
    "(the question and '(A) ...' option lines), category and label (the right letter)",
    "tsv": "a VLMEvalKit/HR-Bench TSV: a header with index, question, answer, A, B, ... (or one "
    "'multi-choice options' column of '(A) ...' lines, as MME-RealWorld's) and image (base64), "
    "optionally category, l2-category and cycle_category",
    "mme_realworld": "MME-RealWorld JSON: a list of objects with Question_id, Image, Text, "
    "'Answer choices' ['(A) ...', ...], 'Ground truth', Task, Subtask, Category",
    "jsonl": "the project's jsonl: question_id, image, question, options, answer (a letter)",
}

Scoring = Literal["accuracy", "hrbench"]


class RowError(ValueError):
    """Why one benchmark row cannot be asked; the row is skipped and reported, the rest go on."""


@dataclass
class BenchmarkRow:
    """A question of a benchmark, where it came from and the groups it is scored in."""

    row: int  # 0-based position among the rows read (data lines, objects or question files)
    id: str  # the benchmark's own id (index / question_id / path)
    question: Question
    groups: dict[str, str] = field(default_factory=dict)  # e.g. {"category": "single", "cycle_category": "2"}
    line: int | None = None  # TSV and jsonl: the file line (from 1) the row starts on


@dataclass
class SkippedRow:
    """A row left out of the score: where it is and why it cannot be asked."""

    row: int
    id: str | None
    reason: str
    line: int | None = None

    def __str__(self) -> str:
        name = f"row {self.row}" + (f" ({self.id})" if self.id not in (None, "") else "")
        return f"{name}{'' if self.line is None else f', line {self.line}'}: {self.reason}"


@dataclass
class Benchmark:
    """A benchmark file read: the rows to ask, the rows skipped, and how its score is computed."""

    path: Path
    format: str
    rows: list[BenchmarkRow]
    skipped: list[SkippedRow]
    scoring: Scoring = "accuracy"

    @property
    def rows_read(self) -> int:
        return len(self.rows) + len(self.skipped)


def make_question(
    text: str, options: Sequence[str], answer: str, load_image: Callable[[], Image.Image], category: str = ""
) -> Question:
    """A Question after the checks every format shares: some options, none empty, answer among them."""
    if not text.strip():
        raise RowError("no question text")
    if len(options) < 2:
        raise RowError(f"needs at least 2 options, got {list(options)!r}")
    if len(options) > 26:
        raise RowError(f"{len(options)} options: at most 26 (A-Z)")
    if any(not option.strip() for option in options):
        raise RowError(f"an option is empty: {list(options)!r}")
    letters = string.ascii_uppercase[: len(options)]
    answer = answer.strip().upper()
    if len(answer) != 1 or answer not in letters:
        raise RowError(f"answer {answer!r} is not one of the option letters {letters}")
    return Question(text.strip(), tuple(o.strip() for o in options), answer, load_image, "", category)


_OPTION_MARK = re.compile(r"(?:^|(?<=\s))\(([A-Z])\)[ \t]*")


def split_options(text: str) -> tuple[str, list[str]]:
    """V* jsonl ``text`` (or MME-RealWorld's options column) -> (question, options): the options are
    the run of ``(A) ...``, ``(B) ...`` marks in order; the line after the last option (the answering
    instruction) is dropped."""
    marks = []
    for mark in _OPTION_MARK.finditer(text):
        if mark.group(1) == string.ascii_uppercase[len(marks)]:
            marks.append(mark)
            if len(marks) == 26:
                break
    if len(marks) < 2:
        raise RowError("no options '(A) ...', '(B) ...' in the text")
    options = []
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        chunk = text[mark.end() : end]
        options.append((chunk.split("\n", 1)[0] if i + 1 == len(marks) else chunk).strip())
    return text[: marks[0].start()].strip(), options


def read_lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(line number from 1, byte offset, bytes with the line end) of every line split at b"\\n"; a
    UTF-8 BOM at the start of the file is not part of the first line."""
    with path.open("rb") as file:
        offset = 0
        for number, line in enumerate(file, 1):
            bom = len(codecs.BOM_UTF8) if number == 1 and line.startswith(codecs.BOM_UTF8) else 0
            yield number, offset + bom, line[bom:]
            offset += len(line)


def utf8_text(raw: bytes) -> str:
    """A row's bytes as text; RowError when they are not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RowError(f"not UTF-8 text ({err})") from None
