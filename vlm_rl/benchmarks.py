"""`mmrl eval vlm`: a local VLM on published high-resolution benchmarks, read from local files in the
benchmarks' own formats, with the pixel tool on (`auto`, `always`) or off (`never`).

Formats (`format=auto` picks one from the path):

- ``vstar`` -- V* Bench, folder form: ``ROOT/direct_attributes/`` and ``ROOT/relative_position/``,
  every image beside a same-named ``.json`` holding ``question``, ``options`` (the right one first,
  as the V* evaluation scores it), ``target_object`` and ``bbox``. The options are shuffled per
  question (seeded by the question's path) so that the right letter is not always A.
- ``vstar_jsonl`` -- V* Bench, ``test_questions.jsonl``: rows ``{question_id, image, text, category,
  label}``, ``text`` being the question, one ``(A) ...`` line per option and an instruction line. A
  folder that holds ``test_questions.jsonl`` is read this way (it is the lettering papers report on).
- ``tsv`` -- the VLMEvalKit multiple-choice TSV of HR-Bench 4K/8K (and of other benchmarks): a header
  ``index, question, answer, category, A, B, C, D, ..., image`` with the image as base64 (or the
  ``index`` of an earlier row holding the same image). With a ``cycle_category`` column the score is
  HR-Bench's: accuracy within each cycle (the same questions with their options rotated), averaged
  over the cycles. MME-RealWorld's TSV (options as one ``multi-choice options`` column of ``(A) ...``
  lines; ``category``, ``l2-category``) reads the same way. Rows are located at load time and their
  images decoded only when asked, so a multi-gigabyte file is never held in memory.
- ``mme_realworld`` -- MME-RealWorld's JSON list of ``{Question_id, Image, Text, Answer choices
  ["(A) ...", ...], Ground truth, Task, Subtask, Category}``, image paths relative to ``image_root``.
- ``jsonl`` -- the project's own jsonl of multiple-choice questions (`vlm_rl.tasks.read_row`).

Every row read is either scored or reported skipped: a row that cannot be asked fairly (malformed,
not UTF-8, missing image, an image path that leads outside the benchmark's folder, bad base64, an
image that does not decode, no options, a gold answer that is not an option) is reported with its
row number, line, id and reason and left out of the score; how many were left out is printed beside
the score and stored. A row of a TSV or jsonl is a line (blank lines are not rows); a TSV field in
quotes may run over line ends, as pandas writes a field holding a line break, but a stray quote never
swallows the rows after it. Only a whole-file problem (no such path, a TSV header without a needed
column, an MME-RealWorld file that is not a JSON list, an unreadable file) stops with ConfigError.
Answers are read by rules (`extract_choice`), never by a model; an output naming no option counts as
wrong and is counted separately as unanswered.

    mmrl eval vlm benchmark=data/hr_bench_4k.tsv model=runs/pretrain/vlm/model "modes=[auto,never]"
"""

from __future__ import annotations

import ast
import base64
import binascii
import codecs
import csv
import dataclasses
import io
import json
import math
import random
import re
import string
import sys
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

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
from mmrl.rewards import extract_answer
from vlm_rl.data import Question
from vlm_rl.models import VLMAdapter
from vlm_rl.rollout import TOOL_MODES, ToolRolloutConfig, rollout, rollout_metrics
from vlm_rl.tasks import OPTION_LETTERS, read_row
from vlm_rl.tools import ToolStats

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
VSTAR_CATEGORIES = ("direct_attributes", "relative_position")
VSTAR_JSONL = "test_questions.jsonl"
MULTI_CHOICE = "multi-choice options"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
GROUP_ROWS_PRINTED = 20  # a grouping with more values than this is left to the JSON
SKIPPED_PRINTED = 20
SHOWN_CHARS = 400  # model output kept per prediction
TSV_RECORD_LINES = 1000  # the most lines one quoted TSV field may span
IMAGE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)

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
    row: int
    id: str | None
    reason: str
    line: int | None = None

    def __str__(self) -> str:
        name = f"row {self.row}" + (f" ({self.id})" if self.id not in (None, "") else "")
        return f"{name}{'' if self.line is None else f', line {self.line}'}: {self.reason}"


