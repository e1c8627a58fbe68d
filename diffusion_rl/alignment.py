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
accuracy); `diffusion_rl.alignment_training` trains, measures and rebuilds them (``python -m
diffusion_rl.alignment_training``). The pixel-level gold reward `shapes_strict` is
`diffusion_rl.shapes_strict`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from diffusion_rl.shapes import (
    COLOURS,
    PAIRS,
    POSITIONS,
    SHAPES,
    PromptSpec,
    Requirement,
    in_position,
    parse_prompt,
)
from mmrl.registry import REWARDS

IMAGE_SIZE = 32
GRID = 8  # centre cells per side
MAX_COUNT = 4  # count classes 0..MAX_COUNT, the last meaning "MAX_COUNT or more"
DEFAULT_DIR = Path(__file__).resolve().parent / "assets" / "alignment_scorer"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
REBUILD_COMMAND = "python -m diffusion_rl.alignment_training --out diffusion_rl/assets/alignment_scorer"

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
# The reward


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
