"""The VLMEvalKit multiple-choice TSV (HR-Bench 4K/8K, MME-RealWorld and other benchmarks), read
row by row without holding the file in memory.

A header ``index, question, answer, category, A, B, C, D, ..., image`` with the image as base64 (or
the ``index`` of an earlier row holding the same image). With a ``cycle_category`` column the score is
HR-Bench's: accuracy within each cycle (the same questions with their options rotated), averaged over
the cycles. MME-RealWorld's TSV (options as one ``multi-choice options`` column of ``(A) ...`` lines;
``category``, ``l2-category``) reads the same way. Rows are located at load time and their images
decoded only when asked, so a multi-gigabyte file is never held in memory. A field in quotes may run
over line ends, as pandas writes a field holding a line break, but a stray quote never swallows the
rows after it.
"""

from __future__ import annotations

import ast
import base64
import binascii
import csv
import dataclasses
import io
import string
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from pathlib import Path

from PIL import Image

from mmrl.config import ConfigError
from vlm_rl.benchmark_rows import (
    EXPECTED,
    IMAGE_ERRORS,
    Benchmark,
    BenchmarkRow,
    RowError,
    Scoring,
    SkippedRow,
    make_question,
    read_lines,
    split_options,
    utf8_text,
)

MULTI_CHOICE = "multi-choice options"
TSV_RECORD_LINES = 1000  # the most lines one quoted TSV field may span


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


def load_tsv(path: Path, limit: int | None) -> Benchmark:
    lines = read_lines(path)
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
            value = dict(zip(header, _tsv_fields(utf8_text(raw), len(header)), strict=True))
            qid = value.get("index", "").strip() or str(index)
            options = _listed(value[MULTI_CHOICE]) if listed else _tsv_options(value, letters)
            encoded = value["image"].strip()
            reference = encoded if encoded.isdigit() and len(encoded) <= 64 else None
            loader = _TsvImage(path, offset, len(raw), column["image"], len(header))
            if reference is None:
                _check_image_bytes(encoded)
                images[qid] = loader
            groups = {name: value[name].strip() for name in group_names}
            question = make_question(
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
