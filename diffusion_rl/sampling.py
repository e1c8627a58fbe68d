"""Deterministic ODE sampling and held-out evaluation of a flow model on the shapes prompts."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from diffusion_rl.models import FlowPipeline
from diffusion_rl.sde import initial_noise_std, ode_step
from diffusion_rl.shapes import heldout_prompts, parse_prompt
from mmrl.noise import NoiseKey, keyed_randn_batch

EVAL_STEP = 2**40  # the `step` field of evaluation noise keys: never a training step


@torch.no_grad()
def sample_ode(
    pipe: FlowPipeline,
    prompts: Sequence[str],
    steps: int,
    guidance_scale: float,
    seed: int,
    prompt_ids: Sequence[int] | None = None,
    batch_size: int = 64,
) -> torch.Tensor:
    """Images [N, 3, H, W] in [0, 1]; the initial noise of prompt i is keyed by (seed, eval, id_i)."""
    ids = list(prompt_ids) if prompt_ids is not None else list(range(len(prompts)))
    sigmas = pipe.sigmas(steps)
    uncond_one = pipe.encode_prompts([""])
    images = []
    for start in range(0, len(prompts), batch_size):
        chunk, chunk_ids = list(prompts[start : start + batch_size]), ids[start : start + batch_size]
        keys = [NoiseKey(seed, EVAL_STEP, i, 0) for i in chunk_ids]
        x = keyed_randn_batch(pipe.latent_shape(), keys, device=pipe.device) * initial_noise_std(sigmas[0])
        cond = pipe.encode_prompts(chunk)
        uncond = uncond_one[[0] * len(chunk)]
        for i in range(steps):
            sigma = sigmas[i].expand(len(chunk))
            v = pipe.velocity(x, sigma, cond, guidance_scale, uncond)
            x = ode_step(v, x, sigmas[i], sigmas[i + 1])
        images.append(pipe.decode(x))
    return torch.cat(images)


def evaluation_prompts(num_prompts: int, prompts: Sequence[str] | None = None) -> list[str]:
    """The prompts `evaluate_alignment` samples: the first `num_prompts` of `prompts`, or of the shapes
    world's held-out prompts (`heldout_subset`)."""
    return heldout_subset(num_prompts) if prompts is None else list(prompts)[:num_prompts]


def heldout_subset(num_prompts: int, seed: int = 0) -> list[str]:
    """A fixed, shuffled subset of the held-out prompts (the same for every run with this seed)."""
    prompts = heldout_prompts()
    order = np.random.default_rng(seed).permutation(len(prompts))
    return [prompts[i] for i in order[:num_prompts]]


def save_grid(images: torch.Tensor, path: Path, columns: int = 8, scale: int = 2) -> None:
    """A PNG grid of images in [0, 1]."""
    n, _, h, w = images.shape
    rows = (n + columns - 1) // columns
    canvas = torch.zeros(3, rows * h, columns * w)
    for i, image in enumerate(images.cpu()):
        r, c = divmod(i, columns)
        canvas[:, r * h : (r + 1) * h, c * w : (c + 1) * w] = image
    array = (canvas.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).resize((columns * w * scale, rows * h * scale), Image.NEAREST).save(path)


def evaluate_alignment(
    pipe: FlowPipeline,
    num_prompts: int,
    steps: int,
    guidance_scale: float,
    seed: int,
    grid_path: Path | None = None,
    rewards: Mapping[str, Callable[..., torch.Tensor]] | None = None,
    prompts: Sequence[str] | None = None,
    per_prompt: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """Mean rewards of ODE samples for held-out prompts (fixed prompts and noise): heldout_alignment
    (geneval_mini) for the shapes world's held-out prompts, and heldout_<key> for each of `rewards`
    (reward functions called as ``fn(images, prompts=prompts)``) on the same images. `prompts`: the
    first `num_prompts` of these instead (a user's held-out prompts: only `rewards` score them).
    `per_prompt`, when given, receives each metric's score per prompt, in prompt order: two
    evaluations of one run share prompts and noise, so their scores pair prompt by prompt."""
    from diffusion_rl.alignment import load_scorer

    chosen = evaluation_prompts(num_prompts, prompts)
    images = sample_ode(pipe, chosen, steps, guidance_scale, seed)
    if grid_path is not None:
        save_grid(images[:32], grid_path)
    scores = {}
    if prompts is None:
        scores["heldout_alignment"] = load_scorer().score(images, [parse_prompt(p) for p in chosen]).float()
    for key, fn in (rewards or {}).items():
        scores[f"heldout_{key}"] = fn(images, prompts=chosen).float()
    if per_prompt is not None:
        per_prompt.update({key: values.tolist() for key, values in scores.items()})
    return {key: values.mean().item() for key, values in scores.items()}
