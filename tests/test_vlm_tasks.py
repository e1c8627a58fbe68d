import contextlib
import json
import re
from collections import Counter
from itertools import combinations

import numpy as np
import pytest

from vlm_rl.question_jsonl import read_benchmark, read_row, write_benchmark
from vlm_rl.readability import readability
from vlm_rl.tasks import (
    BACKGROUND,
    CATEGORIES,
    COLOURS,
    LETTERS,
    REGIONS,
    SHAPES,
    TaskConfig,
    heldout_pairs,
    make_example,
    make_examples,
    region_of,
    view,
)

GAP = 0.03  # the least distance between two objects' boxes that the scene rules promise
CELL_MARGIN = 0.02


def pixels(example) -> np.ndarray:
    return np.asarray(example.image)


def truth(example) -> str:
    obj = example.objects[example.target]
    return obj.colour if example.category == "global_colour" else obj.shape


def test_the_palette_is_the_one_the_shipped_base_was_trained_on():
    """The shipped base reads these colours and shapes; changing one changes every image it sees."""
    assert COLOURS == {
        "red": (0.90, 0.16, 0.16),
        "green": (0.18, 0.78, 0.22),
        "blue": (0.20, 0.36, 0.95),
        "yellow": (0.95, 0.88, 0.18),
        "purple": (0.62, 0.24, 0.86),
        "white": (0.94, 0.94, 0.94),
    }
    assert list(COLOURS) == ["red", "green", "blue", "yellow", "purple", "white"]  # the draw order
    assert BACKGROUND == (0.12, 0.12, 0.12)
    assert SHAPES == ("circle", "square", "triangle", "cross")
    corner = np.asarray(make_example(0).image)[0, 0]
    assert corner.tolist() == [round(255 * v) for v in BACKGROUND]


def test_same_seed_and_index_give_the_same_example():
    example = make_example(5, seed=3)
    again = make_example(5, seed=3)
    assert example == again and np.array_equal(pixels(example), pixels(again))
    assert make_examples(8, seed=3)[5] == example
    assert make_examples(2, seed=3, start=5)[0] == example
    assert make_example(6, seed=3).objects != example.objects
    assert make_example(5, seed=4).objects != example.objects
    # the scene does not depend on how often questions are about details
    assert make_example(5, seed=3, config=TaskConfig(detail_fraction=1.0)).objects == example.objects


def test_heldout_pairs_have_distinct_colours_and_shapes():
    pairs = heldout_pairs(0)
    assert len(pairs) == 4 == len({c for c, _ in pairs}) == len({s for _, s in pairs})
    assert pairs == heldout_pairs(0) and pairs != heldout_pairs(1)


def test_splits_are_disjoint():
    train = make_examples(150, seed=0, split="train")
    heldout = make_examples(150, seed=0, split="heldout")
    held_out = set(heldout_pairs(0))
    assert not {e.id for e in train} & {e.id for e in heldout}
    for example in train:
        assert not any((o.colour, o.shape) in held_out for o in example.objects if o.large)
    for example in heldout:  # so no held-out image can be a train image
        assert any((o.colour, o.shape) in held_out for o in example.objects if o.large)
        if not example.needs_zoom:
            target = example.objects[example.target]
            assert (target.colour, target.shape) in held_out
    images = {pixels(e).tobytes() for e in train}
    assert not any(pixels(e).tobytes() in images for e in heldout)


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_answer_letter_points_at_the_true_option(split):
    examples = make_examples(300, seed=1, split=split)
    for example in examples:
        assert len(example.options) == 4 == len(set(example.options))
        family = set(COLOURS) if example.category == "global_colour" else set(SHAPES)
        assert set(example.options) <= family
        assert example.answer in LETTERS and example.answer_text == truth(example)
        assert example.category in CATEGORIES
        assert example.needs_zoom == (example.kind == "detail") == (example.category == "detail_shape")
    letters = Counter(example.answer for example in examples)
    assert set(letters) == set(LETTERS) and min(letters.values()) > 0.15 * len(examples)


def test_target_box_frames_the_object_asked_about():
    for example in make_examples(200, seed=2, config=TaskConfig(detail_fraction=0.5)):
        obj = example.objects[example.target]
        if example.needs_zoom:
            region = region_of(obj.x, obj.y)
            assert not obj.large and example.target_box == REGIONS[region]
            assert f"in {region} of" in example.question
            x1, y1, x2, y2 = example.target_box
            assert x1 <= obj.box[0] and y1 <= obj.box[1] and obj.box[2] <= x2 and obj.box[3] <= y2
        else:
            assert obj.large and example.target_box == obj.box
            assert "large" in example.question


def test_detail_fraction_is_respected():
    share = np.mean([e.needs_zoom for e in make_examples(600, seed=4)])
    assert abs(share - 0.3) < 0.06
    assert not any(e.needs_zoom for e in make_examples(50, seed=4, config=TaskConfig(detail_fraction=0.0)))
    assert all(e.needs_zoom for e in make_examples(50, seed=4, config=TaskConfig(detail_fraction=1.0)))


