"""The tiny default task for learning *when* to zoom: multiple-choice questions about a large image.

Each example is one high-resolution canvas (448x448 by default) on a dark background with 1 to
`max_large` (3) LARGE shapes (21-40 % of the side across) and 3-6 SMALL objects (3-4 % of the side,
12-14 px at 448). A model first sees a downscaled overview (e.g. 112x112), where a small object is a
3-4 px blob, and may crop a region of the 4x4 grid (112 px at 448), which it then sees at its own
resolution (a 4x scale-up).

Questions have 4 options (letters A-D), one of them right:

- global ("global_colour", "global_shape"): the colour or shape of a large shape, readable from the
  overview, so a crop is wasted effort ("What colour is the large triangle?");
- detail ("detail_shape"): the shape of the small object in one cell of a 4x4 grid of regions
  ("What shape is the small object in row 1 column 2 of the image?"). It is a blob in the
  overview and clear in a crop of its region. There is no detail colour question: a blob's colour
  stays readable in the overview, so such a question would not need a zoom.

`vlm_rl.readability` checks both claims with fixed readers.

Scene rules (fractions of the side, x from the left, y from the top):

- the four shapes of one size have equal areas, so at low resolution a blob's mass does not give its
  shape away; `size` is the diameter of the circle of that area;
- every small object lies inside one region, at least 0.02 from its edges, and each region holds at
  most one small object, so "the small object in the <region>" names exactly one object;
- no two objects' bounding boxes come closer than 0.03 (large ones stay 0.02 from the border);
- the large shapes of one image have distinct colours and distinct shapes, so a question can name
  one of several by its other attribute ("the large red object").

Splits: `heldout_pairs(heldout_seed)` picks 4 colour-shape pairs (distinct colours, distinct shapes).
A train image has no large shape of a held-out pair; a held-out image has at least one, and its
global questions are about one. No held-out image can thus equal a train image, and held-out global
questions ask about colour-shape combinations never seen large in training. The splits also draw from
separate seed spaces. Small objects take any colour and shape in both splits.

Every example is a pure function of (split, seed, index, config): `make_example` regenerates any one
alone, and its image is drawn on access (a few ms) rather than stored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from PIL import Image

Box = tuple[float, float, float, float]  # (x1, y1, x2, y2), fractions of the image side

# the palette of the canvases: colours as RGB fractions, and the shapes every object takes
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.16, 0.16),
    "green": (0.18, 0.78, 0.22),
    "blue": (0.20, 0.36, 0.95),
    "yellow": (0.95, 0.88, 0.18),
    "purple": (0.62, 0.24, 0.86),
    "white": (0.94, 0.94, 0.94),
}
BACKGROUND = (0.12, 0.12, 0.12)
SHAPES = ("circle", "square", "triangle", "cross")

LETTERS = "ABCD"  # the tiny task's four options
OPTION_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # benchmarks may have more (MME-RealWorld: five)
SPLITS = ("train", "heldout")
CATEGORIES = ("global_colour", "global_shape", "detail_shape")
FULL_BOX: Box = (0.0, 0.0, 1.0, 1.0)
GRID = 4  # regions per side: a region of a 448 canvas is 112 px, shown at its own resolution when cropped
_REGION_NAMES = tuple(f"row {r + 1} column {c + 1}" for r in range(GRID) for c in range(GRID))
REGIONS: dict[str, Box] = {
    name: ((i % GRID) / GRID, (i // GRID) / GRID, (i % GRID + 1) / GRID, (i // GRID + 1) / GRID)
    for i, name in enumerate(_REGION_NAMES)
}

LARGE_SIZE = (0.24, 0.32)  # equal-area circle diameter, fraction of the side
SMALL_SIZE = (0.026, 0.032)
MAX_LARGE = 3
SMALL_COUNT = (3, 6)
GAP = 0.03  # least distance between the bounding boxes of two objects
_BORDER = 0.02  # least distance from a large shape to the image border
_CELL_MARGIN = 0.02  # least distance from a small object to the edges of its region
_HELDOUT_PAIR_COUNT = 4
_CROSS_ARM = 0.36  # half-width of a cross's bar, relative to its half-extent
# half-extent of each shape relative to the radius of the circle of equal area
HALF_EXTENT = {
    "circle": 1.0,
    "square": math.sqrt(math.pi) / 2,
    "triangle": math.sqrt(math.pi / 2),  # base and height both twice the half-extent
    "cross": math.sqrt(math.pi / (8 * _CROSS_ARM - 4 * _CROSS_ARM**2)),
}
RESAMPLE = Image.Resampling.BICUBIC
_COLOUR_LABELS = {name: i + 1 for i, name in enumerate(COLOURS)}
_PALETTE = [round(255 * v) for colour in (BACKGROUND, *COLOURS.values()) for v in colour]


class SceneObject(NamedTuple):
    colour: str
    shape: str
    x: float  # centre of the bounding box
    y: float
    size: float  # diameter of the circle of equal area, fraction of the side
    large: bool

    @property
    def box(self) -> Box:
        """The object's bounding box: every pixel it covers lies inside."""
        h = HALF_EXTENT[self.shape] * self.size / 2
        return (self.x - h, self.y - h, self.x + h, self.y + h)


