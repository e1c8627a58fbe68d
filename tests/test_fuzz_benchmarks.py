"""The benchmark readers of `mmrl eval vlm` on broken input: random bytes and random mutations of valid
files of every format give a ConfigError or a result that accounts for every row of the file (scored
or skipped with its index), never another exception; a stray quote does not swallow the TSV rows
after it; image paths cannot lead outside the benchmark's folder."""

import base64
import contextlib
import csv
import io
import json
import random
import subprocess
import sys
from pathlib import Path

from PIL import Image

from mmrl.config import ConfigError
from vlm_rl.benchmark_files import IMAGE_SUFFIXES, VSTAR_CATEGORIES, load_benchmark
from vlm_rl.benchmark_rows import IMAGE_ERRORS, Benchmark

SEED = 20240522
HR_HEADER = ["index", "question", "answer", "category", "A", "B", "C", "D", "cycle_category", "image"]
MME_HEADER = ["index", "question", "multi-choice options", "answer", "category", "l2-category", "image"]
OPTIONS = ["red", "blue", "green", "white"]


def png(colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 6), colour).save(buffer, "PNG")
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---------------------------------------------------------------------------------------------
# Valid files of every format


def hr_tsv(rows: int = 6) -> bytes:
    lines = ["\t".join(HR_HEADER)]
    for i in range(rows):
        image = "0" if i == 3 else b64(png((i * 40, 0, 0)))  # row 3 refers to row 0's image
        question = '"Which sign says ""STOP""?"' if i == 2 else f"What is written on door {i}?"
        lines.append(
            "\t".join([str(i), question, "ABCD"[i % 4], "single", "a", "b", "c", "d", str(i % 2), image])
        )
    return ("\n".join(lines) + "\n").encode()


def mme_tsv(rows: int = 4) -> bytes:
    lines = ["\t".join(MME_HEADER)]
    for i in range(rows):
        listed = "['(A) 458', '(B) 457', '(C) 456']" if i % 2 else '"(A) 458\n(B) 457\n(C) 456"'
        lines.append("\t".join([str(i), f"Value {i}?", listed, "B", "Perception", "Table", b64(png())]))
    return ("\n".join(lines) + "\n").encode()


def project_jsonl(rows: int = 5) -> bytes:
    good = {"question_id": "q", "image": "a.png", "question": "Colour?", "options": OPTIONS, "answer": "B"}
    return b"".join(json.dumps(good | {"question_id": f"q{i}"}).encode() + b"\n" for i in range(rows))


def vstar_jsonl(rows: int = 5) -> bytes:
    text = "What is the colour of the glove?\n(A) red\n(B) blue\nAnswer with the option's letter."
    row = {"image": "direct_attributes/sa_1.png", "text": text, "category": "direct_attributes", "label": "A"}
    return b"".join(json.dumps(row | {"question_id": str(i)}).encode() + b"\n" for i in range(rows))


def mme_json(rows: int = 4) -> bytes:
    item = {
        "Image": "a.png",
        "Text": "What is the value?",
        "Answer choices": ["(A) 458", "(B) 457", "(C) 456"],
        "Ground truth": "B",
        "Task": "Perception",
        "Subtask": "Table",
        "Category": "diagram",
    }
    return json.dumps([item | {"Question_id": f"m{i}"} for i in range(rows)], indent=1).encode()


def write_images(root: Path) -> None:
    (root / "direct_attributes").mkdir(parents=True, exist_ok=True)
    (root / "a.png").write_bytes(png())
    (root / "direct_attributes" / "sa_1.png").write_bytes(png())


def vstar_folder(root: Path, stems: int = 4) -> None:
    for i in range(stems):
        folder = root / VSTAR_CATEGORIES[i % 2]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"sa_{i}.png").write_bytes(png())
        note = {
            "question": "Which colour?",
            "options": OPTIONS,
            "target_object": ["cup"],
            "bbox": [[1, 1, 2, 2]],
        }
        (folder / f"sa_{i}.json").write_text(json.dumps(note))


# ---------------------------------------------------------------------------------------------
# Mutations


