"""Compositional alignment reward ("GenEval in miniature") for the coloured-shapes world.

The scorer is a small CNN that finds object centres: on an 8x8 grid over the image (cells of 4x4
pixels at 32x32; other sizes are resized), it classifies each cell as "no object centre here" or as
the centre of one of the 24 colour-shape pairs of `diffusion_rl.shapes` (objects never share a
cell). Everything a prompt can ask is read off these per-cell probabilities p(pair, cell):

- count of a pair: its expected number E = sum over cells of p(pair, cell) (a centre split between
  two cells still sums to one object), turned into probabilities of 0, 1, 2, 3 and "4 or more" by
  soft rounding: softmax over n of -(E - n)^2 / (2 sigma^2), with sigma learned;
- region of a lone object: the share of its pair's centre mass inside the region (region edges lie
  on cell edges, see `diffusion_rl.shapes.in_position`).

A prompt is scored as the fraction of its checks that hold, each check taken as its predicted
probability (the expected fraction of satisfied checks, checks treated as independent), so the
reward is smooth rather than 0/1:

- each object phrase ("two red circles", "a blue square"): P(count of that pair == asked count);
- a position ("... on the left"): P(count == 1) * P(that object is in the region).

"a red circle" means exactly one. Objects the prompt does not mention are not penalised unless the
reward is built with `unmentioned=True`.

Dense per-cell targets make this train in a few minutes on a CPU, where a head that reads counts
off pooled features needed far longer. The scorer learns from freshly drawn scenes (prompt scenes
and cluttered scenes with distractors) under colour jitter, blur, halved resolution and pixel
noise, so that it also reads a diffusion model's imperfect samples, and from pure-noise images
that hold no object, so that noise earns no reward. Weights ship in
`diffusion_rl/assets/alignment_scorer/` (safetensors + config.json with the measured held-out
accuracy); rebuild them with ``python -m diffusion_rl.alignment``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm import tqdm

from diffusion_rl.rewards import OPTIONS_KEY
from diffusion_rl.shapes import (
    BACKGROUND,
    COLOURS,
    MAX_PROMPT_COUNT,
    PAIRS,
    POSITIONS,
    SHAPES,
    TEMPLATES,
    PromptSpec,
    Requirement,
    Scene,
    _shape_mask,
    in_position,
    parse_prompt,
    render_batch,
    sample_cluttered_scene,
    sample_scene,
    spec_for,
)
from mmrl.config import ConfigError
from mmrl.registry import REWARDS

IMAGE_SIZE = 32
GRID = 8  # centre cells per side
MAX_COUNT = 4  # count classes 0..MAX_COUNT, the last meaning "MAX_COUNT or more"
DEFAULT_DIR = Path(__file__).resolve().parent / "assets" / "alignment_scorer"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
REBUILD_COMMAND = "python -m diffusion_rl.alignment --out diffusion_rl/assets/alignment_scorer"
CORRUPTIONS = ("colour", "shape", "count", "position")
NOISE_FRACTION = 1 / 16  # training images replaced by pixel noise without objects

ImageBatch = Tensor | Sequence[Tensor]


def _conv_block(in_channels: int, out_channels: int) -> list[nn.Module]:
    return [
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
    ]


class AlignmentScorer(nn.Module):
    """Per 4x4-pixel cell: which colour-shape pair, if any, has an object centre there."""

    def __init__(self, width: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.width = width
        self.hidden = hidden
        self.centres = nn.Sequential(
            *_conv_block(3, width),  # 32x32: colour and edges
            nn.MaxPool2d(2),
            *_conv_block(width, 2 * width),  # 16x16: corners, arms, points
            nn.MaxPool2d(2),
            *_conv_block(2 * width, 4 * width),  # 8x8: whole objects (receptive field 18 px)
            *_conv_block(4 * width, 4 * width),  # 26 px: neighbours, so one cell claims each centre
            nn.Conv2d(4 * width, hidden, 1),
            nn.ReLU(),
            nn.Conv2d(hidden, 1 + len(PAIRS), 1),  # class 0: no centre in this cell
        )
        self.log_count_sigma = nn.Parameter(torch.tensor(math.log(0.3)))
        cell_centres = [(i + 0.5) / GRID for i in range(GRID)]
        regions = [[[in_position(x, y, p) for x in cell_centres] for y in cell_centres] for p in POSITIONS]
        self.register_buffer("region_cells", torch.tensor(regions, dtype=torch.float32), persistent=False)

    def forward(self, images: Tensor) -> Tensor:
        """Centre logits [B, 1 + pairs, GRID, GRID] of images [B, 3, H, W] in [0, 1]."""
        return self.centres(_prepare(images))

    def read_out(self, centre_logits: Tensor) -> tuple[Tensor, Tensor]:
        """Count probabilities [B, pairs, MAX_COUNT + 1] and region probabilities [B, pairs, regions]."""
        centre_probs = centre_logits.softmax(1)[:, 1:]  # [B, pairs, GRID, GRID]
        expected = centre_probs.sum((2, 3))
        counts = torch.arange(MAX_COUNT + 1, dtype=expected.dtype, device=expected.device)
        distance = expected[..., None] - counts
        distance = torch.where(counts == MAX_COUNT, distance.clamp(max=0), distance)  # E >= 4: "4 or more"
        count_probs = (-(distance**2) / (2 * self.log_count_sigma.exp() ** 2)).softmax(-1)
        in_region = torch.einsum("bpyx,ryx->bpr", centre_probs, self.region_cells)
        return count_probs, in_region / expected[..., None].clamp_min(1e-6)

    @torch.inference_mode()
    def predict(self, images: ImageBatch) -> tuple[Tensor, Tensor]:
        """Count probabilities [B, pairs, MAX_COUNT + 1] and region probabilities [B, pairs, regions]."""
        return self.read_out(self(_as_batch(images, self.log_count_sigma.device)))

    @torch.inference_mode()
    def score(
        self, images: ImageBatch, specs: Sequence[PromptSpec | str], unmentioned: bool = False
    ) -> Tensor:
        """Expected fraction of each prompt's checks that the image passes, in [0, 1]; shape [B].

        `unmentioned` adds one check: no object of a colour-shape pair the prompt does not name,
        P(count == 0) multiplied over those pairs. Like every check it earns its share on its own: an
        image with no object at all passes it (and fails the others).
        """
        if len(images) != len(specs):
            raise ValueError(f"{len(images)} images but {len(specs)} prompts")
        count_probs, region_probs = self.predict(images)
        scores = []
        for sample, spec in enumerate(specs):
            spec = parse_prompt(spec) if isinstance(spec, str) else spec
            checks = [count_probs[sample, _pair_index(r), r.count] for r in spec.requirements]
            if spec.position is not None:
                pair = _pair_index(spec.requirements[0])
                region = POSITIONS.index(spec.position)
                checks.append(count_probs[sample, pair, 1] * region_probs[sample, pair, region])
            if unmentioned:
                named = [_pair_index(r) for r in spec.requirements]
                others = [pair for pair in range(len(PAIRS)) if pair not in named]
                checks.append(count_probs[sample, others, 0].prod())
            scores.append(torch.stack(checks).mean())
        return torch.stack(scores).float() if scores else torch.zeros(0)

    @torch.inference_mode()
    def objects_by_shape(
        self, images: ImageBatch, specs: Sequence[PromptSpec]
    ) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
        """What the count head sees of each shape, per image: (drawn, found, asked), each keyed by shape.

        drawn[shape] [B]: objects of that shape, any colour (each pair's expected count, sum over n of
        n P(count = n), summed over colours). found[shape] [B]: the fraction of the objects of that
        shape the prompt asks for that are drawn in the asked colour, each asked pair's expected count
        capped at the number asked; 0 where asked[shape] [B] (bool) says the prompt asks for none.
        Where `score` says whether the prompt was met, this says what was drawn instead: a policy that
        turns asked triangles into circles shows drawn circles up, triangles and found triangles down.
        """
        if len(images) != len(specs):
            raise ValueError(f"{len(images)} images but {len(specs)} prompts")
        count_probs, _ = self.predict(images)
        expected = (count_probs * torch.arange(MAX_COUNT + 1, dtype=count_probs.dtype)).sum(-1).cpu()
        drawn = {
            shape: expected[:, [i for i, pair in enumerate(PAIRS) if pair[1] == shape]].sum(1).float()
            for shape in SHAPES
        }
        found = {shape: torch.zeros(len(specs)) for shape in SHAPES}
        asked = {shape: torch.zeros(len(specs), dtype=torch.bool) for shape in SHAPES}
        for sample, spec in enumerate(specs):
            for shape in SHAPES:
                wanted = [r for r in spec.requirements if r.shape == shape]
                if wanted:
                    got = sum(min(float(expected[sample, _pair_index(r)]), r.count) for r in wanted)
                    found[shape][sample] = got / sum(r.count for r in wanted)
                    asked[shape][sample] = True
        return drawn, found, asked


def _pair_index(requirement: Requirement) -> int:
    return PAIRS.index((requirement.colour, requirement.shape))


def _prepare(images: Tensor) -> Tensor:
    """Clamp to [0, 1] and resize to 32x32 (antialiased when shrinking)."""
    images = images.float().clamp(0, 1)
    if images.shape[-2:] != (IMAGE_SIZE, IMAGE_SIZE):
        antialias = min(images.shape[-2:]) > IMAGE_SIZE
        images = F.interpolate(images, (IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", antialias=antialias)
    return images


def _as_batch(images: ImageBatch, device: torch.device) -> Tensor:
    """A [B, 3, 32, 32] batch from a batch tensor or from a list of [3, H, W] images of any sizes."""
    if isinstance(images, Tensor):
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be [B, 3, H, W], got shape {tuple(images.shape)}")
        return _prepare(images.to(device))
    if not images:
        return torch.zeros(0, 3, IMAGE_SIZE, IMAGE_SIZE, device=device)
    return torch.cat([_as_batch(image.unsqueeze(0), device) for image in images])


# ---------------------------------------------------------------------------------------------
# Saving and loading


def save_scorer(scorer: AlignmentScorer, out_dir: str | Path, info: dict[str, Any]) -> None:
    """Weights as safetensors and config.json (architecture, vocabulary, and `info`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in scorer.state_dict().items()}, out_dir / WEIGHTS_FILE)
    config = {
        "architecture": {"width": scorer.width, "hidden": scorer.hidden},
        "image_size": IMAGE_SIZE,
        "grid": GRID,
        "max_count": MAX_COUNT,
        "colours": list(COLOURS),
        "shapes": list(SHAPES),
        "positions": list(POSITIONS),
        **info,
    }
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_scorer(path: str | Path | None = None) -> AlignmentScorer:
    """The scorer saved in `path` (default: the shipped one), in eval mode on the CPU."""
    directory = Path(path) if path is not None else DEFAULT_DIR
    weights, config_path = directory / WEIGHTS_FILE, directory / CONFIG_FILE
    for needed in (weights, config_path):
        if not needed.is_file():
            raise FileNotFoundError(
                f"alignment scorer file {needed} is missing; rebuild the shipped scorer with "
                f"`{REBUILD_COMMAND}` (or pass the directory of one saved by train_scorer)"
            )
    config = json.loads(config_path.read_text())
    expected = {
        "colours": list(COLOURS),
        "shapes": list(SHAPES),
        "positions": list(POSITIONS),
        "image_size": IMAGE_SIZE,
        "grid": GRID,
        "max_count": MAX_COUNT,
    }
    for key, value in expected.items():
        if config.get(key) != value:
            raise ValueError(
                f"scorer in {directory} was trained for {key} = {config.get(key)}, but this code has "
                f"{value}; rebuild it with `{REBUILD_COMMAND}`"
            )
    scorer = AlignmentScorer(**config["architecture"])
    scorer.load_state_dict(load_file(weights))
    return scorer.eval()


