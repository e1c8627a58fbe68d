import json
import random

import pytest
from PIL import Image

from vlm_rl.tools import (
    ERROR_KINDS,
    EXAMPLE_CALL,
    CropSettings,
    ImageStore,
    Observation,
    ToolCall,
    ToolError,
    ToolStats,
    first_tool_call,
    parse_tool_calls,
)

WIDTH, HEIGHT = 240, 200


def coded_image(width: int = WIDTH, height: int = HEIGHT) -> Image.Image:
    """Pixel (x, y) is (x, y, 0), so a crop's corners reveal where it was cut from."""
    data = bytes(value for y in range(height) for x in range(width) for value in (x, y, 0))
    return Image.frombytes("RGB", (width, height), data)


def tool_text(bbox, name="crop", **extra) -> str:
    """A call with `bbox` (a list, or raw JSON text) and `extra` arguments given as raw JSON text."""
    bbox = bbox if isinstance(bbox, str) else json.dumps(bbox)
    arguments = ", ".join([f'"bbox_2d": {bbox}', *(f'"{k}": {v}' for k, v in extra.items())])
    return f'<tool_call>{{"name": "{name}", "arguments": {{{arguments}}}}}</tool_call>'


def run(store: ImageStore, text: str, **kwargs) -> Observation:
    call = first_tool_call(text)
    assert call is not None
    return store.crop(call, **kwargs)


def assert_pixels_match(observation: Observation):
    """The crop's corner pixels are the original pixels at its box's corners."""
    x1, y1, x2, y2 = observation.box
    image = observation.image
    assert image.size == (x2 - x1, y2 - y1)
    assert image.getpixel((0, 0)) == (x1, y1, 0)
    assert image.getpixel((image.width - 1, image.height - 1)) == (x2 - 1, y2 - 1, 0)


# ---------------------------------------------------------------------------------------------
# Parsing


def test_parses_a_plain_call():
    text = 'Let me look closer. <tool_call>{"name": "crop", "arguments": {"bbox_2d": [0.1, 0.2, 0.5, 0.6]}}'
    assert first_tool_call(text + "</tool_call>") == ToolCall("crop", (0.1, 0.2, 0.5, 0.6))


def test_parses_spaced_out_json_and_the_alias():
    text = (
        '< tool_call >\n { " name " : " zoom _ in " , " arguments " : {'
        ' " bbox_2d " : [ 0 . 25 , 0.5 , 1 , 1 ] , " image_index " : - 1 , " label " : " the red sign " } }'
        "\n</ tool_call >"
    )
    call = first_tool_call(text)
    assert call == ToolCall("zoom_in", (0.25, 0.5, 1.0, 1.0), image_index=-1, label=" the red sign ")


def test_no_call_and_several_calls():
    assert first_tool_call("The answer is (B).") is None
    assert parse_tool_calls("<answer>B</answer>") == []
    text = tool_text([1, 2, 30, 40]) + " then " + tool_text([0, 0, 0.5, 0.5], name="zoom_in", image_index=1)
    first, second = parse_tool_calls(text)
    assert first == ToolCall("crop", (1, 2, 30, 40))
    assert second == ToolCall("zoom_in", (0, 0, 0.5, 0.5), image_index=1)


def test_an_unclosed_tag_ends_the_calls():
    calls = parse_tool_calls(tool_text([0, 0, 1, 1]) + '<tool_call>{"name": "crop"' + tool_text([0, 0, 1, 1]))
    assert isinstance(calls[0], ToolCall)
    assert [call.kind for call in calls[1:]] == ["bad_json"]  # the open tag swallowed the next call
    calls = parse_tool_calls(tool_text([0, 0, 1, 1]) + '<tool_call>{"name": "crop"')
    assert isinstance(calls[0], ToolCall)
    assert [call.kind for call in calls[1:]] == ["unclosed_tag"]


