"""Training and measuring the alignment scorer of `geneval_mini` (`diffusion_rl.alignment`).

The scorer learns from freshly drawn scenes (half prompt scenes, half cluttered scenes with
distractors) under colour jitter, blur, halved resolution and pixel noise, with some images replaced
by pixel noise that holds no object; it is measured on unseen scenes, clean and augmented, and against
prompts with one attribute made wrong (`corrupt_spec`). ``python -m diffusion_rl.alignment_training``
rebuilds the shipped scorer in `diffusion_rl/assets/alignment_scorer/`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from diffusion_rl.alignment import (
    DEFAULT_DIR,
    GRID,
    IMAGE_SIZE,
    MAX_COUNT,
    REBUILD_COMMAND,
    AlignmentScorer,
    save_scorer,
)
from diffusion_rl.shapes import (
    COLOURS,
    MAX_PROMPT_COUNT,
    PAIRS,
    POSITIONS,
    SHAPES,
    TEMPLATES,
    PromptSpec,
    Scene,
    in_position,
    render_batch,
    sample_cluttered_scene,
    sample_scene,
    spec_for,
)

CORRUPTIONS = ("colour", "shape", "count", "position")
NOISE_FRACTION = 1 / 16  # training images replaced by pixel noise without objects


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
    rebuild = REBUILD_COMMAND if default_out else f"python -m diffusion_rl.alignment_training --out {out_dir}"
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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m diffusion_rl.alignment_training",
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