# ---------------------------------------------------------------------------------------------
# Training and evaluation


def scene_targets(scenes: Sequence[Scene]) -> tuple[Tensor, Tensor]:
    """Centre classes [B, GRID, GRID] (0 none, 1 + pair index) and counts [B, pairs] (<= MAX_COUNT)."""
    centres = torch.zeros(len(scenes), GRID, GRID, dtype=torch.long)
    counts = torch.zeros(len(scenes), len(PAIRS), dtype=torch.long)
    for row, scene in enumerate(scenes):
        for obj in scene.objects:
            pair = PAIRS.index((obj.colour, obj.shape))
            centres[row, min(int(obj.y * GRID), GRID - 1), min(int(obj.x * GRID), GRID - 1)] = 1 + pair
            counts[row, pair] += 1
    return centres, counts.clamp(max=MAX_COUNT)


def sample_training_scenes(rng: np.random.Generator, n: int) -> list[Scene]:
    """Half prompt scenes (what a text-to-image model is asked for), half cluttered scenes."""
    return [sample_scene(rng) if rng.random() < 0.5 else sample_cluttered_scene(rng) for _ in range(n)]


def with_noise_images(
    images: Tensor, scenes: Sequence[Scene], generator: torch.Generator, fraction: float = NOISE_FRACTION
) -> tuple[Tensor, list[Scene]]:
    """Some images swapped for pixel noise that holds no object, so that noise earns no reward."""
    batch = images.shape[0]
    is_noise = torch.rand(batch, generator=generator) < fraction
    level = torch.rand(batch, 3, 1, 1, generator=generator)
    spread = 0.5 * torch.rand(batch, 1, 1, 1, generator=generator)
    noise = (level + spread * torch.randn(images.shape, generator=generator)).clamp(0, 1)
    images = torch.where(is_noise[:, None, None, None], noise, images)
    return images, [
        Scene(()) if noise_only else scene for scene, noise_only in zip(scenes, is_noise, strict=True)
    ]


