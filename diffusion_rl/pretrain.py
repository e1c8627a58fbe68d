"""`mmrl pretrain diffusion`: the tiny text-to-image base model that the RL recipes start from.

A pixel-space SD3-architecture flow transformer learns, by flow matching, to draw the procedurally
generated coloured-shape scenes of `diffusion_rl.shapes` from their prompts. Prompts are dropped
10% of the time so classifier-free guidance works. An EMA of the weights is kept and is what gets
saved (``OUTPUT_DIR/pipeline``, loadable with `diffusion_rl.loading.load`). Every random draw
of a step comes from a generator seeded by (seed, step), so resuming needs no extra state.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from diffusion_rl.models import FlowPipeline, TinyFlowSpec
from diffusion_rl.sampling import evaluate_alignment
from diffusion_rl.shapes import make_dataset, vocabulary
from mmrl.config import BaseConfig, ConfigError, option
from mmrl.registry import TRAINERS
from mmrl.trainer import Trainer


@dataclass
class PretrainModelConfig:
    image_size: int = option(32, "image side in pixels", min=8)
    backbone: Literal["sd3", "unet"] = option(
        "sd3", "denoiser: SD3Transformer2DModel or UNet2DConditionModel (convolutional)"
    )
    unet_channels: list[int] = option(
        [32, 64, 64], "UNet channels per resolution (attention at the last)", min=8
    )
    patch_size: int = option(4, "transformer patch size", min=1)
    layers: int = option(4, "transformer layers", min=1)
    heads: int = option(2, "attention heads", min=1)
    head_dim: int = option(32, "width of one attention head", min=8)
    text_hidden: int = option(64, "text encoder width", min=8)
    text_layers: int = option(2, "text encoder layers", min=1)
    prediction: Literal["velocity", "sample"] = option("velocity", "network output: velocity or clean sample")


@dataclass
class PretrainTrainConfig:
    lr: float = option(1e-3, "AdamW learning rate", min=0.0)
    warmup_steps: int = option(100, "linear warm-up steps", min=0)
    batch_size: int = option(64, "images per step", min=1)
    prompt_dropout: float = option(0.1, "probability of training a sample unconditionally", min=0.0, max=1.0)
    ema_decay: float = option(0.999, "EMA decay of the saved weights", min=0.0, max=1.0)
    sigma_sampling: Literal["uniform", "logit_normal"] = option(
        "uniform", "training noise levels: uniform, or logit-normal as SD3 (rarely near sigma = 1)"
    )


@dataclass
class PretrainEvalConfig:
    prompts: int = option(64, "held-out prompts sampled at evaluation", min=1)
    steps: int = option(20, "ODE sampling steps", min=1)
    guidance_scale: float = option(3.0, "classifier-free guidance at evaluation", min=1.0)


@dataclass
class DiffusionPretrainConfig(BaseConfig):
    trainer: str = option("diffusion_pretrain", "trainer name", registry="trainer")
    model: PretrainModelConfig = dataclasses.field(default_factory=PretrainModelConfig)
    train: PretrainTrainConfig = dataclasses.field(default_factory=PretrainTrainConfig)
    eval: PretrainEvalConfig = dataclasses.field(default_factory=PretrainEvalConfig)

    def __post_init__(self) -> None:
        m = self.model
        if m.backbone == "sd3" and m.image_size % m.patch_size:
            fits = m.image_size - m.image_size % m.patch_size
            raise ConfigError(
                f"config error: model.image_size = {m.image_size} is not a multiple of model.patch_size = "
                f"{m.patch_size}: the transformer draws whole patches; use model.image_size={fits} or a "
                "patch_size that divides it"
            )


@TRAINERS.register("diffusion_pretrain")
class DiffusionPretrainTrainer(Trainer):
    config_class = DiffusionPretrainConfig
    config: DiffusionPretrainConfig

    def setup(self) -> None:
        cfg = self.config
        sizes = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "prediction"}
        spec = TinyFlowSpec(**{**sizes, "unet_channels": tuple(cfg.model.unet_channels)})
        self.pipe = FlowPipeline.tiny(vocabulary(), spec, seed=cfg.seed, prediction=cfg.model.prediction)
        self.pipe.to(self.accelerator.device)
        self.ema = copy.deepcopy(self.pipe.denoiser).requires_grad_(False)
        warmup = cfg.train.warmup_steps
        self.prepare_model_and_optimizer(
            self.pipe.denoiser,
            lr=cfg.train.lr,
            weight_decay=0.0,
            lr_factor=lambda i: min(1.0, (i + 1) / (warmup + 1)),
        )
        self.uncond = self.pipe.encode_prompts([""])

    def trainer_state(self) -> dict[str, Any]:
        return {"ema": self.ema.state_dict()}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.ema.load_state_dict(state["ema"])

    def train_step(self, step: int) -> dict[str, Any]:
        cfg = self.config
        rank = self.accelerator.process_index
        images, prompts, _ = make_dataset(
            cfg.train.batch_size, seed=(cfg.seed * 1_000_003 + step) * 64 + rank, size=cfg.model.image_size
        )
        g = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 64 + rank)
        drop = torch.rand(len(prompts), generator=g) < cfg.train.prompt_dropout
        prompts = ["" if d else p for p, d in zip(prompts, drop.tolist(), strict=True)]
        device = self.accelerator.device
        x0 = self.pipe.encode_images(images.to(device))
        noise = torch.randn(x0.shape, generator=g).to(device)
        if cfg.train.sigma_sampling == "uniform":
            sigma = torch.rand(len(prompts), generator=g).to(device)
        else:
            sigma = torch.sigmoid(torch.randn(len(prompts), generator=g)).to(device)
        s = sigma.view(-1, 1, 1, 1)
        x_sigma = (1 - s) * x0 + s * noise
        cond = self.pipe.encode_prompts(prompts)
        pred = self.pipe.velocity(x_sigma, sigma, cond, denoiser=self.model)
        loss = F.mse_loss(pred.float(), (noise - x0).float())
        grad_norm = self.optimizer_step(loss, max_grad_norm=1.0)
        self.scheduler.step()
        with torch.no_grad():
            decay = min(cfg.train.ema_decay, (1 + step) / (10 + step))
            for ema_p, p in zip(self.ema.parameters(), self.pipe.denoiser.parameters(), strict=True):
                ema_p.lerp_(p, 1 - decay)
        return {"loss": loss.detach(), "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0]}

    def ema_pipeline(self) -> FlowPipeline:
        return self.pipe.with_denoiser(self.ema)

    def evaluate(self) -> dict[str, float]:
        cfg = self.config.eval
        return evaluate_alignment(
            self.ema_pipeline(),
            num_prompts=cfg.prompts,
            steps=cfg.steps,
            guidance_scale=cfg.guidance_scale,
            seed=self.config.seed,
            grid_path=self.samples_dir / "heldout_grid.png" if self.is_main else None,
        )

    def train(self) -> dict[str, Any]:
        result = super().train()
        if self.is_main:
            self.ema_pipeline().save_pretrained(self.run_dir / "pipeline")
        return result