def test_objects_keep_apart_and_each_region_holds_at_most_one_small_object():
    for example in make_examples(300, seed=5):
        for a, b in combinations(example.objects, 2):
            dx = max(a.box[0] - b.box[2], b.box[0] - a.box[2])
            dy = max(a.box[1] - b.box[3], b.box[1] - a.box[3])
            assert max(dx, dy) >= GAP - 1e-9, (example.id, a, b)
        small = [o for o in example.objects if not o.large]
        assert 1 <= len(small) <= 6 and 1 <= len(example.objects) - len(small) <= 3
        regions = [region_of(o.x, o.y) for o in small]
        assert len(regions) == len(set(regions))
        for obj, region in zip(small, regions, strict=True):
            x1, y1, x2, y2 = REGIONS[region]
            assert x1 + CELL_MARGIN <= obj.box[0] and obj.box[2] <= x2 - CELL_MARGIN
            assert y1 + CELL_MARGIN <= obj.box[1] and obj.box[3] <= y2 - CELL_MARGIN
        large = [o for o in example.objects if o.large]
        assert len({o.colour for o in large}) == len({o.shape for o in large}) == len(large)
        assert all(0 < v < 1 for o in large for v in o.box)


def test_image_shows_each_object_in_its_colour():
    example = make_example(0, seed=6, config=TaskConfig(canvas_size=224))
    image = pixels(example)
    assert image.shape == (224, 224, 3) and image.dtype == np.uint8
    for obj in example.objects:  # every shape covers its box centre
        colour = image[int(obj.y * 224), int(obj.x * 224)]
        assert np.abs(colour.astype(int) - np.round(255 * np.array(COLOURS[obj.colour]))).max() <= 1


def test_small_shapes_need_a_zoom_and_large_ones_do_not():
    detail = make_examples(200, seed=11, config=TaskConfig(detail_fraction=1.0))
    global_ = make_examples(100, seed=11, config=TaskConfig(detail_fraction=0.0))
    result = readability(detail + global_)
    assert result.n_detail == 200 and result.n_global == 100
    assert result.detail_overview <= 0.5  # about chance (0.25): a 2-4 px blob
    assert result.detail_crop >= 0.9
    assert result.global_shape >= 0.95 and result.global_colour == 1.0 and result.colour_error < 0.05
    # result.detail_overview_matched is close to 1: a reader that inverts the known rendering still
    # reads the shape from the noise-free overview (see the vlm_rl.readability docstring)


def test_view_keeps_aspect_and_checks_boxes():
    image = make_example(0).image
    assert view(image).size == (112, 112) and view(image, REGIONS["row 1 column 1"]).size == (112, 112)
    assert view(image, (0.0, 0.0, 0.5, 0.25), 112).size == (112, 56)
    with pytest.raises(ValueError, match="box must satisfy"):
        view(image, (0.5, 0.0, 0.2, 1.0))


def test_config_and_arguments_are_checked():
    with pytest.raises(ValueError, match="detail_fraction"):
        TaskConfig(detail_fraction=1.5)
    with pytest.raises(ValueError, match="canvas_size"):
        TaskConfig(canvas_size=16)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        make_example(0, split="test")
    with pytest.raises(ValueError, match="index and seed"):
        make_example(-1)


def test_benchmark_round_trip(tmp_path):
    examples = make_examples(8, seed=7, config=TaskConfig(detail_fraction=0.5))
    assert {e.kind for e in examples} == {"global", "detail"}
    path = write_benchmark(examples, tmp_path / "bench")
    questions = read_benchmark(path)
    assert len(questions) == len(examples)
    for example, question in zip(examples, questions, strict=True):
        assert question.question_id == example.id and question.question == example.question
        assert question.options == example.options and question.answer == example.answer
        assert question.category == example.category and question.needs_zoom == example.needs_zoom
        assert question.target_box == example.target_box
        assert question.image_path == tmp_path / "bench" / "images" / f"{example.id}.png"
        assert np.array_equal(np.asarray(question.image), pixels(example))


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda row: row.pop("options"), "no 'options'"),
        (lambda row: row.update(options=[]), "no 'options'"),
        (lambda row: row.update(options="A B C D"), "'options' must be a list"),
        (lambda row: row.update(image="images/missing.png"), "image 'images/missing.png' not found"),
        (
            lambda row: row.update(image="../../../../etc/passwd"),
            "image '../../../../etc/passwd' leads outside",
        ),
        (lambda row: row.update(image="/etc/passwd"), "image '/etc/passwd' leads outside"),
        (lambda row: row.update(answer="E"), "answer 'E' is not one of the letters ABCD"),
        (lambda row: row.update(answer="AB"), "answer 'AB' is not one of the letters ABCD"),
        (lambda row: row.update(answer=1), "'answer' must be a string"),
        (lambda row: row.update(needs_zoom="yes"), "'needs_zoom' must be"),
        (lambda row: row.update(target_box=[0.5, 0, 0.2, 1]), "'target_box' must satisfy"),
    ],
)
def test_bad_rows_raise_errors_that_name_the_row(tmp_path, change, problem):
    path = write_benchmark(make_examples(3, seed=8), tmp_path)
    lines = path.read_text().splitlines()
    row = json.loads(lines[2])
    change(row)
    lines[2] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"row 2 (question_id='zoom-train-8-000002'): {problem}")):
        read_benchmark(path)
    # a caller that wants to skip bad rows reads them one by one
    kept = []
    for index, line in enumerate(path.read_text().splitlines()):
        with contextlib.suppress(ValueError):
            kept.append(read_row(line, index, tmp_path))
    assert [q.question_id for q in kept] == ["zoom-train-8-000000", "zoom-train-8-000001"]


@pytest.mark.parametrize(
    ("line", "problem"), [("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object")]
)
def test_unreadable_rows_name_the_row(tmp_path, line, problem):
    with pytest.raises(ValueError, match=f"row 4: {problem}"):
        read_row(line, 4, tmp_path)
