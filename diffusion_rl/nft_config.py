"""The `diffusion_nft` config (DiffusionNFT: forward-process RL on clean samples) and its size check.

The model, reward and evaluation sections are BranchGRPO's (`diffusion_rl.config`); rollouts are
groups of samples per prompt from any solver, and the update has its own knobs (`beta`, the old
policy's decay schedule, timesteps per sample)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from diffusion_rl.config import EvalConfig, ModelConfig, RewardConfig, call_rows_option
from diffusion_rl.inputs import check_prompt_count
from diffusion_rl.models import FlowPipeline
from mmrl.advantages import check_group_size
from mmrl.config import BaseConfig, ConfigError, option
from mmrl.resources import check_memory

# latent-sized tensors one sample's denoiser forward holds at its peak (rough, from the tiny UNet)
FORWARD_LATENTS = 64
TRAINING_LATENTS = 512  # the same with gradients


@dataclass
class NFTRolloutConfig:
    prompts_per_step: int = option(4, "prompts per step on each process", min=1)
    group_size: int = option(16, "samples per prompt (one group of the advantage)", min=2, max=1024)
    steps: int = option(10, "denoising steps", min=1)
    image_size: int | None = option(
        None,
        "image side in pixels (null: the model's own size)",
        min=1,
        max=4096,
        why="models draw up to 2048 px",
    )
    solver: Literal["ode", "sde"] = option(
        "ode", "ode: deterministic (seeded initial noise only); sde: Flow-GRPO's stochastic steps"
    )
    noise_level: float = option(0.7, "Flow-GRPO a of the sde solver", min=0.0)
    ode_stride: int = option(
        1, "ode solver: steps taken this many at a time, second-order; 1: one Euler step each", min=1
    )
    guidance_scale: float = option(
        1.0, "classifier-free guidance while sampling (1: none; the update never uses guidance)", min=1.0
    )
    call_rows: int | None = call_rows_option()


@dataclass
class NFTExploreConfig:
    """Sol-RL: a large pool explored in low precision, its best and worst regenerated in full precision."""

    enabled: bool = option(False, "explore a candidate pool in low precision and train on its extremes")
    precision: str = option("nvfp4-emulated", "precision of the exploration pass", registry="precision")
    pool: int = option(
        64,
        "candidates per prompt explored (rollout.group_size of them are kept)",
        min=2,
        max=4096,
        why="pool",
    )
    steps: int | None = option(None, "denoising steps while exploring (null: rollout.steps)", min=1)
    quantize_activations: bool = option(False, "also fake-quantise Linear inputs (W4A4)")


@dataclass
class NFTTrainConfig:
    lr: float = option(1e-4, "AdamW learning rate", min=0.0)
    beta: float = option(
        1.0, "strength of the implicit positive / negative policies around the old one", min=1e-6
    )
    advantage: str = option(
        "grpo_global_std",
        "group advantage estimator whose values map to optimality r = clip(A, -C, C) / 2C + 1/2 "
        "(grpo_global_std: DiffusionNFT's per-prompt mean over the batch's std)",
        registry="advantage",
        kinds=("group",),
    )
    adv_clip: float = option(5.0, "C: advantages clipped to [-C, C] before the map to [0, 1]", min=1e-6)
    loss: str = option(
        "diffusion_nft",
        "forward-process loss on the clean samples (see `mmrl list`)",
        registry="loss",
        kinds=("forward_process",),
    )
    loss_scale: float | None = option(
        None, "multiplies the policy term (null: train.adv_clip, as DiffusionNFT's code)", min=0.0
    )
    noise_levels: Literal["sampler", "uniform"] = option(
        "sampler",
        "where a clean sample's noise levels come from: sampler, a keyed draw without repeats from the "
        "rollout's own rollout.steps levels (DiffusionNFT's code); uniform, t ~ U(0, 1)",
    )
    timesteps_per_sample: int | None = option(
        None,
        "noise levels per clean sample and update (null: DiffusionNFT's int(0.99 x rollout.steps))",
        min=1,
        max=1000,
        why="each costs a forward",
    )
    old_decay_start: int = option(
        0, "the old policy equals the trained one (decay 0) for this many optimizer steps", min=0
    )
    old_decay_rate: float = option(
        0.001, "after that, its EMA decay grows this much per optimizer step", min=0.0
    )
    old_decay_max: float = option(0.5, "up to this decay", min=0.0, max=0.9999)
    kl_coef: float = option(
        0.0, "weight of the squared velocity difference to the frozen start model", min=0.0
    )
    max_grad_norm: float = option(1.0, "gradient clipping norm", min=0.0)
    minibatches: int = option(1, "optimizer steps per iteration, each on a shuffled share", min=1)
    micro_batch: int = option(16, "noised samples per forward/backward", min=1)
    sampler: str = option(
        "uniform",
        "prompt sampler (dynamic_filter and beta_thompson learn from every prompt's rewards)",
        registry="sampler",
    )
    sampler_options: dict = option(
        {}, "keyword options of the sampler, e.g. {success_threshold: 0.7} on the reward's scale"
    )
    nan_patience: int = option(3, "consecutive non-finite steps before the run stops", min=1)
    ema_decay: float = option(
        0.0, "EMA of the trained weights, used to evaluate and save the result (0: off)", min=0.0, max=0.9999
    )


@dataclass
class DiffusionNFTConfig(BaseConfig):
    trainer: str = option("diffusion_nft", "trainer name", registry="trainer")
    prompt_file: str | None = option(None, "text file with one prompt per line (null: the shapes prompts)")
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: NFTRolloutConfig = field(default_factory=NFTRolloutConfig)
    explore: NFTExploreConfig = field(default_factory=NFTExploreConfig)
    train: NFTTrainConfig = field(default_factory=NFTTrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        check_group_size(self.train.advantage, self.rollout.group_size, "rollout.group_size")
        levels, steps = self.train.timesteps_per_sample, self.rollout.steps
        if self.train.noise_levels == "sampler" and levels is not None and levels > steps:
            raise ConfigError(
                f"config error: train.timesteps_per_sample = {levels} noise levels per sample, but "
                f"train.noise_levels = 'sampler' draws them without repeats from the rollout's "
                f"rollout.steps = {steps}: use at most {steps}, or train.noise_levels=uniform"
            )
        e, group = self.explore, self.rollout.group_size
        if e.enabled and (group % 2 or group > e.pool):
            raise ConfigError(
                f"config error: with explore.enabled, rollout.group_size = {group} samples per prompt are "
                f"the best half and the worst half of explore.pool = {e.pool} candidates: it must be even "
                "and at most the pool"
            )


def noise_levels_per_sample(cfg: DiffusionNFTConfig) -> int:
    """How many noise levels each clean sample is trained at per update: `train.timesteps_per_sample`,
    or DiffusionNFT's int(0.99 x rollout.steps) of the sampler's levels (at least one)."""
    levels = cfg.train.timesteps_per_sample
    return levels if levels is not None else max(1, int(0.99 * cfg.rollout.steps))


def check_nft_size(
    cfg: DiffusionNFTConfig, pipe: FlowPipeline, prompts: int, processes: int, device: torch.device
) -> None:
    """Refuse a step that would draw a prompt twice or that cannot fit on `device`: a step samples
    every group at once (twice the rows with guidance) and keeps its clean latents and their noised
    copies; each update runs `train.micro_batch` noised samples with gradients."""
    r, t = cfg.rollout, cfg.train
    check_prompt_count(cfg, prompts, processes)
    latent = 4 * math.prod(pipe.latent_shape())
    side = pipe.latent_shape()[-1] * pipe.vae_scale
    rows = r.prompts_per_step * max(r.group_size, cfg.explore.pool if cfg.explore.enabled else 0)
    guided = 2 if r.guidance_scale != 1.0 else 1
    levels = noise_levels_per_sample(cfg)
    kept = rows * (1 + 3 * levels)  # clean latents; noised latents, noise, old velocity
    need = latent * (kept + guided * FORWARD_LATENTS * rows) + 4 * 3 * side**2 * rows
    check_memory(
        need + 2 * t.micro_batch * TRAINING_LATENTS * latent,
        f"a step of {r.prompts_per_step} prompts x {rows // r.prompts_per_step} samples of {side}x{side} px, "
        f"{levels} noise levels each, and updates of {t.micro_batch} noised samples "
        "(rollout.prompts_per_step x rollout.group_size or explore.pool, rollout.image_size, "
        "train.micro_batch)",
        ["rollout.prompts_per_step", "explore.pool" if cfg.explore.enabled else "rollout.group_size"]
        + ["rollout.image_size", "train.micro_batch"],
        device,
    )
