"""Benchmark files in their published formats, read into `Benchmark` rows (`load_benchmark`).

Formats (`format=auto` picks one from the path):

- ``vstar`` -- V* Bench, folder form: ``ROOT/direct_attributes/`` and ``ROOT/relative_position/``,
  every image beside a same-named ``.json`` holding ``question``, ``options`` (the right one first,
  as the V* evaluation scores it), ``target_object`` and ``bbox``. The options are shuffled per
  question (seeded by the question's path) so that the right letter is not always A.
- ``vstar_jsonl`` -- V* Bench, ``test_questions.jsonl``: rows ``{question_id, image, text, category,
  label}``, ``text`` being the question, one ``(A) ...`` line per option and an instruction line. A
  folder that holds ``test_questions.jsonl`` is read this way (it is the lettering papers report on).
- ``tsv`` -- the VLMEvalKit multiple-choice TSV of HR-Bench 4K/8K, MME-RealWorld and other
  benchmarks (`vlm_rl.benchmark_tsv`).
- ``mme_realworld`` -- MME-RealWorld's JSON list of ``{Question_id, Image, Text, Answer choices
  ["(A) ...", ...], Ground truth, Task, Subtask, Category}``, image paths relative to ``image_root``.
- ``jsonl`` -- the project's own jsonl of multiple-choice questions (`vlm_rl.question_jsonl.read_row`).

Every row read is either a `BenchmarkRow` or a `SkippedRow`: a row that cannot be asked fairly
(malformed, not UTF-8, missing image, an image path that leads outside the benchmark's folder, bad
base64, an image that does not decode, no options, a gold answer that is not an option) is kept with
its row number, line, id and reason and left out of the score. A row of a TSV or jsonl is a line
(blank lines are not rows). Only a whole-file problem (no such path, a TSV header without a needed
column, an MME-RealWorld file that is not a JSON list, an unreadable file) stops with ConfigError.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import string
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from mmrl.config import ConfigError
from vlm_rl.benchmark_rows import (
    EXPECTED,
    FORMATS,
    Benchmark,
    BenchmarkRow,
    RowError,
    SkippedRow,
    make_question,
    read_lines,
    split_options,
    utf8_text,
)
from vlm_rl.benchmark_tsv import load_tsv
from vlm_rl.question_jsonl import read_row

VSTAR_CATEGORIES = ("direct_attributes", "relative_position")
VSTAR_JSONL = "test_questions.jsonl"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


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
            return load_tsv(path, limit)
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
            first = next((raw for _, _, raw in read_lines(path) if raw.strip()), b"")
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
            question = make_question(text, shown, answer, _file_image(image), category)
            rows.append(BenchmarkRow(index, qid, question, {"category": category}))
        except RowError as err:
            skipped.append(SkippedRow(index, qid, str(err)))
    return Benchmark(root, "vstar", rows, skipped)


def _json_lines(path: Path, limit: int | None) -> Iterator[tuple[int, int, bytes]]:
    """(row, line number, the line's bytes) for the first `limit` non-blank lines."""
    row = 0
    for number, _, raw in read_lines(path):
        if not raw or raw.isspace():
            continue
        if limit is not None and row >= limit:
            return
        yield row, number, raw
        row += 1


def _load_vstar_jsonl(path: Path, root: Path, limit: int | None) -> Benchmark:
    rows: list[BenchmarkRow] = []
    skipped: list[SkippedRow] = []
    for index, number, raw in _json_lines(path, limit):
        qid = None
        try:
            item = _parse_json(utf8_text(raw))
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
                    make_question(question, options, label, _file_image(image), category),
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
                    make_question(text, options, truth, _file_image(image), category),
                    groups,
                )
            )
        except RowError as err:
            skipped.append(SkippedRow(index, qid, str(err)))
    return Benchmark(path, "mme_realworld", rows, skipped)


def _load_project_jsonl(path: Path, root: Path, limit: int | None) -> Benchmark:
    rows: list[BenchmarkRow] = []
    skipped: list[SkippedRow] = []
    for index, number, raw in _json_lines(path, limit):
        qid = None
        try:
            line = utf8_text(raw)
            parsed = _parse_json(line)  # read_row reads it again, but only catches bad syntax
            if isinstance(parsed, dict):
                qid = None if parsed.get("question_id") is None else str(parsed["question_id"])
                if isinstance(parsed.get("image"), str):
                    _inside(root, root / parsed["image"])  # before read_row looks for the file
            item = read_row(line, index, root)
            question = make_question(
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