ERROR_CASES = [
    ('<tool_call>{"name": "crop", "arguments": {"bbox_2d": [1, 2, 3, 4]}}', "unclosed_tag"),
    ('{"name": "crop", "arguments": {"bbox_2d": [1, 2, 3, 4]}}</tool_call>', "unopened_tag"),
    (
        '</tool_call><tool_call>{"name": "crop", "arguments": {"bbox_2d": [1, 2, 3, 4]}}</tool_call>',
        "unopened_tag",
    ),
    ('<tool_call>{"name": "crop", "arguments": {"bbox_2d": [1, 2, 3, 4]}</tool_call>', "bad_json"),
    ("<tool_call>crop(0, 0, 1, 1)</tool_call>", "bad_json"),
    ("<tool_call>__import__('os').system('ls')</tool_call>", "bad_json"),
    ("<tool_call></tool_call>", "bad_json"),
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "bad_json"),
    ("<tool_call>[0, 0, 1, 1]</tool_call>", "not_object"),
    ('<tool_call>"crop"</tool_call>', "not_object"),
    (tool_text([0, 0, 1, 1], name="rotate"), "unknown_tool"),
    ('<tool_call>{"name": "crop"}</tool_call>', "missing_key"),
    ('<tool_call>{"name": "crop", "arguments": {}}</tool_call>', "missing_key"),
    ('<tool_call>{"name": "crop", "arguments": {"bbox_2d": [0, 0, 1, 1]}, "id": 3}</tool_call>', "extra_key"),
    (tool_text([0, 0, 1, 1], scale=2), "extra_key"),
    ('<tool_call>{"name": 7, "arguments": {"bbox_2d": [0, 0, 1, 1]}}</tool_call>', "wrong_type"),
    ('<tool_call>{"name": "crop", "arguments": [0, 0, 1, 1]}</tool_call>', "wrong_type"),
    (tool_text([0, 0, 1, 1], label=5), "wrong_type"),
    (tool_text([0, 0, 1]), "bad_bbox"),
    (tool_text([0, 0, 1, 1, 1]), "bad_bbox"),
    ('<tool_call>{"name": "crop", "arguments": {"bbox_2d": "0 0 1 1"}}</tool_call>', "bad_bbox"),
    ('<tool_call>{"name": "crop", "arguments": {"bbox_2d": [0, 0, "1", 1]}}</tool_call>', "bad_bbox"),
    ('<tool_call>{"name": "crop", "arguments": {"bbox_2d": [0, 0, true, 1]}}</tool_call>', "bad_bbox"),
    ('<tool_call>{"name": "crop", "arguments": {"bbox_2d": [[0, 0], [1, 1]]}}</tool_call>', "bad_bbox"),
    ('<tool_call>{"name": "crop", "arguments": {"bbox_2d": [0, 0, NaN, 1]}}</tool_call>', "non_finite"),
    ('<tool_call>{"name": "crop", "arguments": {"bbox_2d": [0, 0, Infinity, 1]}}</tool_call>', "non_finite"),
    (tool_text("[0, 0, 1e999, 1]"), "non_finite"),
    (tool_text(f"[0, 0, 1{'0' * 400}, 1]"), "non_finite"),  # an integer beyond float range
    (tool_text([0.5, 0, 0.5, 1]), "empty_box"),
    (tool_text([0, 0.3, 1, 0.3]), "empty_box"),
    (tool_text([0.6, 0, 0.5, 1]), "inverted_box"),
    (tool_text([0, 0.4, 1, 0.3]), "inverted_box"),
    (tool_text([300, 10, 400, 50]), "outside_image"),
    (tool_text([-50, -50, -10, -10]), "outside_image"),
    (tool_text([10, 10, 30, 30], image_index=1), "bad_image_index"),
    (tool_text([10, 10, 30, 30], image_index=-2), "bad_image_index"),
    (tool_text([10, 10, 30, 30], image_index=0.5), "bad_image_index"),
    (tool_text([10, 10, 30, 30], image_index='"0"'), "bad_image_index"),
    (tool_text([10, 10, 30, 30], image_index="true"), "bad_image_index"),
]


@pytest.mark.parametrize(("text", "kind"), ERROR_CASES)
def test_every_mistake_is_an_error_observation(text, kind):
    observation = run(ImageStore(coded_image()), text)
    assert observation.error == kind
    assert observation.image is None and observation.box is None
    assert EXAMPLE_CALL in observation.text  # the model is shown how a correct call looks


def test_error_cases_cover_every_kind():
    # too_thin needs an image over 200 x min_size wide: test_a_crop_too_thin_for_the_model_is_an_error...
    assert {kind for _, kind in ERROR_CASES} | {"too_thin"} == set(ERROR_KINDS)