@dataclass(frozen=True)
class TaskConfig:
    canvas_size: int = 448
    detail_fraction: float = 0.3  # chance that an example asks a detail (zoom) question
    heldout_seed: int = 0  # picks the held-out colour-shape pairs
    max_large: int = MAX_LARGE  # large shapes per image: 1 to this (1: questions need no naming)

    def __post_init__(self) -> None:
        if not 1 <= self.max_large <= MAX_LARGE:
            raise ValueError(f"max_large must be in [1, {MAX_LARGE}], got {self.max_large!r}")
        if not isinstance(self.canvas_size, int) or self.canvas_size < 32:
            raise ValueError(f"canvas_size must be an int >= 32, got {self.canvas_size!r}")
        if not 0.0 <= self.detail_fraction <= 1.0:
            raise ValueError(f"detail_fraction must be in [0, 1], got {self.detail_fraction!r}")


@dataclass(frozen=True)
class ZoomExample:
    """One question about one canvas; `image` is drawn from `objects` on each access."""

    id: str
    question: str
    options: tuple[str, ...]
    answer: str  # a letter of LETTERS
    kind: str  # "global" or "detail"
    category: str  # one of CATEGORIES
    target_box: Box  # detail: the region to crop; global: the large shape's bounding box
    target: int  # index in `objects` of the object the question is about
    objects: tuple[SceneObject, ...]
    canvas_size: int

    @property
    def needs_zoom(self) -> bool:
        return self.kind == "detail"

    @property
    def answer_text(self) -> str:
        return self.options[OPTION_LETTERS.index(self.answer)]

    @property
    def image(self) -> Image.Image:
        return render(self.objects, self.canvas_size)


def heldout_pairs(seed: int = 0) -> list[tuple[str, str]]:
    """Colour-shape pairs never shown large in training: 4 pairs of distinct colours and shapes."""
    rng = np.random.default_rng(seed)
    colours = rng.permutation(list(COLOURS))[:_HELDOUT_PAIR_COUNT]
    shapes = rng.permutation(list(SHAPES))[:_HELDOUT_PAIR_COUNT]
    return sorted((str(c), str(s)) for c, s in zip(colours, shapes, strict=True))


def region_of(x: float, y: float) -> str:
    """The name of the grid region that holds the point (x, y)."""
    column, row = min(int(x * GRID), GRID - 1), min(int(y * GRID), GRID - 1)
    return _REGION_NAMES[GRID * row + column]


# ---------------------------------------------------------------------------------------------
# Examples


def make_examples(
    n: int, seed: int = 0, split: str = "train", config: TaskConfig | None = None, start: int = 0
) -> list[ZoomExample]:
    """Examples start .. start + n - 1 of a split; each equals `make_example(index, seed, split, config)`."""
    return [make_example(index, seed, split, config) for index in range(start, start + n)]


