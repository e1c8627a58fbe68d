"""Is a zoom needed? Two fixed nearest-template readers of the zoom task's views (no learning).

`readability` checks the claims of `vlm_rl.tasks`, telling each reader the object's colour and where
it is. The silhouette reader (the pixels a view shows at least half covered) reads a small object's
shape near chance from the overview (0.41; chance 0.25) and reliably from a crop (1.0).
The matched reader, which inverts the known drawing and resizing, reads it from the overview as well
(1.0): the noise-free overview still holds the shape in its grey levels, so a model could in
principle learn to answer detail questions without a zoom. Large shapes read perfectly from the
overview with either.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vlm_rl.tasks import (
    BACKGROUND,
    COLOURS,
    FULL_BOX,
    GAP,
    HALF_EXTENT,
    RESAMPLE,
    SHAPES,
    Box,
    SceneObject,
    ZoomExample,
    shape_mask,
    view,
)

_SUBSAMPLES = 4  # per pixel side, when the silhouette reader draws its templates
# a template pixel is in the silhouette from this fraction covered: resizing blurs edges, so a pixel
# must be mostly covered to reach coverage 0.5 in a view (the value of the range tried that read crops best)
_TEMPLATE_FILL = 0.7


@dataclass(frozen=True)
class Readability:
    """Fractions of questions a fixed reader gets right, by view.

    `*_matched` use the pipeline-matched reader, an upper bound on what a view still holds (see
    `read_shape`); the others read the silhouette as the view shows it.
    """

    detail_overview: float  # small object's shape, from the overview
    detail_crop: float  # small object's shape, from a crop of its region at the same view size
    detail_overview_matched: float
    detail_crop_matched: float
    global_shape: float  # large shape's shape, from the overview
    global_colour: float  # large shape's colour (mean over its interior) nearest to the truth
    colour_error: float  # largest channel error (0-1) of that mean colour
    n_detail: int
    n_global: int


def readability(examples: Sequence[ZoomExample], view_size: int = 112) -> Readability:
    """How well fixed readers answer each question from the overview, and detail ones from a crop.

    The readers are told the object's colour and a window around it in every view, so the views
    differ only in resolution. NaN where the examples hold no question of a kind.
    """
    hits: dict[str, list[bool]] = {name: [] for name in ("overview", "crop", "overview_m", "crop_m", "shape")}
    colours, errors = [], []
    for example in examples:
        image, obj, size = example.image, example.objects[example.target], example.canvas_size
        overview = view(image, FULL_BOX, view_size)
        if example.needs_zoom:
            crop = view(image, example.target_box, view_size)
            views = (("overview", overview, FULL_BOX), ("crop", crop, example.target_box))
            for name, image_view, source in views:
                hits[name].append(read_shape(image_view, source, obj, size) == obj.shape)
                hits[name + "_m"].append(read_shape(image_view, source, obj, size, matched=True) == obj.shape)
        else:
            colour = _interior_colour(overview, obj)
            nearest = min(COLOURS, key=lambda name: float(np.sum((np.array(COLOURS[name]) - colour) ** 2)))
            hits["shape"].append(read_shape(overview, FULL_BOX, obj, size) == obj.shape)
            colours.append(nearest == obj.colour)
            errors.append(float(np.max(np.abs(colour - np.array(COLOURS[obj.colour])))))
    fractions = [float(np.mean(h)) if h else math.nan for h in (*hits.values(), colours)]
    return Readability(
        *fractions,
        colour_error=max(errors, default=math.nan),
        n_detail=len(hits["overview"]),
        n_global=len(colours),
    )


def read_shape(
    image_view: Image.Image, source: Box, obj: SceneObject, canvas_size: int, matched: bool = False
) -> str:
    """Which shape the object seems to be in a view of the canvas box `source` (nearest template).

    Only the object's colour and a window around its box (half the gap wider, so no other object
    enters) are used. The object's coverage of each view pixel is the pixel's projection onto the
    line from background to colour. The default reader takes the silhouette as the view shows it
    (coverage >= 0.5) and picks the shape whose mask, fitted to the silhouette's bounding box and
    sampled at the view's pixels, overlaps it best (IoU). The matched reader (`matched=True`) inverts
    the rendering instead: it draws each shape at canvas resolution, with the coverage's centroid and
    area, resizes it exactly as the view was made, and picks the least squared difference; on these
    noise-free images it reads far more than a glance at the view shows.
    """
    scale_x = image_view.width / ((source[2] - source[0]) * canvas_size)  # view pixels per canvas pixel
    scale_y = image_view.height / ((source[3] - source[1]) * canvas_size)
    x1, y1, x2, y2 = obj.box
    left = max(math.floor(((x1 - GAP / 2) - source[0]) * canvas_size * scale_x), 0)
    top = max(math.floor(((y1 - GAP / 2) - source[1]) * canvas_size * scale_y), 0)
    right = min(math.ceil(((x2 + GAP / 2) - source[0]) * canvas_size * scale_x), image_view.width)
    bottom = min(math.ceil(((y2 + GAP / 2) - source[1]) * canvas_size * scale_y), image_view.height)
    pixels = np.asarray(image_view, dtype=np.float32)[top:bottom, left:right] / 255
    background = np.array(BACKGROUND, dtype=np.float32)
    direction = np.array(COLOURS[obj.colour], dtype=np.float32) - background
    coverage = (pixels - background) @ direction / float(direction @ direction)
    if coverage.max() <= 0:
        return SHAPES[0]
    if not matched:
        return _read_silhouette(coverage)
    origin = (source[0] * canvas_size + left / scale_x, source[1] * canvas_size + top / scale_y)
    return _read_matched(coverage, origin, (scale_x, scale_y))


def _read_silhouette(coverage: np.ndarray) -> str:
    """Nearest silhouette by IoU: each shape fitted to the silhouette's bounding box and drawn at the
    view's pixels, a pixel being in when the shape covers _TEMPLATE_FILL of it."""
    silhouette = coverage >= min(0.5, 0.5 * coverage.max())
    rows, columns = np.nonzero(silhouette)
    centre_x, centre_y = (columns.min() + columns.max() + 1) / 2, (rows.min() + rows.max() + 1) / 2
    half = max(columns.max() + 1 - columns.min(), rows.max() + 1 - rows.min()) / 2
    sub = (np.arange(_SUBSAMPLES) + 0.5) / _SUBSAMPLES  # sample points inside a pixel
    dx = (np.arange(coverage.shape[1])[:, None] + sub).ravel() - centre_x
    dy = (np.arange(coverage.shape[0])[:, None] + sub).ravel() - centre_y
    height, width = coverage.shape

    def overlap(shape: str) -> float:
        fine = shape_mask(shape, dx[None, :], dy[:, None], half / HALF_EXTENT[shape])
        area = fine.reshape(height, _SUBSAMPLES, width, _SUBSAMPLES).mean(axis=(1, 3))
        template = area >= _TEMPLATE_FILL
        return float((template & silhouette).sum() / (template | silhouette).sum())

    return max(SHAPES, key=overlap)


