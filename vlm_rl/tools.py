"""Pixel tools for VLM rollouts: read tool calls from model text and crop the conversation's images.

A model asks for a crop by writing a tagged JSON object,

    <tool_call>{"name": "crop", "arguments": {"bbox_2d": [x1, y1, x2, y2]}}</tool_call>

(`zoom_in` is an alias of `crop`; optional arguments: `image_index`, `label`). `first_tool_call`
turns text into a `ToolCall`, and an `ImageStore` (the original image plus every crop so far) runs
it. Nothing the model writes can raise: each mistake becomes an error `Observation` whose text tells
the model what was wrong and how a correct call looks, and whose `error` kind is counted in
`ToolStats`. Model output is read with `json.loads` only, never evaluated.

Every crop remembers its box in original-image pixels and is cut from the original full-resolution
pixels, so a crop of a crop maps back to the original and loses no detail.

Typical use in a rollout loop:

    call = first_tool_call(completion)
    if call is None:                      # no tool call: the completion is a final answer
        ...
    observation = images.crop(call)       # a parse error passes straight through as an error
    stats.record(observation)
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from PIL import Image

TOOL_NAMES = ("crop", "zoom_in")  # aliases of one operation
ERROR_KINDS = (
    "unclosed_tag",  # <tool_call> without </tool_call>
    "unopened_tag",  # </tool_call> without <tool_call>
    "bad_json",  # json.loads failed
    "not_object",  # valid JSON, but not an object
    "unknown_tool",  # name is not one of TOOL_NAMES
    "missing_key",  # e.g. no "arguments" or no "bbox_2d"
    "extra_key",  # a key the tool does not take
    "wrong_type",  # name/arguments/label of the wrong JSON type
    "bad_bbox",  # bbox_2d is not a list of 4 numbers
    "non_finite",  # NaN or infinity in bbox_2d
    "empty_box",  # x1 == x2 or y1 == y2
    "inverted_box",  # x2 < x1 or y2 < y1
    "outside_image",  # nothing of the box is left after clamping to the image
    "bad_image_index",  # image_index not an integer, or no such image
    "too_thin",  # the crop's long side is more than MAX_ASPECT_RATIO times its short side
)
# Qwen2-VL's image processor (smart_resize) refuses an image whose long side is more than 200 times its
# short side, so a crop beyond it is a call the model got wrong, answered with an error, not a crash
MAX_ASPECT_RATIO = 200
CoordinateSpace = Literal["auto", "normalized", "pixels", "resized"]
Box = tuple[float, float, float, float]
PixelBox = tuple[int, int, int, int]

EXAMPLE_CALL = '<tool_call>{"name": "crop", "arguments": {"bbox_2d": [x1, y1, x2, y2]}}</tool_call>'

_OPEN = re.compile(r"<\s*tool_call\s*>", re.IGNORECASE)
_CLOSE = re.compile(r"<\s*/\s*tool_call\s*>", re.IGNORECASE)
# a word-level tokenizer may decode "-0.5" as "- 0 . 5"; glue such numbers back together
_SPACED_MINUS = re.compile(r"-\s+(?=[\d.])")
_SPACED_POINT = re.compile(r"(?<=\d)\s*\.\s*(?=\d)")
_ARGUMENT_KEYS = ("bbox_2d", "image_index", "label")
_EPS = 1e-6  # float noise allowed when rounding boxes to whole pixels


@dataclass(frozen=True)
class ToolCall:
    """A well-formed crop request; `bbox` is still in the coordinates the model wrote."""

    name: str
    bbox: Box
    image_index: int = 0  # 0 = the original, crops are 1, 2, ...; negative counts from the latest
    label: str | None = None  # free text, ignored


@dataclass(frozen=True)
class ToolError:
    """A call the model got wrong: `kind` (one of ERROR_KINDS) is counted, `message` is shown to it."""

    kind: str
    message: str


@dataclass(frozen=True)
class Observation:
    """What goes back to the model after a call: a crop and a caption, or an error message."""

    text: str
    image: Image.Image | None = None
    box: PixelBox | None = None  # the crop in original-image pixels
    error: str | None = None  # the error kind, for counting

    @property
    def ok(self) -> bool:
        return self.error is None


# ---------------------------------------------------------------------------------------------
# Parsing


def parse_tool_calls(text: str) -> list[ToolCall | ToolError]:
    """Every tool call in `text`, in order (reading stops at an unclosed tag)."""
    return list(_iter_calls(text))


def first_tool_call(text: str) -> ToolCall | ToolError | None:
    """The first tool call in `text`, or None when the text holds none (e.g. a final answer)."""
    return next(_iter_calls(text), None)


def _iter_calls(text: str) -> Iterator[ToolCall | ToolError]:
    position = 0
    while (opening := _OPEN.search(text, position)) is not None:
        if _CLOSE.search(text, position, opening.start()) is not None:
            yield _error("unopened_tag", "</tool_call> comes before its <tool_call>.")
            return
        closing = _CLOSE.search(text, opening.end())
        if closing is None:
            yield _error("unclosed_tag", "the <tool_call> tag is not closed with </tool_call>.")
            return
        yield _parse_call(text[opening.end() : closing.start()])
        position = closing.end()
    if _CLOSE.search(text, position) is not None:
        yield _error("unopened_tag", "</tool_call> comes without a <tool_call> before it.")


def _parse_call(body: str) -> ToolCall | ToolError:
    body = _SPACED_POINT.sub(".", _SPACED_MINUS.sub("-", body))
    try:
        call = json.loads(body, strict=False)  # strict=False: allow raw newlines inside strings
    except (ValueError, RecursionError) as err:  # ValueError includes JSONDecodeError
        return _error("bad_json", f"the tool call is not valid JSON ({_shorten(str(err), 80)}).")
    if not isinstance(call, dict):
        return _error("not_object", f"the tool call must be a JSON object, not {_json_type(call)}.")
    call = _squash_keys(call)
    if problem := _check_keys(call, required=("name", "arguments"), optional=(), where="the tool call"):
        return problem

    name = call["name"]
    if not isinstance(name, str):
        return _error("wrong_type", f'"name" must be a string, not {_json_type(name)}.')
    if _squash(name) not in TOOL_NAMES:
        known = ", ".join(f'"{tool}"' for tool in TOOL_NAMES)
        return _error("unknown_tool", f"there is no tool {_quoted([name])}; the tools are {known}.")

    arguments = call["arguments"]
    if not isinstance(arguments, dict):
        return _error("wrong_type", f'"arguments" must be a JSON object, not {_json_type(arguments)}.')
    arguments = _squash_keys(arguments)
    if problem := _check_keys(
        arguments, required=_ARGUMENT_KEYS[:1], optional=_ARGUMENT_KEYS[1:], where='"arguments"'
    ):
        return problem

    bbox = _parse_bbox(arguments["bbox_2d"])
    if isinstance(bbox, ToolError):
        return bbox
    index = arguments.get("image_index")
    if index is not None and not _is_int(index):
        return _error("bad_image_index", f'"image_index" must be an integer, not {_json_type(index)}.')
    label = arguments.get("label")
    if label is not None and not isinstance(label, str):
        return _error("wrong_type", f'"label" must be a string, not {_json_type(label)}.')
    return ToolCall(name=_squash(name), bbox=bbox, image_index=index or 0, label=label)


def _parse_bbox(value: Any) -> Box | ToolError:
    if not (isinstance(value, list) and len(value) == 4 and all(_is_number(v) for v in value)):
        return _error(
            "bad_bbox", '"bbox_2d" must be a list of 4 numbers [x1, y1, x2, y2] (left, top, right, bottom).'
        )
    x1, y1, x2, y2 = (_to_float(v) for v in value)
    if not all(math.isfinite(v) for v in (x1, y1, x2, y2)):
        return _error("non_finite", '"bbox_2d" must hold finite numbers, not NaN or infinity.')
    if x2 < x1 or y2 < y1:
        return _error("inverted_box", '"bbox_2d" is [left, top, right, bottom]: need x1 < x2 and y1 < y2.')
    if x2 == x1 or y2 == y1:
        return _error("empty_box", '"bbox_2d" has no area: need x1 < x2 and y1 < y2.')
    return x1, y1, x2, y2


def _check_keys(obj: dict, required: Sequence[str], optional: Sequence[str], where: str) -> ToolError | None:
    missing = [key for key in required if key not in obj]
    if missing:
        return _error("missing_key", f"{where} needs the key(s) {_quoted(missing)}.")
    extra = [key for key in obj if key not in required and key not in optional]
    if extra:
        allowed = _quoted([*required, *optional])
        return _error("extra_key", f"{where} has unexpected key(s) {_quoted(extra)}; allowed: {allowed}.")
    return None


def _error(kind: str, message: str) -> ToolError:
    return ToolError(kind, f"Invalid tool call: {message} A correct call looks like {EXAMPLE_CALL}")


def _squash(text: str) -> str:
    """Drop all whitespace and lower-case: '" bbox _ 2d "' from a spaced-out decode is 'bbox_2d'."""
    return "".join(text.split()).lower()


def _squash_keys(obj: dict) -> dict:
    return {_squash(key): value for key, value in obj.items()}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _to_float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer literal beyond float range
        return math.inf if value > 0 else -math.inf


def _json_type(value: Any) -> str:
    for python_type, name in ((bool, "a boolean"), (dict, "an object"), (list, "a list"), (str, "a string")):
        if isinstance(value, python_type):
            return name
    return "null" if value is None else "a number"


def _shorten(text: str, limit: int = 40) -> str:
    """Model-written text echoed in an error message, cut so a runaway string stays short."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _quoted(keys: Sequence[str]) -> str:
    return ", ".join(_shorten(json.dumps(key)) for key in keys)