@dataclass
class Benchmark:
    path: Path
    format: str
    rows: list[BenchmarkRow]
    skipped: list[SkippedRow]
    scoring: Scoring = "accuracy"

    @property
    def rows_read(self) -> int:
        return len(self.rows) + len(self.skipped)


# ---------------------------------------------------------------------------------------------
# Loading


def load_benchmark(
    path: str | Path,
    format: str = "auto",
    image_root: str | Path | None = None,
    limit: int | None = None,
    shuffle_options: bool = True,
    seed: int = 0,
) -> Benchmark:
    """The first `limit` rows of a benchmark file or folder; rows that cannot be asked are in `skipped`.

    A missing path, an unknown layout or a file that is not the format at all (no header, not a JSON
    list) raises ConfigError naming the path and the expected format; a bad row never does."""
    path = Path(path)
    if format not in FORMATS:
        raise ConfigError(f"config error: format = {format!r}: choose one of {', '.join(FORMATS)}")
    if not path.exists():
        expected = "; ".join(f"{name}: {text}" for name, text in EXPECTED.items())
        raise ConfigError(
            f"config error: benchmark {str(path)!r} does not exist; expected one of: {expected}"
        )
    fmt = detect_format(path) if format == "auto" else format
    if fmt == "vstar_jsonl" and path.is_dir():
        path = path / VSTAR_JSONL
    needs_dir = fmt == "vstar"
    if not path.exists() or needs_dir != path.is_dir():
        kind = "an existing folder" if needs_dir else "an existing file"
        raise ConfigError(
            f"config error: benchmark {str(path)!r} is not {kind}; format {fmt} expects {EXPECTED[fmt]}"
        )
    if image_root is not None and not Path(image_root).is_dir():
        raise ConfigError(f"config error: image_root = {str(image_root)!r} is not an existing folder")
    root = Path(image_root) if image_root is not None else (path if path.is_dir() else path.parent)
    try:
        if fmt == "vstar":
            return _load_vstar_folder(path, limit, shuffle_options, seed)
        if fmt == "vstar_jsonl":
            return _load_vstar_jsonl(path, root, limit)
        if fmt == "tsv":
            return _load_tsv(path, limit)
        if fmt == "mme_realworld":
            return _load_mme_realworld(path, root, limit)
        return _load_project_jsonl(path, root, limit)
    except OSError as err:  # the file or folder itself (a row's own files are that row's skip)
        raise ConfigError(f"config error: benchmark {str(path)!r} cannot be read ({err})") from None


def detect_format(path: Path) -> str:
    """The format a path most likely holds: by folder layout, suffix, or a jsonl's first row's keys."""
    if path.is_dir():
        if (path / VSTAR_JSONL).is_file():
            return "vstar_jsonl"
        if any((path / category).is_dir() for category in VSTAR_CATEGORIES):
            return "vstar"
        raise ConfigError(
            f"config error: benchmark folder {str(path)!r} holds neither {VSTAR_JSONL} nor "
            f"{' / '.join(VSTAR_CATEGORIES)}/; expected {EXPECTED['vstar']}, or give a file"
        )
    suffix = path.suffix.lower()
    if suffix == ".tsv":
        return "tsv"
    if suffix == ".json":
        return "mme_realworld"
    if suffix == ".jsonl":
        try:
            first = next((raw for _, _, raw in _lines(path) if raw.strip()), b"")
            keys = _parse_json(first.decode("utf-8", errors="replace"))
        except OSError as err:
            raise ConfigError(f"config error: benchmark {str(path)!r} cannot be read ({err})") from None
        except RowError:
            keys = {}
        return "vstar_jsonl" if isinstance(keys, dict) and {"text", "label"} <= keys.keys() else "jsonl"
    raise ConfigError(
        f"config error: cannot tell the format of {str(path)!r} from its name; pass format= one of "
        f"{', '.join(FORMATS[1:])}"
    )


def _file_image(path: Path) -> Callable[[], Image.Image]:
    def load() -> Image.Image:
        with Image.open(path) as image:
            return image.convert("RGB")

    return load


