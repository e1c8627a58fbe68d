"""`mmrl eval vlm`: benchmark loaders in the published formats (V* folder and jsonl, HR-Bench TSV,
MME-RealWorld JSON, the project's jsonl), rule-based answer extraction, HR-Bench's cycle averaging,
bad rows reported and skipped, and one end-to-end run with a tiny model."""

import base64
import io
import json

import pytest
import torch
from PIL import Image

from mmrl.cli import load_plugins, main
from mmrl.config import ConfigError
from mmrl.registry import EVALUATORS
from vlm_rl.benchmark_files import load_benchmark
from vlm_rl.benchmark_rows import BenchmarkRow, RowError, make_question, read_lines, split_options, utf8_text
from vlm_rl.config import ToolRolloutConfig
from vlm_rl.data import Question, question_text, tool_call_text
from vlm_rl.eval_benchmarks import resolve_model, run_benchmark
from vlm_rl.loading import load
from vlm_rl.models import Generation
from vlm_rl.scoring import Outcome, RowResult, extract_choice, hrbench_score, score_results
from vlm_rl.tools import ToolStats

load_plugins()

OPTIONS = ["red", "blue", "green", "white"]
VSTAR_TAIL = "Answer with the option's letter from the given choices directly."
HR_HEADER = ["index", "question", "answer", "category", "A", "B", "C", "D", "cycle_category", "image"]


