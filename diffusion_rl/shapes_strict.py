"""`shapes_strict`: strict pixel-level checks of coloured-shape images against their prompts, what
`geneval_mini` (`diffusion_rl.alignment`) lets slide, for a held-out gold reward (`eval.gold_reward`):
a clean background, the exact object count per colour, and each asked object's shape as the renderer
draws it. No weights: the checks read the palette colours and connected regions of the pixels."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from diffusion_rl.alignment import ImageBatch
from diffusion_rl.rewards import OPTIONS_KEY
from diffusion_rl.shapes import (
    BACKGROUND,
    COLOURS,
    SHAPES,
    PromptSpec,
    _shape_mask,
    parse_prompt,
)
from mmrl.config import ConfigError
from mmrl.registry import REWARDS

STRICT_COLOUR_TOLERANCE = 0.25  # RGB distance within which a pixel is confidently a palette colour
STRICT_BACKGROUND_TOLERANCE = 0.04  # background pixels this far from BACKGROUND are clean ...
STRICT_BACKGROUND_SPAN = 0.30  # ... and this much further count as fully dirty
STRICT_MIN_OBJECT_AREA = 0.008  # objects cover at least ~0.02 of the image; smaller blobs are speckle
STRICT_IDENTITY_MARGIN = 0.1  # `identity`: shape credit ramps from 0 to full over this IoU lead
_PALETTE = torch.tensor([BACKGROUND, *COLOURS.values()])  # class 0: background, then the colours
STRICT_TERMS = ("score", "background", "count", "shape")  # what `strict_checks` returns


def strict_checks(
    images: ImageBatch,
    specs: Sequence[PromptSpec | str],
    identity: bool = False,
    count_shapes: bool = False,
    shape_over_asked: bool = False,
) -> dict[str, Tensor]:
    """Per image, in [0, 1] (shape [B] each): `background` (cleanliness outside the objects), `count`
    (exact object count per colour, extra objects included; with `count_shapes`, per colour and
    best-fitting shape), `shape` (edge quality of the asked objects; with `identity`, also that each
    is the asked shape; with `shape_over_asked`, an asked object not drawn adds 0) and `score`, their
    product; see `shapes_strict`."""
    if len(images) != len(specs):
        raise ValueError(f"{len(images)} images but {len(specs)} prompts")
    if not isinstance(images, Tensor):  # a list of images of any sizes: one at a time
        parts = [
            strict_checks(image.unsqueeze(0), [spec], identity, count_shapes, shape_over_asked)
            for image, spec in zip(images, specs, strict=True)
        ]
        return {k: torch.cat([p[k] for p in parts]) if parts else torch.zeros(0) for k in STRICT_TERMS}
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be [B, 3, H, W], got shape {tuple(images.shape)}")
    pixels = images.detach().float().clamp(0, 1).cpu().permute(0, 2, 3, 1)  # [B, H, W, 3]
    batch, height, width, _ = pixels.shape
    distance = torch.cdist(pixels.reshape(batch, -1, 3), _PALETTE.expand(batch, -1, -1))
    nearest_distance, nearest = distance.view(batch, height, width, -1).min(-1)
    classes = torch.where((nearest > 0) & (nearest_distance < STRICT_COLOUR_TOLERANCE), nearest, 0)
    labels = _components(classes)
    xs = (np.arange(width, dtype=np.float32)[None, :] + 0.5) / width
    ys = (np.arange(height, dtype=np.float32)[:, None] + 0.5) / height
    deviation = (pixels - _PALETTE[0]).norm(dim=-1)
    dirt = ((deviation - STRICT_BACKGROUND_TOLERANCE) / STRICT_BACKGROUND_SPAN).clamp(0, 1)
    rows = []
    for i, spec in enumerate(specs):
        spec = parse_prompt(spec) if isinstance(spec, str) else spec
        asked_shapes: dict[str, list[str]] = {}
        asked_counts: dict[tuple[str, str | None], int] = {}  # by (colour, shape or None)
        for r in spec.requirements:
            asked_shapes.setdefault(r.colour, []).append(r.shape)
            key = (r.colour, r.shape if count_shapes else None)
            asked_counts[key] = asked_counts.get(key, 0) + r.count
        ids, areas = labels[i].unique(return_counts=True)
        objects = ids[(ids > 0) & (areas >= STRICT_MIN_OBJECT_AREA * height * width)].tolist()
        found: dict[tuple[str, str | None], int] = {}
        fits = []
        covered = torch.zeros(height, width, dtype=torch.bool)
        for label in objects:
            mask = labels[i] == label
            covered |= mask
            colour = list(COLOURS)[int(classes[i][mask][0]) - 1]
            pixels_in = mask.numpy()
            searched = None  # each shape's searched fit, once per object
            if identity or count_shapes:
                searched = {s: _shape_fit(pixels_in, s, xs, ys, search=True) for s in SHAPES}
            key = (colour, max(searched, key=searched.get) if count_shapes else None)
            found[key] = found.get(key, 0) + 1
            if colour in asked_shapes:
                credit = searched if identity else None
                fits.append(
                    max(
                        _shape_fit(pixels_in, s, xs, ys) * _identity_credit(credit, s)
                        for s in asked_shapes[colour]
                    )
                )
        wrong = sum(abs(found.get(k, 0) - asked_counts.get(k, 0)) for k in found.keys() | asked_counts.keys())
        near = F.max_pool2d(covered[None, None].float(), 3, 1, 1)[0, 0] > 0  # objects and their edge
        outside = dirt[i][~near]
        background = 1 - outside.mean().item() if outside.numel() else 0.0
        # the mean fit over the objects drawn, or over at least as many as were asked
        asked = sum(asked_counts.values()) if shape_over_asked else 0
        rows.append((background, 1 / (1 + wrong), sum(fits) / max(len(fits), asked) if fits else 0.0))
    background, count, shape = torch.tensor(rows, dtype=torch.float32).view(-1, 3).unbind(1)
    return {"background": background, "count": count, "shape": shape, "score": background * count * shape}


def _components(classes: Tensor) -> Tensor:
    """Labels [B, H, W] of the 4-connected regions of equal non-zero class (0 where the class is 0);
    each region's label is its largest pixel index + 1, found by spreading maxima to neighbours."""
    batch, height, width = classes.shape
    labels = torch.arange(1, height * width + 1).view(1, height, width).repeat(batch, 1, 1)
    labels = torch.where(classes > 0, labels, 0)
    padded_classes = F.pad(classes, (1, 1, 1, 1), value=-1)
    neighbours = [(0, 1), (2, 1), (1, 0), (1, 2)]  # offsets into the padded map: up, down, left, right
    same = [
        padded_classes[:, dy : dy + height, dx : dx + width] == classes for dy, dx in neighbours
    ]  # never across the border (class -1) or into class 0 (label 0 there)
    while True:
        padded = F.pad(labels, (1, 1, 1, 1))
        spread = labels
        for (dy, dx), mask in zip(neighbours, same, strict=True):
            spread = torch.where(
                mask, torch.maximum(spread, padded[:, dy : dy + height, dx : dx + width]), spread
            )
        if torch.equal(spread, labels):
            return labels
        labels = spread