def _question(
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


def _inside(root: Path, path: Path) -> Path:
    """`path` with its links followed, or a RowError if that leads outside `root`: a benchmark file
    must not make the evaluator open ``../../etc/passwd``, an absolute path elsewhere, or a link out."""
    try:
        resolved, base = path.resolve(), root.resolve()
    except (OSError, ValueError, RuntimeError) as err:  # a NUL byte, a link loop
        raise RowError(f"path {str(path)!r} cannot be resolved ({err})") from None
    if not resolved.is_relative_to(base):
        raise RowError(f"path {str(path)!r} leads outside {str(base)!r} (to {str(resolved)!r}); refused")
    return resolved


def _image_file(root: Path, relative: Any) -> Path:
    if not isinstance(relative, str) or not relative.strip():
        raise RowError(f"no image path (got {relative!r})")
    path = _inside(root, root / relative)
    if not path.is_file():
        raise RowError(f"image {relative!r} not found at {path}")
    return path


def _read_json_file(path: Path) -> Any:
    """A whole JSON file (a UTF-8 BOM allowed); RowError saying why it cannot be read."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise RowError(f"{path.name} is not UTF-8 text ({err})") from None
    except OSError as err:
        raise RowError(f"{path.name} cannot be read ({err})") from None
    return _parse_json(text, path.name)


def _parse_json(text: str, what: str = "the line") -> Any:
    """json.loads with every way it fails (bad syntax, a number too long, nesting too deep) a RowError."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:
        raise RowError(f"{what} is not valid JSON ({type(err).__name__}: {err})") from None


def _load_vstar_folder(root: Path, limit: int | None, shuffle: bool, seed: int) -> Benchmark:
    """One row per name in the category folders that has an image or a ``.json`` (or both)."""
    folders = [root / category for category in VSTAR_CATEGORIES if (root / category).is_dir()]
    if not folders:
        raise ConfigError(f"config error: {str(root)!r} is not {EXPECTED['vstar']}")
    rows: list[BenchmarkRow] = []
    skipped: list[SkippedRow] = []
    images: dict[tuple[str, str], list[Path]] = defaultdict(list)
    notes: dict[tuple[str, str], Path] = {}
    for folder in folders:
        for file in folder.iterdir():
            if file.suffix.lower() == ".json":
                notes[folder.name, file.stem] = file
            elif file.suffix.lower() in IMAGE_SUFFIXES:
                images[folder.name, file.stem].append(file)
    keys = sorted(images.keys() | notes.keys(), key=lambda k: (VSTAR_CATEGORIES.index(k[0]), k[1]))
    for index, (category, stem) in enumerate(keys[:limit]):
        qid = f"{category}/{stem}"
        try:
            found, annotation = sorted(images.get((category, stem), [])), notes.get((category, stem))
            if annotation is None:
                raise RowError(f"image without its annotation {stem}.json")
            if not found:
                raise RowError(f"annotation without an image {stem}.jpg beside it")
            if len(found) > 1:
                raise RowError(f"{len(found)} images for one annotation: {[f.name for f in found]}")
            image = _inside(root, found[0])
            if not image.is_file():
                raise RowError(f"{found[0].name} is not a file")
            data = _read_json_file(_inside(root, annotation))
            if not isinstance(data, dict):
                raise RowError(f"{annotation.name} must hold a JSON object")
            options, text = data.get("options"), data.get("question")
            if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
                raise RowError(f"'options' must be a list of strings, got {options!r}")
            if not isinstance(text, str):
                raise RowError(f"'question' must be a string, got {text!r}")
            order = list(range(len(options)))
            if shuffle:  # options[0] is the right one in the files
                random.Random(f"{seed}/{qid}").shuffle(order)
            shown = [options[i] for i in order]
            answer = string.ascii_uppercase[order.index(0)] if order else ""
            question = _question(text, shown, answer, _file_image(image), category)
            rows.append(BenchmarkRow(index, qid, question, {"category": category}))
        except RowError as err:
            skipped.append(SkippedRow(index, qid, str(err)))
    return Benchmark(root, "vstar", rows, skipped)


_OPTION_MARK = re.compile(r"(?:^|(?<=\s))\(([A-Z])\)[ \t]*")


def split_options(text: str) -> tuple[str, list[str]]:
    """V* jsonl ``text`` -> (question, options): the options are the run of ``(A) ...``, ``(B) ...``
    marks in order; the line after the last option (the answering instruction) is dropped."""
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


def _lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(line number from 1, byte offset, bytes with the line end) of every line split at b"\\n"; a
    UTF-8 BOM at the start of the file is not part of the first line."""
    with path.open("rb") as file:
        offset = 0
        for number, line in enumerate(file, 1):
            bom = len(codecs.BOM_UTF8) if number == 1 and line.startswith(codecs.BOM_UTF8) else 0
            yield number, offset + bom, line[bom:]
            offset += len(line)


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RowError(f"not UTF-8 text ({err})") from None


def _json_lines(path: Path, limit: int | None) -> Iterator[tuple[int, int, str | RowError]]:
    """(row, line number, the line's text or the RowError saying why it has none) for the first
    `limit` non-blank lines."""
    row = 0
    for number, _, raw in _lines(path):
        if not raw or raw.isspace():
            continue
        if limit is not None and row >= limit:
            return
        try:
            text: str | RowError = _utf8(raw)
        except RowError as err:
            text = err
        yield row, number, text
        row += 1


def _load_vstar_jsonl(path: Path, root: Path, limit: int | None) -> Benchmark:
    rows: list[BenchmarkRow] = []
    skipped: list[SkippedRow] = []
    for index, number, line in _json_lines(path, limit):
        qid = None
        try:
            if isinstance(line, RowError):
                raise line
            item = _parse_json(line)
            if not isinstance(item, dict):
                raise RowError(f"expected a JSON object, got {type(item).__name__}")
            qid = str(item.get("question_id", ""))
            text = item.get("text")
            if not isinstance(text, str):
                raise RowError(f"no 'text' (got {text!r})")
            question, options = split_options(text)
            image = _image_file(root, item.get("image"))
            category = str(item.get("category") or "")
            label = item.get("label")
            if not isinstance(label, str):
                raise RowError(f"no 'label' letter (got {label!r})")
            rows.append(
                BenchmarkRow(
                    index,
                    qid or str(index),
                    _question(question, options, label, _file_image(image), category),
                    {"category": category} if category else {},
                    number,
                )
            )
        except RowError as err:
            skipped.append(SkippedRow(index, qid, str(err), number))
    return Benchmark(path, "vstar_jsonl", rows, skipped)


def _mme_category(task: str, subtask: str, category: str) -> str:
    """MME-RealWorld's own grouping: categories lower-cased, every '.../attribute...' one merged."""
    category = category.lower()
    if "attribute" in category:
        category = category.split("/")[0] + "/attribute"
    return f"{task}/{subtask}/{category}"


_LABEL = re.compile(r"\s*\(([A-Za-z])\)\s*(.*)", re.DOTALL)


def _load_mme_realworld(path: Path, root: Path, limit: int | None) -> Benchmark:
    try:
        data = _read_json_file(path)
    except RowError as err:
        raise ConfigError(
            f"config error: benchmark {str(path)!r}: {err}; expected {EXPECTED['mme_realworld']}"
        ) from None
    if not isinstance(data, list):
        raise ConfigError(
            f"config error: benchmark {str(path)!r} holds a {type(data).__name__}, not a list; "
            f"expected {EXPECTED['mme_realworld']}"
        )
    rows: list[BenchmarkRow] = []
    skipped: list[SkippedRow] = []
    for index, item in enumerate(data[:limit]):
        qid = str(item.get("Question_id", "")) if isinstance(item, dict) else None
        try:
            if not isinstance(item, dict):
                raise RowError(f"expected a JSON object, got {type(item).__name__}")
            choices = item.get("Answer choices")
            if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
                raise RowError(f"'Answer choices' must be a list of strings, got {choices!r}")
            options = []
            for letter, choice in zip(string.ascii_uppercase, choices, strict=False):
                label = _LABEL.fullmatch(choice)
                options.append(label.group(2) if label and label.group(1).upper() == letter else choice)
            text, truth = item.get("Text"), item.get("Ground truth")
            if not isinstance(text, str) or not isinstance(truth, str):
                raise RowError(f"'Text' and 'Ground truth' must be strings, got {text!r} and {truth!r}")
            image = _image_file(root, item.get("Image"))
            task, subtask = str(item.get("Task", "")), str(item.get("Subtask", ""))
            category = _mme_category(task, subtask, str(item.get("Category", "")))
            groups = {"task": task, "subtask": f"{task}/{subtask}", "category": category}
            rows.append(
                BenchmarkRow(
                    index,
                    qid or str(index),
                    _question(text, options, truth, _file_image(image), category),
                    groups,
                )
            )
        except RowError as err:
            skipped.append(SkippedRow(index, qid, str(err)))
    return Benchmark(path, "mme_realworld", rows, skipped)


def _load_project_jsonl(path: Path, root: Path, limit: int | None) -> Benchmark:
    rows: list[BenchmarkRow] = []
    skipped: list[SkippedRow] = []
    for index, number, line in _json_lines(path, limit):
        qid = None
        try:
            if isinstance(line, RowError):
                raise line
            parsed = _parse_json(line)  # read_row reads it again, but only catches bad syntax
            if isinstance(parsed, dict):
                qid = None if parsed.get("question_id") is None else str(parsed["question_id"])
                if isinstance(parsed.get("image"), str):
                    _inside(root, root / parsed["image"])  # before read_row looks for the file
            item = read_row(line, index, root)
            question = _question(
                item.question, item.options, item.answer, _file_image(item.image_path), item.category
            )
        except ValueError as err:  # RowError, and read_row's messages, which already name the row
            message = re.sub(r"^row \d+( \(question_id=[^)]*\))?: ", "", str(err))
            skipped.append(SkippedRow(index, qid, message, number))
            continue
        kind = {True: "detail", False: "global", None: ""}[item.needs_zoom]
        question = dataclasses.replace(question, kind=kind, target_box=item.target_box)
        groups = {k: v for k, v in (("category", item.category), ("kind", kind)) if v}
        rows.append(BenchmarkRow(index, item.question_id, question, groups, number))
    return Benchmark(path, "jsonl", rows, skipped)


# -- TSV ---------------------------------------------------------------------------------------


def _csv_fields(text: str) -> list[str] | None:
    """The fields of `text` read as one well-formed TSV record (quoting undone), or None if it is not."""
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, len(text) + 1))  # a base64 image is megabytes long
    try:
        records = list(csv.reader(io.StringIO(text, newline=""), delimiter="\t", strict=True))
    except csv.Error:
        return None
    finally:
        csv.field_size_limit(limit)
    return records[0] if len(records) == 1 else None