def make_example(
    index: int, seed: int = 0, split: str = "train", config: TaskConfig | None = None
) -> ZoomExample:
    """Example `index` of a split, the same whenever it is asked for (the scene does not depend on
    detail_fraction, only the question does)."""
    config = config or TaskConfig()
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if index < 0 or seed < 0:
        raise ValueError(f"index and seed must be >= 0, got index={index}, seed={seed}")
    rng = np.random.default_rng([SPLITS.index(split), seed, index])
    held_out = set(heldout_pairs(config.heldout_seed))
    objects = _sample_scene(rng, split, held_out, config.max_large)
    detail = rng.random() < config.detail_fraction
    if detail:
        target = int(rng.choice([i for i, obj in enumerate(objects) if not obj.large]))
        region = region_of(objects[target].x, objects[target].y)
        question = f"What shape is the small object in {region} of the image?"
        category, truth, target_box = "detail_shape", objects[target].shape, REGIONS[region]
    else:
        candidates = [
            i
            for i, obj in enumerate(objects)
            if obj.large and (split == "train" or (obj.colour, obj.shape) in held_out)
        ]
        target = int(rng.choice(candidates))
        category, question, truth = _global_question(objects, target, rng)
        target_box = objects[target].box
    family = list(COLOURS) if category == "global_colour" else list(SHAPES)
    wrong = rng.choice([value for value in family if value != truth], size=3, replace=False)
    options = tuple(str(option) for option in rng.permutation([truth, *wrong]))
    return ZoomExample(
        id=f"zoom-{split}-{seed}-{index:06d}",
        question=question,
        options=options,
        answer=LETTERS[options.index(truth)],
        kind="detail" if detail else "global",
        category=category,
        target_box=target_box,
        target=target,
        objects=objects,
        canvas_size=config.canvas_size,
    )


def _global_question(
    objects: tuple[SceneObject, ...], target: int, rng: np.random.Generator
) -> tuple[str, str, str]:
    """(category, question, true answer) about a large shape, naming it by its other attribute
    when the image has more than one."""
    obj = objects[target]
    alone = sum(o.large for o in objects) == 1
    if rng.random() < 0.5:
        name = "shape" if alone else obj.shape
        return "global_colour", f"What colour is the large {name}?", obj.colour
    name = "object" if alone else f"{obj.colour} object"
    return "global_shape", f"What shape is the large {name}?", obj.shape


def _sample_scene(
    rng: np.random.Generator, split: str, held_out: set[tuple[str, str]], max_large: int
) -> tuple[SceneObject, ...]:
    while True:  # start afresh when the large shapes leave no room
        large = _place_large(rng, _large_kinds(rng, split, held_out, max_large))
        small = _place_small(rng, large) if large else ()
        if small:
            return large + small


def _large_kinds(
    rng: np.random.Generator, split: str, held_out: set[tuple[str, str]], max_large: int
) -> list[tuple[str, str]]:
    """Distinct colours and shapes; a held-out pair among them exactly when the split is held out."""
    while True:
        n = int(rng.integers(1, max_large + 1))
        colours = rng.choice(list(COLOURS), size=n, replace=False)
        shapes = rng.choice(SHAPES, size=n, replace=False)
        kinds = [(str(c), str(s)) for c, s in zip(colours, shapes, strict=True)]
        if any(kind in held_out for kind in kinds) == (split == "heldout"):
            return kinds


def _place_large(rng: np.random.Generator, kinds: list[tuple[str, str]]) -> tuple[SceneObject, ...]:
    """Large shapes at random places, apart from each other; () when one finds no room."""
    placed: list[SceneObject] = []
    for colour, shape in kinds:
        size = float(rng.uniform(*LARGE_SIZE))
        h = HALF_EXTENT[shape] * size / 2
        for _ in range(50):
            x, y = rng.uniform(h + _BORDER, 1 - h - _BORDER, size=2)
            obj = SceneObject(colour, shape, float(x), float(y), size, True)
            if not any(_near(obj, other) for other in placed):
                placed.append(obj)
                break
        else:
            return ()
    return tuple(placed)