def _identity_credit(searched: dict[str, float] | None, asked: str) -> float:
    """The share of an object's shape credit that `identity` keeps, from each shape's searched fit
    (None: no identity check, all of it). The asked shape must be the one that fits best, since at
    32 px a circle fits a cross's outline nearly as well as a cross does (the fits are searched over
    sub-pixel shifts and sizes because a clean shape's bounding box is off by up to a pixel): the
    share ramps from 0, asked shape behind the best other by half of `STRICT_IDENTITY_MARGIN`, to 1,
    ahead by half of it."""
    if searched is None:
        return 1.0
    lead = searched[asked] - max(iou for shape, iou in searched.items() if shape != asked)
    return min(max(lead / STRICT_IDENTITY_MARGIN + 0.5, 0.0), 1.0)


def _shape_fit(mask: np.ndarray, shape: str, xs: np.ndarray, ys: np.ndarray, search: bool = False) -> float:
    """IoU of an object's pixels with the ideal `shape` (as `diffusion_rl.shapes.render` draws it)
    placed and sized by the object's bounding box: 1 for a clean, hard-edged shape, lower for ragged,
    speckled or bled edges and for another shape. `search`: the best IoU over shifts of up to a
    pixel and sizes within 15% of that placement."""
    rows, cols = np.nonzero(mask)
    height, width = mask.shape
    left, right = cols.min() / width, (cols.max() + 1) / width
    top, bottom = rows.min() / height, (rows.max() + 1) / height
    extent, x, y = max(right - left, bottom - top), (left + right) / 2, (top + bottom) / 2
    if shape == "square":  # drawn at 0.85 of its half-extent
        radius = extent / 1.7
    elif shape == "triangle":  # apex at -radius, base at 0.8 radius, as wide as 2 radius
        radius = max((right - left) / 2, (bottom - top) / 1.8)
        y += 0.1 * radius
    else:
        radius = extent / 2
    if search:  # every placement at once: [shift x, shift y, size, 1, 1] against [H, W] pixels
        shifts = np.linspace(-1, 1, 5)
        x = x + shifts[:, None, None, None, None] / width
        y = y + shifts[None, :, None, None, None] / height
        radius = radius * np.linspace(0.85, 1.15, 7)[None, None, :, None, None]
    ideal = _shape_mask(shape, xs - x, ys - y, radius)
    union = (ideal | mask).sum((-2, -1))
    overlap = (ideal & mask).sum((-2, -1))
    return float(np.max(np.where(union > 0, overlap / np.maximum(union, 1), 0.0)))