def _tsv_fields(text: str, width: int) -> list[str]:
    """One record -> its `width` fields. Quoting as pandas writes it ("..." around a field holding a
    tab, a quote or a line break, quotes doubled) is undone; a record whose quotes are not well-formed
    (a stray " in a question) is split at its tabs, its quotes kept as text."""
    fields = _csv_fields(text)
    if fields is not None and len(fields) == width:
        return fields
    fields = text.split("\t")
    if len(fields) != width:
        raise RowError(f"malformed: {len(fields)} tab-separated fields, the header has {width}")
    return fields


def _ends_in_quotes(raw: bytes, inside: bool) -> bool:
    """Whether a quoted field is open at the end of `raw` (which starts inside one if `inside`). A
    quote opens a field only at the field's start; inside, a doubled quote is text, a single one
    closes it. Only the quotes are visited, so a line of megabytes costs little."""
    at = raw.find(b'"')
    while at != -1:
        if inside:
            if raw[at + 1 : at + 2] == b'"':
                at = raw.find(b'"', at + 2)
                continue
            inside = False
        elif at == 0 or raw[at - 1 : at] == b"\t":
            inside = True
        at = raw.find(b'"', at + 1)
    return inside


def _tsv_records(lines: Iterator[tuple[int, int, bytes]], width: int) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, raw bytes without the final line end) of each non-blank record.

    A record is a line, or lines joined while a quoted field opened on the first line stays open,
    if the lines joined make one well-formed record of `width` fields, none of the lines after the
    first has `width` fields by itself (a row of its own, which a stray quote must not swallow) and
    they are at most TSV_RECORD_LINES. Otherwise the first line is a record alone and the next line
    starts the next one: a line is never lost."""
    pending: deque[tuple[int, int, bytes]] = deque()  # lines read ahead by a join that failed

    def read() -> tuple[int, int, bytes] | None:
        return pending.popleft() if pending else next(lines, None)

    while (line := read()) is not None:
        number, offset, first = line
        if not first or first.isspace():
            continue
        taken = [line]
        inside = _ends_in_quotes(first.rstrip(b"\r\n"), False)
        while inside and len(taken) < TSV_RECORD_LINES and (following := read()) is not None:
            taken.append(following)
            text = following[2].rstrip(b"\r\n")
            if text.count(b"\t") + 1 == width:  # a row of its own: the quote was a stray one
                break
            inside = _ends_in_quotes(text, True)
        raw = b"".join(item[2] for item in taken).rstrip(b"\r\n")
        if len(taken) > 1 and (inside or not _one_record(raw, width)):
            pending.extendleft(reversed(taken[1:]))
            raw = first.rstrip(b"\r\n")
        yield number, offset, raw


def _one_record(raw: bytes, width: int) -> bool:
    try:
        fields = _csv_fields(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return False
    return fields is not None and len(fields) == width


class _TsvImage:
    """Reads one record's base64 image from the file when called: nothing stays in memory."""

    def __init__(self, path: Path, offset: int, length: int, column: int, width: int) -> None:
        self.path, self.offset, self.length, self.column, self.width = path, offset, length, column, width

    def data(self) -> bytes:
        with self.path.open("rb") as file:
            file.seek(self.offset)
            raw = file.read(self.length)
        encoded = _tsv_fields(raw.decode("utf-8"), self.width)[self.column].strip()
        return base64.b64decode(encoded, validate=True)

    def __call__(self) -> Image.Image:
        with Image.open(io.BytesIO(self.data())) as image:
            return image.convert("RGB")