def _read_matched(coverage: np.ndarray, origin: tuple[float, float], scale: tuple[float, float]) -> str:
    """Nearest template drawn at canvas resolution and resized like the view (canvas-pixel units)."""
    mass = float(coverage.sum())
    if mass <= 0:
        return SHAPES[0]
    rows, columns = np.indices(coverage.shape) + 0.5
    centre_x = origin[0] + float((coverage * columns).sum()) / mass / scale[0]
    centre_y = origin[1] + float((coverage * rows).sum()) / mass / scale[1]
    radius = math.sqrt(mass / (scale[0] * scale[1]) / math.pi)
    window = (
        origin[0],
        origin[1],
        origin[0] + coverage.shape[1] / scale[0],
        origin[1] + coverage.shape[0] / scale[1],
    )

    def mismatch(shape: str) -> float:
        # a triangle's centroid lies a third of its half-extent below its box centre
        offset = HALF_EXTENT[shape] * radius / 3 if shape == "triangle" else 0.0
        template = _template(shape, centre_x, centre_y - offset, radius, window, coverage.shape)
        return float(np.sum((template - coverage) ** 2))

    return min(SHAPES, key=mismatch)


def _template(
    shape: str, centre_x: float, centre_y: float, radius: float, window: Box, out_shape: tuple[int, ...]
) -> np.ndarray:
    """A shape drawn at canvas resolution (canvas-pixel coordinates) and resized like the view."""
    pad = 8 + math.ceil(HALF_EXTENT[shape] * radius)
    left, top = math.floor(window[0]) - pad, math.floor(window[1]) - pad
    right, bottom = math.ceil(window[2]) + pad, math.ceil(window[3]) + pad
    dx = np.arange(left, right, dtype=np.float32) + 0.5 - centre_x
    dy = np.arange(top, bottom, dtype=np.float32) + 0.5 - centre_y
    mask = shape_mask(shape, dx[None, :], dy[:, None], radius).astype(np.float32)
    box = (window[0] - left, window[1] - top, window[2] - left, window[3] - top)
    return np.asarray(Image.fromarray(mask, mode="F").resize((out_shape[1], out_shape[0]), RESAMPLE, box=box))


def _interior_colour(image_view: Image.Image, obj: SceneObject) -> np.ndarray:
    """Mean colour (0-1) of the view's pixels inside the inner 70 % of a shape (away from its edges)."""
    pixels = np.asarray(image_view, dtype=np.float32) / 255
    height, width = pixels.shape[:2]
    dx = (np.arange(width) + 0.5) / width - obj.x
    dy = (np.arange(height) + 0.5) / height - obj.y
    mask = shape_mask(obj.shape, dx[None, :], dy[:, None], 0.7 * obj.size / 2)
    return pixels[mask].mean(axis=0)