def test_unknown_tool_names_the_tools():
    error = first_tool_call(tool_text([0, 0, 1, 1], name="x" * 1000))
    assert error.kind == "unknown_tool"
    assert '"crop", "zoom_in"' in error.message
    assert len(error.message) < 300  # a runaway name is not echoed in full


def test_mutated_calls_never_raise():
    rng = random.Random(0)
    valid = tool_text([0.25, 0.5, 0.75, 1.0], name="zoom_in", image_index=-1, label='"sign"')
    alphabet = '{}[]":,.-+eE0123456789 \n\\<>/_nameNaIfity' + "\x00\u00e9\ud800"
    seen = set()
    for _ in range(400):
        chars = list(valid)
        for _ in range(rng.randint(1, 6)):
            position = rng.randrange(len(chars))
            operation = rng.choice(["insert", "delete", "replace"])
            if operation == "delete" and len(chars) > 1:
                del chars[position]
            elif operation == "insert":
                chars.insert(position, rng.choice(alphabet))
            else:
                chars[position] = rng.choice(alphabet)
        text = "".join(chars)
        if rng.random() < 0.3:  # byte-level damage, decoded the way a tokenizer would
            raw = bytearray(text.encode("utf-8", "surrogatepass"))
            raw[rng.randrange(len(raw))] = rng.randrange(256)
            text = raw.decode("utf-8", "replace")
        store = ImageStore(coded_image(40, 30))
        for call in parse_tool_calls(text):
            assert isinstance(call, ToolCall | ToolError)
            observation = store.crop(call)
            seen.add(observation.error)
    assert None in seen and len(seen) > 5  # the fuzzing reached both crops and several error kinds


# ---------------------------------------------------------------------------------------------
# Coordinates


@pytest.mark.parametrize(
    ("bbox", "space", "expected"),
    [
        ([0.25, 0.5, 0.75, 1.0], "auto", (60, 100, 180, 200)),  # all in [0, 1]: normalised
        ([0.25, 0.5, 0.75, 1.0], "normalized", (60, 100, 180, 200)),
        ([30, 40, 90, 100], "auto", (30, 40, 90, 100)),  # beyond 1: pixels
        ([30, 40, 90, 100], "pixels", (30, 40, 90, 100)),
        ([0, 0, 1, 1], "pixels", (0, 0, 28, 28)),  # explicitly pixels: grown to min_size
        ([0.1, 0.3, 0.35, 0.45], "normalized", (24, 60, 84, 90)),  # float noise does not add a pixel
    ],
)
def test_coordinate_spaces(bbox, space, expected):
    store = ImageStore(coded_image(), CropSettings(coordinate_space=space))
    observation = run(store, tool_text(bbox))
    assert observation.box == expected
    assert observation.text == f"Image 1: crop of [{', '.join(map(str, expected))}] (original pixels)."
    assert_pixels_match(observation)


def test_resized_coordinates_map_back_to_each_images_own_size():
    store = ImageStore(coded_image(), CropSettings(coordinate_space="resized"))
    # the processor showed the 240x200 original at 480x400 and the 120x100 crop at 240x200
    first = run(store, tool_text([120, 100, 360, 300]), resized_sizes=[(480, 400)])
    assert first.box == (60, 50, 180, 150)
    second = run(store, tool_text([40, 20, 100, 80], image_index=1), resized_sizes=[(480, 400), (240, 200)])
    assert second.box == (80, 60, 110, 90)
    assert_pixels_match(second)
    with pytest.raises(ValueError, match="resized"):  # a caller bug, not a model mistake
        run(store, tool_text([0, 0, 50, 50]))


def test_crop_of_a_crop_is_cut_from_the_original_pixels():
    store = ImageStore(coded_image())
    first = run(store, tool_text([40, 20, 200, 180]))
    assert first.box == (40, 20, 200, 180)
    second = run(store, tool_text([0.5, 0.25, 1.0, 0.75], image_index=1))
    assert second.box == (120, 60, 200, 140)
    assert second.text.startswith("Image 2:")
    third = run(store, tool_text([10, 10, 50, 50], image_index=-1))  # pixels of the latest crop
    assert third.box == (130, 70, 170, 110)
    for observation in (first, second, third):
        assert_pixels_match(observation)
    assert len(store) == 4 and store.boxes[1:] == [first.box, second.box, third.box]
    assert store.images[3] is third.image