def augment(images: Tensor, generator: torch.Generator) -> Tensor:
    """Colour jitter, blur (some images also at half resolution) and pixel noise: the defects of a
    small diffusion model's samples."""
    batch = images.shape[0]

    def uniform(*shape: int, low: float = -1.0, high: float = 1.0) -> Tensor:
        return low + (high - low) * torch.rand(*shape, generator=generator)

    images = images * (1 + 0.12 * uniform(batch, 3, 1, 1)) + 0.06 * uniform(batch, 1, 1, 1)
    halved = F.interpolate(images, scale_factor=0.5, mode="bilinear", antialias=True)
    halved = F.interpolate(halved, size=images.shape[-2:], mode="bilinear")
    images = torch.where(torch.rand(batch, 1, 1, 1, generator=generator) < 0.25, halved, images)
    kernel = torch.tensor([1.0, 2.0, 1.0])
    kernel = (kernel[:, None] * kernel[None, :] / 16).expand(3, 1, 3, 3)
    blurred = F.conv2d(F.pad(images, (1, 1, 1, 1), mode="replicate"), kernel, groups=3)
    blur = uniform(batch, 1, 1, 1, low=0.0) * (torch.rand(batch, 1, 1, 1, generator=generator) < 0.5)
    images = images + blur * (blurred - images)
    noise = uniform(batch, 1, 1, 1, low=0.0, high=0.08) * torch.randn(images.shape, generator=generator)
    return (images + noise).clamp(0, 1)