def _check_image_bytes(encoded: str) -> None:
    """Cheap checks at load time: valid base64 whose header an image decoder recognises."""
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as err:
        raise RowError(f"image is not valid base64 ({err})") from None
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except IMAGE_ERRORS as err:
        raise RowError(f"image bytes are not an image ({type(err).__name__}: {err})") from None
    if width < 1 or height < 1:
        raise RowError(f"image of size {width}x{height}")


def _tsv_options(value: dict[str, str], letters: Sequence[str]) -> list[str]:
    """VLMEvalKit: the options are the non-empty letter columns, from A on, without gaps."""
    present = [bool(value[letter].strip()) and value[letter].strip().lower() != "nan" for letter in letters]
    count = present.index(False) if False in present else len(present)
    if any(present[count:]):
        raise RowError(f"option columns have a gap: {[value[letter] for letter in letters]!r}")
    return [value[letter].strip() for letter in letters[:count]]


def _listed(text: str) -> list[str]:
    """MME-RealWorld's TSV column of options: '(A) ...' lines (or a list of them)."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        try:
            items = ast.literal_eval(text)  # literals only: nothing is executed
        except (ValueError, SyntaxError, RecursionError, MemoryError):
            items = None
        if isinstance(items, list) and all(isinstance(item, str) for item in items):
            text = "\n".join(items)
    return split_options(text)[1]


def _load_tsv(path: Path, limit: int | None) -> Benchmark:
    lines = _lines(path)
    header_line = next(lines, None)
    if header_line is None:
        raise ConfigError(f"config error: {str(path)!r} is empty; expected {EXPECTED['tsv']}")
    try:
        text = header_line[2].decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config error: the header of {str(path)!r} is not UTF-8 text ({err}); save the file as UTF-8"
        ) from None
    header = [name.strip() for name in _csv_fields(text) or text.split("\t")]
    letters = [letter for letter in string.ascii_uppercase if letter in header]
    listed = not {"A", "B"} <= set(letters)  # MME-RealWorld's TSV: one column of "(A) ..." lines
    missing = [name for name in ("question", "answer", "image") if name not in header]
    if listed and MULTI_CHOICE not in header:
        missing.insert(2, f"options (columns A, B, ... or {MULTI_CHOICE!r})")
    if missing:
        raise ConfigError(
            f"config error: {str(path)!r} is not a benchmark TSV: its header lacks {missing} "
            f"(header: {header[:12]!r}); expected {EXPECTED['tsv']}"
        )
    repeated = sorted(name for name, count in Counter(header).items() if count > 1 and name)
    if repeated:
        raise ConfigError(f"config error: the header of {str(path)!r} repeats the columns {repeated}")
    column = {name: i for i, name in enumerate(header)}
    group_names = [name for name in ("category", "l2-category", "cycle_category") if name in column]
    rows: list[BenchmarkRow] = []
    skipped: list[SkippedRow] = []
    images: dict[str, _TsvImage] = {}  # index -> where that row's image is (for rows that refer to it)
    references: list[tuple[BenchmarkRow, str]] = []
    for index, (number, offset, raw) in enumerate(_tsv_records(lines, len(header))):
        if limit is not None and index >= limit:
            break
        qid: str | None = None
        try:
            value = dict(zip(header, _tsv_fields(_utf8(raw), len(header)), strict=True))
            qid = value.get("index", "").strip() or str(index)
            options = _listed(value[MULTI_CHOICE]) if listed else _tsv_options(value, letters)
            encoded = value["image"].strip()
            reference = encoded if encoded.isdigit() and len(encoded) <= 64 else None
            loader = _TsvImage(path, offset, len(raw), column["image"], len(header))
            if reference is None:
                _check_image_bytes(encoded)
                images[qid] = loader
            groups = {name: value[name].strip() for name in group_names}
            question = _question(
                value["question"], options, value["answer"], loader, groups.get("category", "")
            )
            row = BenchmarkRow(index, qid, question, groups, number)
            rows.append(row)
            if reference is not None:
                references.append((row, reference))
        except RowError as err:
            skipped.append(SkippedRow(index, qid, str(err), number))
    for row, reference in references:  # VLMEvalKit stores a repeated image once, others give its index
        if reference in images:
            row.question = dataclasses.replace(row.question, load_image=images[reference])
        else:
            rows.remove(row)
            reason = f"image refers to index {reference}, which holds no image"
            skipped.append(SkippedRow(row.row, row.id, reason, row.line))
    skipped.sort(key=lambda s: s.row)
    scoring: Scoring = "hrbench" if "cycle_category" in column else "accuracy"
    return Benchmark(path, "tsv", rows, skipped, scoring)


# ---------------------------------------------------------------------------------------------
# Answers and scores

_SPECIAL_TOKEN = re.compile(r"<\|[^|<>]*\|>")  # <|im_end|>, <|endoftext|>, ...
_LEADING_LABEL = re.compile(r"\s*(?:\(([A-Za-z])\)|([A-Z])[.):])(?=\s|$)")


def extract_choice(text: str, options: Sequence[str]) -> str | None:
    """The option letter a model's answer names, or None (unanswered).

    Rules, in order: the last ``<answer>...</answer>`` or ``\\boxed{}`` (a letter, a labelled option
    or an option's text); in free text an opening label ("(B) ...", "B. ...", "B: ..."), then
    `mmrl.rewards.extract_answer`'s letters ("Answer: B", "the answer is (C)", a last "(D)", a lone
    letter), then the one option whose text occurs in it. Special tokens are ignored. A letter
    outside the options, or text matching no option, is no answer."""
    text = _SPECIAL_TOKEN.sub(" ", text).strip()
    if not text:
        return None
    letters = string.ascii_uppercase[: len(options)]
    tagged = "<answer>" in text.lower() or "\\boxed{" in text
    if not tagged and (lead := _LEADING_LABEL.match(text)):
        letter = (lead.group(1) or lead.group(2)).upper()
        if letter in letters:
            return letter
    answer = extract_answer(text, options)
    return answer if answer is not None and answer in letters else None


@dataclass
class Outcome:
    """One row under one tool mode: what `rollout_metrics` reads from a Trajectory, without its tokens
    and images (a benchmark's trajectories are dropped batch by batch)."""

    predicted: str | None
    correct: bool
    used_tool: bool
    tool_stats: ToolStats
    turns: int
    generated_tokens: int
    ended: str
    output: str


@dataclass
class RowResult:
    row: BenchmarkRow
    outcomes: dict[str, Outcome]


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
    batch and shared by the modes). Rows whose prompt cannot be built or whose image does not decode
    are returned as skipped, not scored."""
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


def hrbench_score(records: Iterable[tuple[str, str, bool]]) -> dict[str, dict[str, Any]]:
    """HR-Bench's score from (cycle_category, category, correct) per question: accuracy over all
    questions and per category within each cycle, then each averaged over the cycles (a category
    over the cycles that hold it)."""
    per_cycle: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for cycle, category, correct in records:
        per_cycle[cycle]["all"].append(correct)
        if category:
            per_cycle[cycle][category].append(correct)
    order = sorted(per_cycle, key=lambda c: (not c.isdigit(), int(c) if c.isdigit() else 0, c))
    cycles = {c: {kind: sum(v) / len(v) for kind, v in sorted(per_cycle[c].items())} for c in order}
    kinds = sorted(
        {kind for accuracies in cycles.values() for kind in accuracies}, key=lambda k: (k != "all", k)
    )
    average = {}
    for kind in kinds:
        values = [accuracies[kind] for accuracies in cycles.values() if kind in accuracies]
        average[kind] = sum(values) / len(values)
    return {"cycles": cycles, "average": average}


def _group_table(results: Sequence[RowResult], mode: str, key: str) -> dict[str, dict[str, float]]:
    by_value: dict[str, list[Outcome]] = defaultdict(list)
    for result in results:
        if key in result.row.groups:
            by_value[result.row.groups[key]].append(result.outcomes[mode])
    return {
        value: {
            "n": len(outcomes),
            "accuracy": sum(o.correct for o in outcomes) / len(outcomes),
            "unanswered": sum(o.predicted is None for o in outcomes),
            "tool_ratio": sum(o.used_tool for o in outcomes) / len(outcomes),
        }
        for value, outcomes in sorted(by_value.items())
    }


def score_results(
    results: Sequence[RowResult], modes: Sequence[str], scoring: Scoring = "accuracy"
) -> dict[str, Any]:
    """Per mode: the score (accuracy, or HR-Bench's cycle average), answered / unanswered counts, tool
    use (ratio, calls, errors by kind), accuracy with and without the tool, endings, per-group tables."""
    keys = sorted({key for result in results for key in result.row.groups})
    scores: dict[str, Any] = {}
    for mode in modes:
        outcomes = [result.outcomes[mode] for result in results]
        correct = [o.correct for o in outcomes]
        metrics = rollout_metrics(outcomes, correct)  # type: ignore[arg-type]  # Outcome has what it reads
        tools = sum((o.tool_stats for o in outcomes), ToolStats())
        summary: dict[str, Any] = {
            "score": metrics["accuracy"],
            "accuracy": metrics["accuracy"],
            "scored": len(outcomes),
            "correct": sum(correct),
            "answered": sum(o.predicted is not None for o in outcomes),
            "unanswered": sum(o.predicted is None for o in outcomes),
            "tool_ratio": metrics["tool_ratio"],
            "tool_calls": tools.calls,
            "tool_errors": tools.calls - tools.successes,
            "tool_success_rate": metrics["tool_success_rate"],
            "tool_error_kinds": dict(sorted(tools.errors.items())),
            "accuracy_with_tool": metrics["accuracy_with_tool"],
            "accuracy_without_tool": metrics["accuracy_without_tool"],
            "tokens_per_answer": metrics["tokens_per_answer"],
            "turns": metrics["turns"],
            "ended": dict(Counter(o.ended for o in outcomes)),
            "groups": {key: _group_table(results, mode, key) for key in keys},
        }
        if scoring == "hrbench":
            summary["hrbench"] = hrbench_score(
                (r.row.groups.get("cycle_category", ""), r.row.groups.get("category", ""), o.correct)
                for r, o in zip(results, outcomes, strict=True)
            )
            summary["score"] = summary["hrbench"]["average"].get("all", float("nan"))
        scores[mode] = summary
    return scores


# ---------------------------------------------------------------------------------------------
# The evaluator


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
    from vlm_rl.trainer import DEFAULT_MODEL

    return shipped_path(model or DEFAULT_MODEL)


def load_model(path: Path, device: str) -> VLMAdapter:
    """The checkpoint at `path` on `device` (one `check_device` resolved), in eval mode."""
    try:
        adapter = VLMAdapter.from_pretrained(path)
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