def test_padding_grows_each_side_and_clamps_to_the_image():
    store = ImageStore(coded_image(), CropSettings(padding=0.25))
    assert run(store, tool_text([40, 40, 80, 120])).box == (30, 20, 90, 140)
    assert run(store, tool_text([0, 0, 40, 40])).box == (0, 0, 50, 50)
    # padding of a crop of a crop may reach past the source crop into the original
    inner = run(store, tool_text([0.0, 0.0, 1.0, 1.0], image_index=1))
    assert inner.box == (15, 0, 105, 170)
    assert_pixels_match(inner)


def test_small_boxes_grow_to_min_size_around_their_centre():
    store = ImageStore(coded_image(), CropSettings(min_size=28))
    assert run(store, tool_text([100, 100, 110, 104])).box == (91, 88, 119, 116)
    # near an edge the grown box shifts back inside instead of shrinking
    assert run(store, tool_text([230, 195, 240, 200])).box == (212, 172, 240, 200)
    tiny = ImageStore(coded_image(20, 10), CropSettings(min_size=28))
    assert run(tiny, tool_text([2, 2, 5, 5])).box == (0, 0, 20, 10)  # the image is smaller than min_size
    no_minimum = ImageStore(coded_image(), CropSettings(min_size=0))
    assert run(no_minimum, tool_text([10.2, 10.2, 10.3, 10.4])).box == (10, 10, 11, 11)


def test_a_crop_too_thin_for_the_model_is_an_error_the_model_sees():
    """A full-width strip of an 8K-wide image, grown to min_size, is 7680x29: more than 200 to 1,
    which Qwen2-VL's processor refuses. It is answered as a tool error and adds no image."""
    wide = ImageStore(Image.new("RGB", (7680, 400)), CropSettings(min_size=28))
    observation = run(wide, tool_text([0, 100, 7680, 101]))
    assert not observation.ok and observation.error == "too_thin" and observation.image is None
    assert "7680x29" in observation.text and "nearer to square" in observation.text  # 28 rows, rounded out
    assert len(wide) == 1
    assert run(wide, tool_text([0, 100, 5600, 128])).ok  # 200 to 1 is still seen


def test_boxes_sticking_out_are_clamped():
    assert run(ImageStore(coded_image()), tool_text([-20, 150, 100, 260])).box == (0, 150, 100, 200)
    store = ImageStore(coded_image())
    run(store, tool_text([0, 0, 100, 100]))
    # a box beyond its source crop is clamped to that crop, not to the original
    assert run(store, tool_text([50, 50, 150, 150], image_index=1)).box == (50, 50, 100, 100)
    assert run(store, tool_text([100, 0, 150, 50], image_index=1)).error == "outside_image"


def test_non_rgb_images_are_converted():
    store = ImageStore(Image.new("RGBA", (64, 64), (1, 2, 3, 4)))
    observation = run(store, tool_text([0, 0, 0.5, 0.5]))
    assert store.images[0].mode == observation.image.mode == "RGB"
    assert observation.image.getpixel((0, 0)) == (1, 2, 3)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        CropSettings(coordinate_space="percent")
    with pytest.raises(ValueError):
        CropSettings(padding=-0.1)


# ---------------------------------------------------------------------------------------------
# Counting


def test_tool_stats_add_up_across_samples():
    per_sample = []
    for texts in ([tool_text([0, 0, 0.5, 0.5]), tool_text([0, 0, 1])], [tool_text([0.5, 0, 0.4, 1])]):
        stats, store = ToolStats(), ImageStore(coded_image())
        for text in texts:
            stats.record(run(store, text))
        per_sample.append(stats)
    total = sum(per_sample, ToolStats())
    assert (total.calls, total.successes) == (3, 1)
    metrics = total.as_metrics()
    assert metrics["tool_calls"] == 3 and metrics["tool_success_rate"] == pytest.approx(1 / 3)
    assert metrics["tool_error_bad_bbox"] == 1 and metrics["tool_error_inverted_box"] == 1
    assert set(ToolStats().as_metrics()) == set(metrics)  # the same keys at every step