# ---------------------------------------------------------------------------------------------
# Cropping


@dataclass
class CropSettings:
    """How a requested box becomes a crop of the original image.

    coordinate_space: "normalized" = [0, 1] relative to the source image; "pixels" = its pixels;
    "resized" = pixels of the size the processor resized it to (Qwen2.5-VL predicts those);
    "auto" = normalized when all four values lie in [0, 1], else pixels.
    """

    coordinate_space: CoordinateSpace = "auto"
    padding: float = 0.0  # fraction of the box's width/height added on each side
    min_size: int = 28  # minimum crop side in original pixels; smaller boxes grow around their centre

    def __post_init__(self) -> None:
        if self.coordinate_space not in get_args(CoordinateSpace):
            raise ValueError(f"coordinate_space must be one of {get_args(CoordinateSpace)}")
        if self.padding < 0 or self.min_size < 0:
            raise ValueError("padding and min_size must be >= 0")


class ImageStore:
    """The images of one conversation: the original (index 0) and each crop made so far (1, 2, ...)."""

    def __init__(self, image: Image.Image, settings: CropSettings | None = None) -> None:
        self.settings = settings or CropSettings()
        original = image if image.mode == "RGB" else image.convert("RGB")
        self.images: list[Image.Image] = [original]
        self.boxes: list[PixelBox] = [(0, 0, original.width, original.height)]  # in original pixels

    def __len__(self) -> int:
        return len(self.images)

    def crop(
        self, call: ToolCall | ToolError, resized_sizes: Sequence[tuple[int, int]] | None = None
    ) -> Observation:
        """Run a call: cut its box from the original pixels and keep the crop as the next image.

        A `ToolError` from parsing comes back as an error observation, so `first_tool_call(text)`
        can be passed straight in. `resized_sizes[i]` is the (width, height) at which the model saw
        image i; it is used (and needed) only with coordinate_space="resized".
        """
        if isinstance(call, ToolError):
            return Observation(text=call.message, error=call.kind)
        count = len(self.images)
        if not -count <= call.image_index < count:
            return _error_observation(
                "bad_image_index",
                f"there is no image {call.image_index}; images are 0 (the original) to {count - 1} "
                "(the latest crop), or -1 for the latest.",
            )
        index = call.image_index % count
        resized = None
        if self.settings.coordinate_space == "resized":
            if resized_sizes is None or len(resized_sizes) < count:
                raise ValueError('coordinate_space="resized" needs the resized size of every image')
            resized = resized_sizes[index]

        source = self.boxes[index]
        x1, y1, x2, y2 = _to_original(call.bbox, source, self.settings.coordinate_space, resized)
        # clamp to the source image: the model can only mean what it saw
        x1, y1, x2, y2 = max(x1, source[0]), max(y1, source[1]), min(x2, source[2]), min(y2, source[3])
        if x2 <= x1 or y2 <= y1:
            width, height = resized or (source[2] - source[0], source[3] - source[1])  # as the model saw it
            return _error_observation(
                "outside_image",
                f"the box lies entirely outside image {index} ({width}x{height} pixels); give "
                "[x1, y1, x2, y2] inside it, as fractions in [0, 1] or as pixels.",
            )
        # padding and growth may reach past the source into the rest of the original
        original = self.images[0]
        left, right = _fit_axis(x1, x2, self.settings.padding, self.settings.min_size, original.width)
        top, bottom = _fit_axis(y1, y2, self.settings.padding, self.settings.min_size, original.height)
        box = (left, top, right, bottom)
        long_side, short_side = max(right - left, bottom - top), min(right - left, bottom - top)
        if long_side > MAX_ASPECT_RATIO * short_side:
            return _error_observation(
                "too_thin",
                f"the crop [{left}, {top}, {right}, {bottom}] is {right - left}x{bottom - top} original "
                f"pixels, more than {MAX_ASPECT_RATIO} times longer than wide, which the model cannot see; "
                "give a box nearer to square.",
            )
        image = original.crop(box)
        self.images.append(image)
        self.boxes.append(box)
        text = f"Image {len(self.images) - 1}: crop of [{left}, {top}, {right}, {bottom}] (original pixels)."
        return Observation(text=text, image=image, box=box)