@REWARDS.register("shapes_strict")
def shapes_strict(
    identity: bool = False, count_shapes: bool = False, shape_over_asked: bool = False, term: str = "score"
) -> Callable[..., Tensor]:
    """Strict checks of coloured-shape images against their prompts, in [0, 1]: what `geneval_mini`
    lets slide, for use as a held-out gold reward (`eval.gold_reward`). The product of

    - background: 1 minus the mean dirt of the pixels away from the objects, a pixel's dirt growing
      from 0 to 1 as its colour leaves the background's (speckle, noise, tinted or bled backgrounds);
    - count: 1 / (1 + the number of objects missing or extra, per colour, over all colours), objects
      being connected regions of one palette colour of at least 0.8% of the image (extra objects
      of colours the prompt never names count too, which geneval_mini ignores);
    - shape: the mean IoU of each object of an asked colour with the asked shape as the renderer
      draws it, fitted to the object's bounding box (ragged, speckled or colour-bled edges, and
      another shape, lower it). At 32 px another shape lowers it little (a circle fits a cross's
      outline nearly as well as a cross); `identity=True` also asks that the object fit the asked
      shape better than any other, and gives no shape credit to a circle drawn for a cross.

    `count_shapes=True` counts objects per colour and shape, an object's shape being the one whose
    searched fit is best: a circle drawn for an asked triangle is then one object missing and one
    extra, which costs more than leaving the triangle out, where the default counts it as found.
    The shape fit averages over the objects drawn, so leaving a poorly drawn object out raises it;
    `shape_over_asked=True` divides by at least the number of objects asked, an asked object not
    drawn adding 0, so that with `count_shapes` leaving the triangle out pays no more than a circle.

    `term` returns one factor instead of the product (`background`, `count` or `shape`): scored
    beside the reward (`mmrl eval diffusion`), the factors say where a change in the score comes from.

    Clean renders of a prompt's scene score about 0.9; images: [B, 3, H, W] in [0, 1] or a list of
    [3, H, W]; prompts outside the grammar raise ValueError. No weights: nothing to load.
    """
    if term not in STRICT_TERMS:
        raise ConfigError(
            f"config error: {OPTIONS_KEY}.term = {term!r} is not a term of shapes_strict: choose one of "
            f"{', '.join(STRICT_TERMS)} (score, the default, is their product)"
        )

    def reward(images: ImageBatch, prompts: Sequence[str], **_: Any) -> Tensor:
        specs = [parse_prompt(prompt) for prompt in prompts]
        return strict_checks(images, specs, identity, count_shapes, shape_over_asked)[term]

    return reward