def train_scorer(
    steps: int = 2500,
    batch_size: int = 64,
    seed: int = 0,
    out_dir: str | Path = DEFAULT_DIR,
    lr: float = 2e-3,
    eval_scenes: int = 2000,
) -> dict[str, Any]:
    """Train a scorer on fresh synthetic scenes, measure it on unseen ones, save it; the metrics.

    Loss: cross-entropy of every cell's centre class plus the negative log-likelihood of every
    pair's true count (which teaches sigma and keeps a centre from being spread over cells). The
    same arguments give the same scenes, augmentations and initial weights.
    """
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        scorer = AlignmentScorer()
    optimizer = torch.optim.AdamW(scorer.parameters(), lr=lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
    )
    started = time.perf_counter()
    progress = tqdm(range(steps), desc="alignment scorer", disable=None)
    for _ in progress:
        scenes = sample_training_scenes(rng, batch_size)
        images, scenes = with_noise_images(render_batch(scenes), scenes, generator)
        centres, counts = scene_targets(scenes)
        centre_logits = scorer(augment(images, generator))
        count_probs, _ = scorer.read_out(centre_logits)
        count_nll = -count_probs.gather(-1, counts[..., None]).clamp_min(1e-6).log().mean()
        loss = F.cross_entropy(centre_logits, centres) + count_nll
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        progress.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    train_seconds = time.perf_counter() - started
    scorer.eval()
    heldout = evaluate_scorer(scorer, eval_scenes, seed=seed + 1_000_003)
    default_out = Path(out_dir).resolve() == DEFAULT_DIR
    rebuild = REBUILD_COMMAND if default_out else f"python -m diffusion_rl.alignment --out {out_dir}"
    command = (
        f"{rebuild} --steps {steps} --batch-size {batch_size} --seed {seed} --lr {lr} "
        f"--eval-scenes {eval_scenes} --threads {torch.get_num_threads()}"
    )
    info = {
        "training": {
            "steps": steps,
            "batch_size": batch_size,
            "seed": seed,
            "lr": lr,
            "seconds": round(train_seconds, 1),
            "torch_threads": torch.get_num_threads(),
        },
        "rebuild_command": command,
        "heldout": heldout,
    }
    save_scorer(scorer, out_dir, info)
    return info