def _to_original(bbox: Box, source: PixelBox, space: CoordinateSpace, resized: tuple[int, int] | None) -> Box:
    """Map a box in the source image's coordinates to (unrounded) original-image pixels."""
    width, height = source[2] - source[0], source[3] - source[1]
    if space == "auto":
        space = "normalized" if all(0 <= v <= 1 for v in bbox) else "pixels"
    if space == "normalized":
        scale_x, scale_y = width, height
    elif space == "resized":
        scale_x, scale_y = width / resized[0], height / resized[1]
    else:
        scale_x = scale_y = 1.0
    x1, y1, x2, y2 = bbox
    return (
        source[0] + x1 * scale_x,
        source[1] + y1 * scale_y,
        source[0] + x2 * scale_x,
        source[1] + y2 * scale_y,
    )


def _fit_axis(low: float, high: float, padding: float, min_size: int, limit: int) -> tuple[int, int]:
    """One axis of a box: pad and clamp to [0, limit], grow to min_size, round outward to pixels.

    A box grown to min_size is shifted back inside the image rather than cut, so it keeps its size.
    """
    pad = (high - low) * padding
    low, high = max(low - pad, 0.0), min(high + pad, float(limit))
    if high - low < min_size:
        low = min(max((low + high - min_size) / 2, 0.0), max(limit - min_size, 0.0))
        high = min(low + min_size, float(limit))
    first = min(math.floor(low + _EPS), limit - 1)
    return first, max(math.ceil(high - _EPS), first + 1)


def _error_observation(kind: str, message: str) -> Observation:
    error = _error(kind, message)
    return Observation(text=error.message, error=error.kind)


# ---------------------------------------------------------------------------------------------
# Counting


@dataclass
class ToolStats:
    """Tool-call counts; add them up across samples with `+` or `sum(stats, ToolStats())`."""

    calls: int = 0
    successes: int = 0
    errors: Counter[str] = field(default_factory=Counter)

    def record(self, observation: Observation) -> None:
        self.calls += 1
        if observation.ok:
            self.successes += 1
        else:
            self.errors[observation.error] += 1

    def __add__(self, other: ToolStats) -> ToolStats:
        return ToolStats(
            self.calls + other.calls, self.successes + other.successes, self.errors + other.errors
        )

    def as_metrics(self) -> dict[str, float]:
        """Flat metrics with a key for every error kind, so each step logs the same keys."""
        metrics = {
            "tool_calls": float(self.calls),
            "tool_successes": float(self.successes),
            "tool_success_rate": self.successes / max(self.calls, 1),
        }
        metrics.update({f"tool_error_{kind}": float(self.errors[kind]) for kind in ERROR_KINDS})
        return metrics