def image_bytes(colour=(200, 30, 30), size=(64, 48), fmt="PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, fmt)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def write_tsv(path, rows, header=HR_HEADER):
    lines = ["\t".join(header)] + ["\t".join(str(v) for v in row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def hr_row(index, answer, cycle, image, category="single", options=("27B", "37B", "27D", "27E")):
    return [index, "What is the number above the door?", answer, category, *options, cycle, image]


# ---------------------------------------------------------------------------------------------
# V* Bench


def vstar_folder(root):
    attributes, relative = root / "direct_attributes", root / "relative_position"
    attributes.mkdir(parents=True)
    relative.mkdir()
    for stem in ("sa_1", "sa_2"):
        (attributes / f"{stem}.jpg").write_bytes(image_bytes(fmt="JPEG"))
        note = {
            "target_object": ["glove"],
            "bbox": [[5, 6, 10, 8]],
            "question": "What is the colour of the glove?",
        }
        (attributes / f"{stem}.json").write_text(json.dumps(note | {"options": OPTIONS}))
    (relative / "sa_3.jpg").write_bytes(image_bytes(fmt="JPEG"))
    question = "Is the cup on the left or right side of the dog?"
    (relative / "sa_3.json").write_text(json.dumps({"question": question, "options": ["left", "right"]}))
    (relative / "sa_4.json").write_text(json.dumps({"question": question, "options": ["left", "right"]}))
    (relative / "sa_5.jpg").write_bytes(image_bytes(fmt="JPEG"))
    (attributes / "sa_6.jpg").write_bytes(image_bytes(fmt="JPEG"))
    (attributes / "sa_6.json").write_text(json.dumps({"question": "What colour?", "options": []}))
    return root


def test_vstar_folder_rows_categories_and_shuffled_options(tmp_path):
    root = vstar_folder(tmp_path / "vstar")
    bench = load_benchmark(root)
    assert bench.format == "vstar" and bench.scoring == "accuracy"
    assert [r.id for r in bench.rows] == [
        "direct_attributes/sa_1",
        "direct_attributes/sa_2",
        "relative_position/sa_3",
    ]
    assert [r.groups["category"] for r in bench.rows] == ["direct_attributes"] * 2 + ["relative_position"]
    for row in bench.rows:  # the file's first option is the right one, wherever the shuffle put it
        q = row.question
        truth = "red" if row.groups["category"] == "direct_attributes" else "left"
        assert q.options[ord(q.answer) - ord("A")] == truth
        assert sorted(q.options) == sorted(OPTIONS if truth == "red" else ["left", "right"])
        assert q.image.size == (64, 48) and q.category == row.groups["category"]
    again = load_benchmark(root)
    assert [r.question.options for r in again.rows] == [r.question.options for r in bench.rows]
    plain = load_benchmark(root, shuffle_options=False)
    assert {r.question.answer for r in plain.rows} == {"A"}
    assert [r.question.options for r in plain.rows][0] == tuple(OPTIONS)
    reasons = {s.id: s.reason for s in bench.skipped}
    assert set(reasons) == {"relative_position/sa_4", "relative_position/sa_5", "direct_attributes/sa_6"}
    assert "without an image" in reasons["relative_position/sa_4"]
    assert "without its annotation" in reasons["relative_position/sa_5"]
    assert "at least 2 options" in reasons["direct_attributes/sa_6"]
    assert load_benchmark(root, limit=2).rows_read == 2


def vstar_jsonl(root, rows):
    root.mkdir(parents=True, exist_ok=True)
    (root / "direct_attributes").mkdir(exist_ok=True)
    (root / "direct_attributes" / "sa_1.jpg").write_bytes(image_bytes(fmt="JPEG"))
    path = root / "test_questions.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_vstar_jsonl_text_is_split_into_question_and_options(tmp_path):
    text = (
        "What is the material of the glove?\n(A) rubber\n(B) cotton\n(C) kevlar\n(D) leather\n" + VSTAR_TAIL
    )
    good = {
        "question_id": "0",
        "image": "direct_attributes/sa_1.jpg",
        "text": text,
        "category": "direct_attributes",
    }
    rows = [
        good | {"label": "A"},
        good | {"question_id": "1", "image": "direct_attributes/missing.jpg", "label": "B"},
        good | {"question_id": "2", "text": "What is it? " + VSTAR_TAIL, "label": "A"},
        good | {"question_id": "3", "label": "E"},
    ]
    path = vstar_jsonl(tmp_path / "vstar", rows)
    for source in (path, path.parent):  # the file, or the folder that holds it
        bench = load_benchmark(source)
        assert bench.format == "vstar_jsonl" and len(bench.rows) == 1
        (row,) = bench.rows
        assert row.id == "0" and row.groups == {"category": "direct_attributes"}
        assert row.question.question == "What is the material of the glove?"
        assert (
            row.question.options == ("rubber", "cotton", "kevlar", "leather") and row.question.answer == "A"
        )
        reasons = {s.id: s.reason for s in bench.skipped}
        assert (
            "not found" in reasons["1"]
            and "no options" in reasons["2"]
            and "'E' is not one of" in reasons["3"]
        )
    assert split_options("Where? (A) left (B) right") == ("Where?", ["left", "right"])


# ---------------------------------------------------------------------------------------------
# HR-Bench TSV


def test_hrbench_tsv_rows_and_bad_rows_reported(tmp_path):
    good = b64(image_bytes())
    rows = [
        hr_row(0, "A", 0, good),
        hr_row(1, "B", 1, "0"),  # VLMEvalKit: the index of a row holding the same image
        ['2\t"Which sign says ""STOP""?"', "C", "cross", "x", "y", "z", "w", 2, good],  # a quoted field
        [3, "What colour?", "A", "single"],  # malformed: fields missing
        hr_row(4, "A", 0, "not base64!!"),
        hr_row(5, "A", 0, b64(b"these bytes are no image")),
        hr_row(6, "A", 0, good, options=("", "", "", "")),
        hr_row(7, "E", 0, good),
        hr_row(8, "A", 0, "99"),  # refers to an index that holds no image
    ]
    path = write_tsv(tmp_path / "hr_bench_4k.tsv", rows)
    bench = load_benchmark(path)
    assert bench.format == "tsv" and bench.scoring == "hrbench"
    assert [r.id for r in bench.rows] == ["0", "1", "2"]
    first = bench.rows[0]
    assert first.question.options == ("27B", "37B", "27D", "27E") and first.question.answer == "A"
    assert first.groups == {"category": "single", "cycle_category": "0"}
    assert bench.rows[2].question.question == 'Which sign says "STOP"?'
    assert bench.rows[1].question.image.size == (64, 48) and bench.rows[2].question.image.getpixel(
        (0, 0)
    ) == (
        200,
        30,
        30,
    )
    reasons = {s.row: s.reason for s in bench.skipped}
    assert [s.id for s in bench.skipped] == [None, "4", "5", "6", "7", "8"]
    assert "malformed: 4 tab-separated fields, the header has 10" in reasons[3]
    assert "not valid base64" in reasons[4]
    assert "not an image" in reasons[5]
    assert "at least 2 options" in reasons[6]
    assert "'E' is not one of the option letters ABCD" in reasons[7]
    assert "refers to index 99" in reasons[8]
    assert load_benchmark(path, limit=2).rows_read == 2


def test_tsv_with_bom_crlf_a_huge_field_and_bytes_that_are_not_utf8(tmp_path):
    good = b64(image_bytes())
    rows = [hr_row(i, "A", i, good) for i in range(4)]
    rows[1][1] = "Which of these? " + "x" * 300_000  # over the csv module's default field limit
    lines = ["\t".join(HR_HEADER)] + ["\t".join(str(v) for v in row) for row in rows]
    data = "\r\n".join(lines).encode().replace(b"door", b"d\xffor", 1)  # row 0 is not UTF-8
    path = tmp_path / "hr.tsv"
    path.write_bytes(b"\xef\xbb\xbf" + data + b"\r\n")
    bench = load_benchmark(path)
    assert [r.id for r in bench.rows] == ["1", "2", "3"] and bench.rows[0].question.question.endswith("x")
    assert bench.rows[0].groups == {"category": "single", "cycle_category": "1"}  # no "\r" left over
    assert bench.rows[2].question.image.size == (64, 48)
    assert [(s.row, s.line) for s in bench.skipped] == [(0, 2)] and "not UTF-8" in bench.skipped[0].reason
    path.write_bytes("\t".join(HR_HEADER).encode().replace(b"question", b"qu\xe9stion") + b"\n")
    with pytest.raises(ConfigError, match=r"header of .*hr\.tsv' is not UTF-8 text"):
        load_benchmark(path)
    path.write_text("\t".join([*HR_HEADER, "answer"]) + "\n")
    with pytest.raises(ConfigError, match=r"hr\.tsv' repeats the columns \['answer'\]"):
        load_benchmark(path)
    path.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"hr\.tsv' is empty"):
        load_benchmark(path)


def test_mme_realworld_tsv_lists_options_in_one_column(tmp_path):
    header = ["index", "question", "multi-choice options", "answer", "category", "l2-category", "image"]
    listed = '"(A) 458\n(B) 457\n(C) 456\n(D) 455\n(E) This image doesn\'t feature the data."'
    rows = [
        [
            0,
            "What is the data of Interest in Feb-23?",
            listed,
            "B",
            "Perception",
            "Diagram and Table",
            b64(image_bytes()),
        ],
        [1, "What is it?", "no options here", "A", "Perception", "Monitoring", b64(image_bytes())],
    ]
    bench = load_benchmark(write_tsv(tmp_path / "MME-RealWorld.tsv", rows, header))
    assert bench.scoring == "accuracy" and [r.id for r in bench.rows] == ["0"]
    row = bench.rows[0]
    assert row.question.options == ("458", "457", "456", "455", "This image doesn't feature the data.")
    assert row.groups == {"category": "Perception", "l2-category": "Diagram and Table"}
    assert [s.id for s in bench.skipped] == ["1"] and "no options" in bench.skipped[0].reason


def test_image_that_fails_to_decode_is_skipped_when_evaluated(tiny_model, tmp_path):
    png = image_bytes()
    path = write_tsv(
        tmp_path / "hr.tsv", [hr_row(0, "A", 0, b64(png)), hr_row(1, "A", 1, b64(png[: len(png) // 2]))]
    )
    bench = load_benchmark(path)
    assert len(bench.rows) == 2 and not bench.skipped  # the header reads fine; the pixels do not
    vlm = load(tiny_model)  # asked whether it can resize each image
    results, skipped = run_benchmark(vlm, bench.rows, None, modes=[], progress=False)  # type: ignore[arg-type]
    assert [r.row.id for r in results] == ["0"]
    assert [(s.row, s.id) for s in skipped] == [(1, "1")] and "fails to decode" in skipped[0].reason


def test_five_options_are_lettered_and_too_many_are_reported(tiny_model):
    five = ["a", "b", "c", "d", "e"]
    assert "E . e" in question_text("Which?", five)  # MME-RealWorld asks with five options
    many = [f"o{i}" for i in range(27)]
    rows = [
        BenchmarkRow(0, "q0", Question("Which?", five, "E", lambda: Image.new("RGB", (8, 8)))),
        BenchmarkRow(1, "q1", Question("Which?", many, "A", lambda: Image.new("RGB", (8, 8)))),
    ]
    vlm = load(tiny_model)  # asked whether it can resize each image
    results, skipped = run_benchmark(vlm, rows, None, modes=[], progress=False)  # type: ignore[arg-type]
    assert [r.row.id for r in results] == ["q0"]
    assert [(s.row, s.id) for s in skipped] == [(1, "q1")] and "27 options" in skipped[0].reason


def test_missing_or_wrong_benchmark_paths_name_the_expected_format(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.tsv.*does not exist.*expected one of.*HR-Bench"):
        load_benchmark(tmp_path / "missing.tsv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"neither test_questions.jsonl nor direct_attributes"):
        load_benchmark(tmp_path / "empty")
    bad = tmp_path / "bad.tsv"
    bad.write_text("a\tb\n1\t2\n")
    with pytest.raises(
        ConfigError, match=r"header lacks \['question', 'answer', \"options \(columns A, B, \.\.\."
    ):
        load_benchmark(bad)
    (tmp_path / "list.json").write_text('{"not": "a list"}')
    with pytest.raises(ConfigError, match="not a list; expected MME-RealWorld JSON"):
        load_benchmark(tmp_path / "list.json")
    with pytest.raises(ConfigError, match="is not an existing folder; format vstar"):
        load_benchmark(bad, format="vstar")


# ---------------------------------------------------------------------------------------------
# MME-RealWorld and the project's jsonl


def test_every_format_checks_its_questions_the_same_way():
    def image():
        raise AssertionError("a question is checked without its image")

    question = make_question(" Which? ", [" red ", "blue"], " b ", image, "colour")
    assert (question.question, question.options, question.answer, question.category) == (
        "Which?",
        ("red", "blue"),
        "B",
        "colour",
    )
    for text, options, answer, reason in [
        ("  ", ["a", "b"], "A", "no question text"),
        ("q", ["a"], "A", "at least 2 options"),
        ("q", [str(i) for i in range(27)], "A", "at most 26"),
        ("q", ["a", " "], "A", "an option is empty"),
        ("q", ["a", "b"], "C", "not one of the option letters AB"),
        ("q", ["a", "b"], "AB", "not one of the option letters AB"),
    ]:
        with pytest.raises(RowError, match=reason):
            make_question(text, options, answer, image)


def test_lines_are_numbered_from_1_with_byte_offsets_past_a_bom(tmp_path):
    path = tmp_path / "rows.tsv"
    path.write_bytes(b"\xef\xbb\xbfhead\r\n\nr\xc3\xa9\n\xff")
    assert list(read_lines(path)) == [
        (1, 3, b"head\r\n"),
        (2, 9, b"\n"),
        (3, 10, b"r\xc3\xa9\n"),
        (4, 14, b"\xff"),
    ]
    assert utf8_text(b"r\xc3\xa9") == "ré"
    with pytest.raises(RowError, match="not UTF-8"):
        utf8_text(b"\xff")


def test_mme_realworld_json(tmp_path):
    (tmp_path / "images" / "diagram_and_table").mkdir(parents=True)
    (tmp_path / "images" / "diagram_and_table" / "cons9.jpg").write_bytes(image_bytes(fmt="JPEG"))
    choices = ["(A) 458", "(B) 457", "(C) 456", "(D) 455", "(E) This image doesn't feature the data."]
    item = {
        "Question_id": "perception/diagram_and_table/diagram/0558",
        "Image": "diagram_and_table/cons9.jpg",
        "Text": "What is the data of Interest in Feb-23 in the table?",
        "Question Type": "Multiple Choice",
        "Answer choices": choices,
        "Ground truth": "B",
        "Category": "diagram",
        "Subtask": "Diagram and Table",
        "Task": "Perception",
    }
    attribute = item | {"Question_id": "p/m/1", "Category": "Person/attribute/color", "Subtask": "Monitoring"}
    path = tmp_path / "MME_RealWorld.json"
    path.write_text(json.dumps([item, attribute, item | {"Question_id": "x", "Image": "nowhere.jpg"}]))
    bench = load_benchmark(path, image_root=tmp_path / "images")
    assert bench.format == "mme_realworld" and len(bench.rows) == 2
    row = bench.rows[0]
    assert row.question.options == ("458", "457", "456", "455", "This image doesn't feature the data.")
    assert row.question.answer == "B" and row.question.image.size == (64, 48)
    assert row.groups == {
        "task": "Perception",
        "subtask": "Perception/Diagram and Table",
        "category": "Perception/Diagram and Table/diagram",
    }
    assert bench.rows[1].groups["category"] == "Perception/Monitoring/person/attribute"
    assert [(s.id, "not found" in s.reason) for s in bench.skipped] == [("x", True)]


def test_project_jsonl(tmp_path):
    (tmp_path / "a.png").write_bytes(image_bytes())
    good = {"question_id": "q0", "image": "a.png", "question": "Colour?", "options": OPTIONS, "answer": "B"}
    rows = [good | {"category": "colour", "needs_zoom": True}, good | {"question_id": "q1", "answer": "Z"}]
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    bench = load_benchmark(path)
    assert bench.format == "jsonl"
    assert [(r.id, r.question.answer, r.question.kind) for r in bench.rows] == [("q0", "B", "detail")]
    assert bench.rows[0].groups == {"category": "colour", "kind": "detail"}
    assert [s.id for s in bench.skipped] == ["q1"] and "not one of the letters" in bench.skipped[0].reason


# ---------------------------------------------------------------------------------------------
# Answers and scores


@pytest.mark.parametrize(
    "text, expected",
    [
        ("B", "B"),
        ("(B)", "B"),
        ("B.", "B"),
        ("b", "B"),
        ("Answer: C", "C"),
        ("The best answer is: D", "D"),
        ("The answer is (C).", "C"),
        ("B. red", "B"),  # the label, not the option text it quotes
        ("(D) the white one", "D"),
        ("B<|im_end|>", "B"),
        ("<answer>blue</answer><|im_end|>", "B"),
        ("<answer>C</answer>", "C"),
        ("It is green.", "C"),
        ("blue", "B"),
        ("", None),
        ("<|im_end|>", None),
        ("I cannot tell.", None),
        ("red or blue", None),  # two options named: no answer
        ("E", None),  # not an option
        ("<answer>purple</answer>", None),
        ("A man holds the glove", None),  # an article is not a label
    ],
)
def test_extract_choice(text, expected):
    assert extract_choice(text, OPTIONS) == expected


def test_hrbench_score_averages_accuracy_over_cycles():
    records = [
        ("0", "single", True),
        ("0", "single", True),
        ("0", "cross", False),
        ("0", "cross", True),
        ("1", "single", False),
        ("1", "single", True),
        ("1", "cross", False),
        ("1", "cross", False),
        ("2", "single", True),  # a cycle without cross questions
    ]
    score = hrbench_score(records)
    assert list(score["cycles"]) == ["0", "1", "2"]
    assert score["cycles"]["0"] == {"all": 0.75, "cross": 0.5, "single": 1.0}
    assert score["cycles"]["1"] == {"all": 0.25, "cross": 0.0, "single": 0.5}
    assert score["average"]["all"] == pytest.approx((0.75 + 0.25 + 1.0) / 3)
    assert score["average"]["single"] == pytest.approx((1.0 + 0.5 + 1.0) / 3)
    assert score["average"]["cross"] == pytest.approx(0.25)  # over the two cycles that have it


def test_scores_count_unanswered_and_tool_use():
    def result(cycle, category, predicted, answer="A", calls=0, errors=0):
        stats = ToolStats(calls, calls - errors)
        if errors:
            stats.errors["bad_json"] = errors
        question = Question("q", OPTIONS, answer, lambda: Image.new("RGB", (8, 8)))
        row = BenchmarkRow(0, "id", question, {"category": category, "cycle_category": cycle})
        ended = "answer" if predicted else "truncated"
        outcome = Outcome(predicted, predicted == answer, calls > 0, stats, 1 + calls, 5, ended, "")
        return RowResult(row, {"auto": outcome})

    results = [
        result("0", "single", "A", calls=1),
        result("0", "cross", None),
        result("1", "single", "B", calls=2, errors=1),
        result("1", "cross", "A"),
    ]
    scores = score_results(results, ["auto"], "hrbench")["auto"]
    assert scores["accuracy"] == 0.5 and scores["scored"] == 4 and scores["correct"] == 2
    assert scores["unanswered"] == 1 and scores["answered"] == 3
    assert scores["tool_ratio"] == 0.5 and scores["tool_calls"] == 3 and scores["tool_errors"] == 1
    assert scores["tool_error_kinds"] == {"bad_json": 1}
    assert scores["accuracy_with_tool"] == 0.5 and scores["accuracy_without_tool"] == 0.5
    assert scores["ended"] == {"answer": 3, "truncated": 1}
    assert scores["groups"]["category"]["cross"] == {
        "n": 2,
        "accuracy": 0.5,
        "unanswered": 1,
        "tool_ratio": 0.0,
    }
    assert scores["score"] == scores["hrbench"]["average"]["all"] == 0.5


# ---------------------------------------------------------------------------------------------
# End to end


@pytest.fixture(scope="module")
def tiny_model():
    return resolve_model(None)  # the shipped base


def test_outcomes_follow_the_conversation(tiny_model, tmp_path, monkeypatch):
    """A scripted model (a crop, then "B") on three rows whose right answers are A, B, B."""
    vlm = load(tiny_model)
    turns = iter([tool_call_text((0.0, 0.0, 0.5, 0.5)), "B<|im_end|>"])

    def generate(batch, max_new_tokens, keys=None, **kwargs):
        ids = vlm.segment(next(turns)).token_ids
        rows = batch["input_ids"].shape[0]
        prefill = int(batch["attention_mask"].sum())
        return Generation([list(ids)] * rows, [torch.zeros(len(ids))] * rows, [True] * rows, prefill)

    monkeypatch.setattr(vlm, "generate", generate)
    good = b64(image_bytes())
    path = write_tsv(tmp_path / "hr.tsv", [hr_row(i, answer, i, good) for i, answer in enumerate("ABB")])
    results, skipped = run_benchmark(
        vlm, load_benchmark(path).rows, ToolRolloutConfig(), ["auto"], progress=False
    )
    assert not skipped
    outcomes = [r.outcomes["auto"] for r in results]
    assert [o.predicted for o in outcomes] == ["B", "B", "B"]
    assert [o.correct for o in outcomes] == [False, True, True]
    assert all(o.used_tool and o.turns == 2 and o.ended == "answer" for o in outcomes)
    scores = score_results(results, ["auto"], "hrbench")["auto"]
    assert (
        scores["accuracy"] == pytest.approx(2 / 3)
        and scores["tool_ratio"] == 1.0
        and scores["tool_calls"] == 3
    )


def test_eval_vlm_end_to_end(tiny_model, tmp_path, capsys):
    assert "vlm" in EVALUATORS
    good = b64(image_bytes())
    rows = [
        hr_row(0, "A", 0, good),
        hr_row(1, "B", 1, good, category="cross"),
        hr_row(2, "C", 2, "%%%"),  # bad base64: reported and skipped
        hr_row(3, "D", 3, good),
        hr_row(4, "A", 0, good),  # past limit=4
    ]
    path = write_tsv(tmp_path / "hr_bench_4k.tsv", rows)
    out = tmp_path / "out"
    args = [f"benchmark={path}", f"model={tiny_model}", "modes=[auto,never]", "limit=4", f"output_dir={out}"]
    args += ["rollout.max_new_tokens=6", "rollout.max_turns=2", "progress=false", "device=cpu"]
    assert main(["eval", "vlm", *args]) == 0
    printed = capsys.readouterr()
    assert "skipped at load: row 2 (2), line 4: image is not valid base64" in printed.err
    assert "rows: 4 read, 1 skipped, 3 scored" in printed.out
    assert "accuracy per cycle_category, averaged (HR-Bench)" in printed.out
    report = json.loads((out / "eval_vlm.json").read_text())
    assert report["rows_read"] == 4 and report["scored"] == 3 and report["skipped"] == 1
    assert report["skipped_rows"][0]["row"] == 2 and report["skipped_rows"][0]["line"] == 4
    assert "base64" in report["skipped_rows"][0]["reason"]
    for mode in ("auto", "never"):
        r = report["results"][mode]
        assert r["scored"] == 3 and r["answered"] + r["unanswered"] == 3
        assert set(r["hrbench"]["cycles"]) == {"0", "1", "3"}
        assert set(r["groups"]["category"]) == {"single", "cross"}
    assert report["results"]["never"]["tool_calls"] == 0
    predictions = [json.loads(line) for line in (out / "eval_vlm_predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 6 and {p["mode"] for p in predictions} == {"auto", "never"}


def test_eval_vlm_checks_device_and_output_dir_before_any_work(tmp_path, capsys):
    path = write_tsv(tmp_path / "hr.tsv", [hr_row(0, "A", 0, b64(image_bytes()))])
    (tmp_path / "taken").write_text("a file")
    args = ["eval", "vlm", f"benchmark={path}", f"model={tmp_path / 'no_model'}"]  # never reached
    assert main([*args, f"output_dir={tmp_path / 'taken'}", "device=cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config error: output_dir =") and "is a file" in err
    assert main([*args, f"output_dir={tmp_path / 'out'}", "device=cuda:99"]) == 2
    err = capsys.readouterr().err
    assert "device = 'cuda:99' does not exist on this machine" in err and err.count("\n") == 1


def test_eval_vlm_config_errors(tmp_path, capsys):
    assert main(["eval", "vlm"]) == 2
    assert "benchmark is empty" in capsys.readouterr().err
    assert main(["eval", "vlm", f"benchmark={tmp_path / 'nope.tsv'}", f"output_dir={tmp_path / 'out'}"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["eval", "vlm", "benchmark=x.tsv", "modes=[sometimes]"]) == 2
    assert "modes" in capsys.readouterr().err