def mutate_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One random edit of a file's bytes: the new bytes and what was done (for a failure's message)."""
    lines = data.split(b"\n")
    at = rng.randrange(len(data) + 1)
    line = rng.randrange(len(lines))
    kind = rng.choice(
        [
            "flip",
            "delete_line",
            "duplicate_line",
            "truncate_line",
            "truncate_file",
            "quote",
            "tab",
            "newline",
            "crlf",
            "not_utf8",
            "huge",
            "bom",
            "nul",
            "deep_line",
            "long_number_line",
        ]
    )
    if kind == "flip" and data:
        at = min(at, len(data) - 1)
        data = data[:at] + bytes([rng.randrange(256)]) + data[at + 1 :]
    elif kind == "delete_line":
        data = b"\n".join(lines[:line] + lines[line + 1 :])
    elif kind == "duplicate_line":
        data = b"\n".join(lines[: line + 1] + lines[line:])
    elif kind == "truncate_line":
        lines[line] = lines[line][: rng.randrange(len(lines[line]) + 1)]
        data = b"\n".join(lines)
    elif kind == "truncate_file":
        data = data[:at]
    elif kind == "crlf":
        data = data.replace(b"\n", b"\r\n")
    elif kind == "bom":
        data = b"\xef\xbb\xbf" + data
    elif kind in ("deep_line", "long_number_line"):  # json.loads: RecursionError, ValueError
        lines.insert(line, b"[" * 100_000 if kind == "deep_line" else b"1" * 5000)
        data = b"\n".join(lines)
    else:
        inserted = {
            "quote": b'"',
            "tab": b"\t",
            "newline": b"\n",
            "not_utf8": rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"]),
            "huge": b"x" * 200_000,
            "nul": b"\x00",
        }.get(kind, b"")
        data = data[:at] + inserted + data[at:]
    return data, f"{kind}@{at}/line {line}"


WRONG_TYPES = [None, 1, 1.5, True, [], {}, "", "x", ["a"], {"k": 1}, [[[[]]]], 10**30]


def retype(objects: list, rng: random.Random) -> str:
    """Give one key of one of the JSON objects in `objects` a value of another type."""
    candidates = [item for item in objects if isinstance(item, dict) and item]
    if not candidates:
        return "no object"
    target = rng.choice(candidates)
    key = rng.choice(sorted(target))
    target[key] = rng.choice(WRONG_TYPES)
    return f"type {key}"


def mutate_json_type(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """A jsonl line's or a JSON list item's key given a value of another type (bytes edits if unparsable)."""
    whole = data.lstrip().startswith(b"[")
    try:
        items = (
            json.loads(data) if whole else [json.loads(line) for line in data.split(b"\n") if line.strip()]
        )
    except (ValueError, RecursionError):
        return mutate_bytes(data, rng)
    done = retype(items, rng)
    if whole:
        return json.dumps(items).encode(), done
    return b"".join(json.dumps(item).encode() + b"\n" for item in items), done


def random_bytes(rng: random.Random) -> bytes:
    alphabet = rng.choice([b'\t\n"ab{}[]:,0123456789 \r', bytes(range(256))])
    return bytes(rng.choice(alphabet) for _ in range(rng.randrange(200)))


# ---------------------------------------------------------------------------------------------
# What a result must satisfy


def assert_every_row_accounted(bench: Benchmark, rows_in_file: int) -> None:
    indices = sorted([r.row for r in bench.rows] + [s.row for s in bench.skipped])
    assert indices == list(range(rows_in_file)), (indices, rows_in_file)
    assert bench.rows_read == rows_in_file
    assert all(s.reason.strip() for s in bench.skipped)


def check_line_rows(bench: Benchmark, data: bytes, tsv: bool) -> None:
    """Each non-blank line (after a TSV's header) is where one row starts, or (TSV only) a line of a
    row whose quoted field runs over line ends: the lines from one row's start to the next one's then
    read as one well-formed TSV record. Lines are split at b"\\n", as the readers do."""
    starts = sorted([r.line for r in bench.rows] + [s.line for s in bench.skipped])
    assert len(set(starts)) == len(starts), "two rows start on one line"
    physical = data.removeprefix(b"\xef\xbb\xbf").split(b"\n")
    nonblank = [n for n, line in enumerate(physical, 1) if line.strip() and (n > 1 or not tsv)]
    if not tsv:
        assert starts == nonblank
    else:
        assert set(starts) <= set(nonblank) and starts[:1] == nonblank[:1]
        for start, end in zip(starts, [*starts[1:], len(physical) + 1], strict=True):
            span = physical[start - 1 : end - 1]
            while not span[-1].strip():
                span.pop()
            if len(span) > 1:
                text = b"\n".join(span).rstrip(b"\r\n").decode("utf-8")
                limit = csv.field_size_limit(len(text) + 1)
                try:
                    records = list(csv.reader(io.StringIO(text, newline=""), delimiter="\t", strict=True))
                finally:
                    csv.field_size_limit(limit)
                assert len(records) == 1, f"lines {start}-{start + len(span) - 1} are not one record"
    assert_every_row_accounted(bench, len(starts))


def check_images(bench: Benchmark) -> None:
    """A scored row's image loads, or fails the way the evaluator counts as a skip."""
    for row in bench.rows:
        with contextlib.suppress(IMAGE_ERRORS):
            row.question.image.load()


def vstar_stems(root: Path) -> int:
    stems = set()
    for category in VSTAR_CATEGORIES:
        if (root / category).is_dir():
            for file in (root / category).iterdir():
                if file.suffix.lower() in (".json", *IMAGE_SUFFIXES):
                    stems.add((category, file.stem))
    return len(stems)


# ---------------------------------------------------------------------------------------------
# The fuzz test


FILES = {  # format -> (file name, valid bytes)
    "tsv": ("bench.tsv", hr_tsv),
    "mme_tsv": ("mme.tsv", mme_tsv),
    "jsonl": ("questions.jsonl", project_jsonl),
    "vstar_jsonl": ("test_questions.jsonl", vstar_jsonl),
    "mme_realworld": ("mme.json", mme_json),
}


def run_file_case(root: Path, kind: str, data: bytes, use_auto: bool) -> str:
    """Load one file; 'error' for a ConfigError, else check the result and return 'result'."""
    name, _ = FILES[kind]
    path = root / name
    path.write_bytes(data)
    fmt = "auto" if use_auto else {"mme_tsv": "tsv"}.get(kind, kind)
    try:
        bench = load_benchmark(path, fmt)
    except ConfigError as err:
        assert str(err).startswith("config error:") and "\n" not in str(err).strip()
        return "error"
    if bench.format in ("tsv", "jsonl", "vstar_jsonl"):
        check_line_rows(bench, data, tsv=bench.format == "tsv")
    else:
        items = json.loads(data.decode("utf-8-sig"))  # a result means the reader read a JSON list
        assert_every_row_accounted(bench, len(items))
    check_images(bench)
    return "result"


def mutate_vstar(root: Path, rng: random.Random) -> str:
    """One random change to a V* folder: an annotation's bytes or types, a file gone, a second image,
    an image linking outside the folder, a folder where an annotation would be."""
    folder = root / rng.choice(VSTAR_CATEGORIES)
    files = (
        sorted(f for f in folder.iterdir() if f.is_file() and not f.is_symlink()) if folder.is_dir() else []
    )
    kind = rng.choice(["note_bytes", "note_type", "random_note", "delete", "second_image", "link_out", "dir"])
    if not files:
        return "nothing to mutate"
    file = rng.choice(files)
    note = folder / f"{file.stem}.json"
    if kind == "note_bytes" and note.is_file():
        note.write_bytes(mutate_bytes(note.read_bytes(), rng)[0])
    elif kind == "note_type" and note.is_file():
        try:
            items = [json.loads(note.read_bytes())]
        except (ValueError, RecursionError):
            return "note_type on a broken note"
        retype(items, rng)
        note.write_text(json.dumps(items[0]))
    elif kind == "random_note" and not note.is_dir():
        note.write_bytes(random_bytes(rng))
    elif kind == "delete":
        file.unlink()
    elif kind == "second_image":
        (folder / f"{file.stem}.jpg").write_bytes(png())
    elif kind == "link_out":  # the question's image becomes a link to a file outside the folder
        (folder / f"{file.stem}.png").unlink(missing_ok=True)
        (folder / f"{file.stem}.png").symlink_to(root.parent / "outside.png")
    elif kind == "dir":
        (folder / f"{file.stem}_d.json").mkdir(exist_ok=True)
    return f"{kind} {file.name}"


def test_fuzz_readers_account_for_every_row_or_raise_config_error(tmp_path):
    rng = random.Random(SEED)
    outcomes = {"error": 0, "result": 0}
    root = tmp_path / "files"
    root.mkdir()
    write_images(root)
    (tmp_path / "outside.png").write_bytes(png())
    for case in range(300):
        kind = list(FILES)[case % len(FILES)]
        data, done = FILES[kind][1](), []
        if case % 10 == 0:
            data, done = random_bytes(rng), ["random bytes"]
        else:
            for _ in range(rng.randint(1, 3)):
                mutate = (
                    mutate_json_type
                    if kind in ("jsonl", "vstar_jsonl", "mme_realworld") and rng.random() < 0.3
                    else mutate_bytes
                )
                data, what = mutate(data, rng)
                done.append(what)
        try:
            outcomes[run_file_case(root, kind, data, use_auto=case % 2 == 0)] += 1
        except Exception as err:  # the case is named so that it can be read again
            raise AssertionError(f"case {case} ({kind}, {done}): {type(err).__name__}: {err}") from err
    for case in range(40):
        bench_root = tmp_path / f"vstar_{case}"
        vstar_folder(bench_root)
        done = [mutate_vstar(bench_root, rng) for _ in range(rng.randint(1, 3))]
        try:
            bench = load_benchmark(bench_root, "vstar")
            assert_every_row_accounted(bench, vstar_stems(bench_root))
            check_images(bench)
            outcomes["result"] += 1
        except ConfigError:
            outcomes["error"] += 1
        except Exception as err:
            raise AssertionError(f"V* case {case} ({done}): {type(err).__name__}: {err}") from err
    assert outcomes["error"] > 20 and outcomes["result"] > 150, outcomes  # both ends were reached


# ---------------------------------------------------------------------------------------------
# Regressions


def test_a_stray_quote_does_not_swallow_the_rows_after_it(tmp_path):
    lines = hr_tsv(12).decode().split("\n")
    lines[4] = lines[4].replace("What is", '"What is')  # row 3: a quote opens a field and never closes
    lines[8] = lines[8].replace("written", 'writ"ten')  # row 7: a quote inside a field
    lines[10] = lines[10].replace("What is", '"What is')  # rows 9 and 10: quotes that would pair up
    lines[11] = lines[11].replace("door", 'do"or')
    path = tmp_path / "stray.tsv"
    path.write_text("\n".join(lines))
    bench = load_benchmark(path)
    assert bench.rows_read == 12 and not bench.skipped
    assert [r.id for r in bench.rows] == [str(i) for i in range(12)]
    assert bench.rows[3].question.question == '"What is written on door 3?'
    assert bench.rows[7].question.question == 'What is writ"ten on door 7?'
    assert bench.rows[2].question.question == 'Which sign says "STOP"?'  # well-formed quoting still read


def test_image_paths_cannot_leave_the_benchmark_folder(tmp_path):
    bench = tmp_path / "bench"
    write_images(bench)
    (tmp_path / "secret.png").write_bytes(png())
    (bench / "link.png").symlink_to(tmp_path / "secret.png")
    good = {"question_id": "q0", "image": "a.png", "question": "Colour?", "options": OPTIONS, "answer": "B"}
    escapes = [
        "../../../../etc/passwd",
        "../" * 30 + "etc/passwd",
        str(tmp_path / "secret.png"),
        "../secret.png",
    ]
    escapes.append("link.png")
    rows = [good] + [good | {"question_id": f"e{i}", "image": image} for i, image in enumerate(escapes)]
    path = bench / "questions.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded = load_benchmark(path)
    assert [r.id for r in loaded.rows] == ["q0"]
    assert [(s.row, s.id) for s in loaded.skipped] == [(i + 1, f"e{i}") for i in range(len(escapes))]
    assert all("leads outside" in s.reason and "refused" in s.reason for s in loaded.skipped)
    # V* folder: an image that is a link to a file outside the folder
    vstar = tmp_path / "vstar"
    vstar_folder(vstar, stems=2)
    (vstar / "direct_attributes" / "sa_0.png").unlink()
    (vstar / "direct_attributes" / "sa_0.png").symlink_to(tmp_path / "secret.png")
    loaded = load_benchmark(vstar)
    assert [r.id for r in loaded.rows] == ["relative_position/sa_1"]
    assert loaded.skipped[0].id == "direct_attributes/sa_0" and "leads outside" in loaded.skipped[0].reason
    # MME-RealWorld json and V* jsonl: image paths relative to the folder, kept inside it
    item = json.loads(mme_json(1))[0]
    (bench / "mme.json").write_text(
        json.dumps([item, item | {"Question_id": "out", "Image": "../secret.png"}])
    )
    loaded = load_benchmark(bench / "mme.json")
    assert [s.id for s in loaded.skipped] == ["out"] and "leads outside" in loaded.skipped[0].reason
    row = json.loads(vstar_jsonl(1)) | {"image": "/etc/passwd"}
    (bench / "test_questions.jsonl").write_text(json.dumps(row) + "\n")
    loaded = load_benchmark(bench / "test_questions.jsonl")
    assert not loaded.rows and "leads outside" in loaded.skipped[0].reason


def test_cli_exits_2_with_one_line_on_a_header_without_a_needed_column(tmp_path):
    header = [name for name in HR_HEADER if name != "answer"]
    (tmp_path / "hr.tsv").write_text("\t".join(header) + "\n0\tq\tsingle\ta\tb\tc\td\t0\tx\n")
    done = subprocess.run(
        [sys.executable, "-m", "mmrl", "eval", "vlm", "benchmark=hr.tsv", "device=cpu"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "hr.tsv" in errors[0] and "'answer'" in errors[0]