def _place_small(rng: np.random.Generator, large: tuple[SceneObject, ...]) -> tuple[SceneObject, ...]:
    """At most one small object per chosen region, inside it and apart from the large shapes; a region
    too crowded by large shapes is left empty."""
    placed: list[SceneObject] = []
    for cell in rng.choice(
        len(_REGION_NAMES), size=int(rng.integers(SMALL_COUNT[0], SMALL_COUNT[1] + 1)), replace=False
    ):
        colour, shape = str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))
        size = float(rng.uniform(*SMALL_SIZE))
        h = HALF_EXTENT[shape] * size / 2
        x1, y1, x2, y2 = REGIONS[_REGION_NAMES[cell]]
        for _ in range(20):
            x = float(rng.uniform(x1 + _CELL_MARGIN + h, x2 - _CELL_MARGIN - h))
            y = float(rng.uniform(y1 + _CELL_MARGIN + h, y2 - _CELL_MARGIN - h))
            obj = SceneObject(colour, shape, x, y, size, False)
            if not any(_near(obj, other) for other in large):
                placed.append(obj)
                break
    return tuple(placed)


def _near(a: SceneObject, b: SceneObject) -> bool:
    """Whether the bounding boxes of two objects come closer than the gap."""
    (ax1, ay1, ax2, ay2), (bx1, by1, bx2, by2) = a.box, b.box
    return ax1 < bx2 + GAP and bx1 < ax2 + GAP and ay1 < by2 + GAP and by1 < ay2 + GAP


# ---------------------------------------------------------------------------------------------
# Drawing and views


def render(objects: Sequence[SceneObject], canvas_size: int = 448) -> Image.Image:
    """The scene as an RGB image (hard-edged masks, drawn only inside each object's box)."""
    labels = np.zeros((canvas_size, canvas_size), dtype=np.uint8)  # 0: background, i: colour i - 1
    for obj in objects:
        x1, y1, x2, y2 = (min(max(v * canvas_size, 0), canvas_size) for v in obj.box)
        left, top, right, bottom = int(x1), int(y1), math.ceil(x2), math.ceil(y2)
        dx = (np.arange(left, right) + 0.5) / canvas_size - obj.x
        dy = (np.arange(top, bottom) + 0.5) / canvas_size - obj.y
        mask = shape_mask(obj.shape, dx[None, :], dy[:, None], obj.size / 2)
        labels[top:bottom, left:right][mask] = _COLOUR_LABELS[obj.colour]
    image = Image.fromarray(labels, mode="P")
    image.putpalette(_PALETTE)
    return image.convert("RGB")


def view(image: Image.Image, box: Box = FULL_BOX, size: int = 112) -> Image.Image:
    """What a model sees of a normalised box of the image: that part, resized (bicubic, antialiased)
    so that its longer side is `size` pixels. The whole box gives the overview."""
    x1, y1, x2, y2 = box
    if not 0 <= x1 < x2 <= 1 or not 0 <= y1 < y2 <= 1:
        raise ValueError(f"box must satisfy 0 <= x1 < x2 <= 1 and 0 <= y1 < y2 <= 1, got {box}")
    width, height = image.size
    pixels = (x1 * width, y1 * height, x2 * width, y2 * height)
    scale = size / max(pixels[2] - pixels[0], pixels[3] - pixels[1])
    out = (max(1, round((pixels[2] - pixels[0]) * scale)), max(1, round((pixels[3] - pixels[1]) * scale)))
    return image.resize(out, RESAMPLE, box=pixels)


def shape_mask(shape: str, dx: np.ndarray, dy: np.ndarray, radius: float) -> np.ndarray:
    """Pixels inside a shape of equal-area radius `radius`, from their offsets to its box centre."""
    h = HALF_EXTENT[shape] * radius
    if shape == "circle":
        return dx**2 + dy**2 <= h**2
    if shape == "square":
        return (np.abs(dx) <= h) & (np.abs(dy) <= h)
    if shape == "triangle":  # apex at the top, base at the bottom
        return (dy >= -h) & (dy <= h) & (np.abs(dx) <= (dy + h) / 2)
    if shape == "cross":  # an upright plus sign
        arm = _CROSS_ARM * h
        return ((np.abs(dx) <= arm) & (np.abs(dy) <= h)) | ((np.abs(dy) <= arm) & (np.abs(dx) <= h))
    raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