def evaluate_scorer(scorer: AlignmentScorer, n_scenes: int, seed: int) -> dict[str, Any]:
    """Accuracy on fresh scenes (a seed training never uses), clean and augmented.

    count_accuracy: most likely count right, over every pair of every scene (mostly zeros);
    count_accuracy_present: the same over the pairs a scene holds; position_accuracy: each region's
    probability on the right side of 0.5, for pairs with one object. Prompt scores: prompt scenes
    against their own prompt, against it with one attribute made wrong (`corrupt_spec`), and
    images of uniform pixel noise against the same prompts.
    """
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    mixed = sample_training_scenes(rng, n_scenes)
    prompted = [sample_scene(rng) for _ in range(n_scenes)]
    clean = {"mixed": render_batch(mixed), "prompted": render_batch(prompted)}
    images = {"clean": clean, "augmented": {name: augment(x, generator) for name, x in clean.items()}}
    own_specs = [spec_for(scene) for scene in prompted]
    noise = torch.rand(n_scenes, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    wrong_specs = {
        attribute: [
            corrupt_spec(spec, scene, attribute, rng) for spec, scene in zip(own_specs, prompted, strict=True)
        ]
        for attribute in CORRUPTIONS
    }
    _, counts = scene_targets(mixed)
    lone = [(row, PAIRS.index(obj[:2]), obj) for row, s in enumerate(mixed) for obj in s.objects]
    lone = [(row, pair, obj) for row, pair, obj in lone if counts[row, pair] == 1]
    regions = torch.tensor(
        [[in_position(obj.x, obj.y, p) for p in POSITIONS] for _, _, obj in lone], dtype=torch.bool
    ).view(-1, len(POSITIONS))
    results: dict[str, Any] = {"scenes": n_scenes, "seed": seed}
    for condition, batches in images.items():
        count_probs, region_probs = scorer.predict(batches["mixed"])
        count_right = count_probs.argmax(-1) == counts
        lone_regions = region_probs[[row for row, _, _ in lone], [pair for _, pair, _ in lone]]
        own = scorer.score(batches["prompted"], own_specs)
        metrics = {
            "count_accuracy": _mean(count_right),
            "count_accuracy_present": _mean(count_right[counts > 0]),
            "position_accuracy": _mean((lone_regions > 0.5) == regions),
            "score_own_prompt": _mean(own),
            "score_own_prompt_by_template": {
                template: _mean(own[[spec.template == template for spec in own_specs]])
                for template in TEMPLATES
            },
        }
        for attribute, specs in wrong_specs.items():
            rows = [row for row, spec in enumerate(specs) if spec is not None]
            wrong = scorer.score(batches["prompted"][rows], [specs[row] for row in rows])
            metrics[f"score_wrong_{attribute}"] = _mean(wrong)
        results[condition] = metrics
    results["score_uniform_noise_images"] = _mean(scorer.score(noise, own_specs))
    return results


def _mean(values: Tensor) -> float:
    return round(values.float().mean().item(), 4)


def corrupt_spec(
    spec: PromptSpec, scene: Scene, attribute: str, rng: np.random.Generator
) -> PromptSpec | None:
    """The prompt with one attribute wrong for this scene, or None where the attribute does not apply.

    colour / shape: every object phrase names a colour (shape) whose pair the scene does not hold;
    count: a count prompt asks for another number; position: a position prompt names a region the
    object is not in (its count check still holds, so a perfect scorer gives 0.5).
    """
    present = {(obj.colour, obj.shape) for obj in scene.objects}
    if attribute == "colour":
        requirements = tuple(
            r._replace(colour=str(rng.choice([c for c in COLOURS if (c, r.shape) not in present])))
            for r in spec.requirements
        )
        return PromptSpec(requirements, spec.position)
    if attribute == "shape":
        requirements = tuple(
            r._replace(shape=str(rng.choice([s for s in SHAPES if (r.colour, s) not in present])))
            for r in spec.requirements
        )
        return PromptSpec(requirements, spec.position)
    if attribute == "count":
        if spec.template != "count":
            return None
        (requirement,) = spec.requirements
        others = [n for n in range(1, MAX_PROMPT_COUNT + 1) if n != requirement.count]
        return PromptSpec((requirement._replace(count=int(rng.choice(others))),))
    if attribute == "position":
        if spec.position is None:
            return None
        (obj,) = scene.objects
        elsewhere = [p for p in POSITIONS if not in_position(obj.x, obj.y, p)]
        return PromptSpec(spec.requirements, str(rng.choice(elsewhere)))
    raise ValueError(f"unknown attribute {attribute!r}; choose one of {', '.join(CORRUPTIONS)}")


# ---------------------------------------------------------------------------------------------
# Strict checks: what geneval_mini lets slide (a gold reward)

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


# ---------------------------------------------------------------------------------------------
# Reward and command line


@REWARDS.register("geneval_mini")
def geneval_mini(
    path: str | None = None, device: str = "cpu", unmentioned: bool = False
) -> Callable[..., Tensor]:
    """Compositional alignment of coloured-shape images with their prompts, in [0, 1] (see module doc).

    `path`: a directory saved by `train_scorer` (default: the shipped scorer). `unmentioned`: also
    check that no object the prompt does not name is drawn (GenEval, like the default, ignores
    them; a policy trained without this check learns to add them). Images: [B, 3, H, W] in [0, 1]
    or a list of [3, H, W]; prompts outside the grammar raise ValueError.
    """
    scorer = load_scorer(path).to(device)

    def reward(images: ImageBatch, prompts: Sequence[str], **_: Any) -> Tensor:
        return scorer.score(images, [parse_prompt(prompt) for prompt in prompts], unmentioned).cpu()

    return reward


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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m diffusion_rl.alignment",
        description="Train the alignment scorer of the coloured-shapes world on fresh synthetic scenes, "
        "measure it on unseen ones and save it (safetensors + config.json).",
    )
    parser.add_argument("--out", default=str(DEFAULT_DIR), help="output directory (default: the shipped one)")
    parser.add_argument("--steps", type=int, default=2500, help="training steps")
    parser.add_argument("--batch-size", type=int, default=64, help="scenes per step")
    parser.add_argument("--seed", type=int, default=0, help="seed of scenes, augmentations and weights")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (cosine decay)")
    parser.add_argument("--eval-scenes", type=int, default=2000, help="fresh scenes for the held-out metrics")
    parser.add_argument(
        "--threads", type=int, help="torch CPU threads (1 is faster when other jobs share the cores)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    info = train_scorer(args.steps, args.batch_size, args.seed, args.out, args.lr, args.eval_scenes)
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
