"""Vision pre-stage (`mmrl pretrain vlm_vision`): teach a new tiny VLM's vision tower to read crops.

Why a stage of its own: on the synthetic zoom task a small object is 12-14 px in the crop the tool
returns, and a tiny vision tower learns to name its shape only after many hundred steps of that task
alone (docs/results.md). In operation-aware SFT the only signal for it is the one answer token after a
crop, and the tower never learns there. So this stage trains the tower, through an attention-pooled
classification head over its output tokens (the tokens the language model will read), to name the
small object's shape from exactly the crop a demonstration shows: the detail question's target
region, padded as `round_box` pads it. Every step draws fresh training questions.

The head is thrown away; the whole new VLM (its language model still untrained) is saved to
``OUTPUT_DIR/model``, for `mmrl pretrain vlm model.path=OUTPUT_DIR/model`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mmrl.config import BaseConfig, ConfigError, option
from mmrl.registry import TRAINERS
from mmrl.trainer import Trainer
from vlm_rl.data import DataConfig, QuestionSet, round_box, target_crop
from vlm_rl.models import ImageInput, VLMAdapter
from vlm_rl.sft import VLMModelConfig, load_or_build, warmup_cosine
from vlm_rl.tasks import OPTION_LETTERS, SHAPES


@dataclass
class VisionTrainConfig:
    lr: float = option(1e-3, "AdamW peak learning rate (linear warm-up, cosine decay)", min=0.0)
    warmup_steps: int = option(50, "linear warm-up steps", min=0)
    batch_size: int = option(32, "crops per step on each process", min=1)
    max_grad_norm: float = option(1.0, "gradient clipping norm", min=0.0)


@dataclass
class VLMVisionConfig(BaseConfig):
    trainer: str = option("vlm_vision", "trainer name", registry="trainer")
    model: VLMModelConfig = field(default_factory=VLMModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: VisionTrainConfig = field(default_factory=VisionTrainConfig)


class CropReader(nn.Module):
    """The VLM's vision tower and a head naming the small object's shape from its output tokens."""

    def __init__(self, visual: nn.Module, width: int) -> None:
        super().__init__()
        self.visual = visual
        self.attention = nn.Linear(width, 1)  # which tokens show the object
        self.head = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, len(SHAPES)))

    def forward(self, images: list[ImageInput]) -> torch.Tensor:
        device = self.attention.weight.device
        pixels = torch.cat([image.pixel_values for image in images]).to(device)
        grid = torch.stack([image.grid_thw for image in images]).to(device)
        output = self.visual(pixels, grid_thw=grid)
        tokens = getattr(output, "pooler_output", output)  # transformers 5: the merged tokens
        pooled = []
        for feats in tokens.split([image.num_tokens for image in images]):
            weights = self.attention(feats).softmax(dim=0)
            pooled.append((weights * feats).sum(dim=0))
        return self.head(torch.stack(pooled))


@TRAINERS.register("vlm_vision")
class VLMVisionTrainer(Trainer):
    config_class = VLMVisionConfig
    config: VLMVisionConfig

    def setup(self) -> None:
        cfg = self.config
        if cfg.model.path is not None:
            raise ConfigError(
                "config error: model.path is set, but the vision pre-stage trains the tower of a new tiny "
                "model; leave model.path unset (null)"
            )
        # every question a detail question: each asks the shape of the small object in one region
        data = dataclasses.replace(cfg.data, detail_fraction=1.0)
        self.adapter: VLMAdapter = load_or_build(cfg.model, cfg.data, cfg.seed).to(self.accelerator.device)
        self.train_set = QuestionSet(data, "train")
        heldout = QuestionSet(data, "heldout")
        self.heldout = [self.crop_and_label(heldout[i]) for i in range(len(heldout))]
        width = self.adapter.model.config.text_config.hidden_size  # the merger projects to the LM's width
        reader = CropReader(self.adapter.model.model.visual, width)
        optimizer = torch.optim.AdamW(reader.parameters(), lr=cfg.train.lr)
        self.model, self.optimizer = self.accelerator.prepare(reader, optimizer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: warmup_cosine(step, cfg.train.warmup_steps, cfg.steps)
        )

    def crop_and_label(self, question: Any) -> tuple[ImageInput, int]:
        crop = target_crop(question.image, round_box(question.target_box))
        shape = question.options[OPTION_LETTERS.index(question.answer)]
        return self.adapter.encode_image(crop), SHAPES.index(shape)

    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        correct = 0
        with torch.no_grad():
            for start in range(0, len(self.heldout), 64):
                chunk = self.heldout[start : start + 64]
                predicted = self.model([image for image, _ in chunk]).argmax(dim=-1)
                correct += int((predicted.cpu() == torch.tensor([label for _, label in chunk])).sum())
        return {"crop_shape_accuracy": correct / len(self.heldout)}

    def train_step(self, step: int) -> dict[str, Any]:
        cfg = self.config
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        size = cfg.train.batch_size
        first = (step * world + rank) * size  # every process its own questions, disjoint across steps
        indices = range(first, first + size)
        batch = [self.crop_and_label(self.train_set[i % len(self.train_set)]) for i in indices]
        labels = torch.tensor([label for _, label in batch], device=self.accelerator.device)
        self.model.train()
        logits = self.model([image for image, _ in batch])
        loss = nn.functional.cross_entropy(logits, labels)
        self.optimizer.zero_grad(set_to_none=True)
        self.accelerator.backward(loss)
        grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), cfg.train.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        return {
            "loss": loss.detach(),
            "accuracy": float((logits.argmax(dim=-1) == labels).float().mean()),
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
        }

    def train(self) -> dict[str, Any]:
        result = super().train()
        if self.is_main:
            self.adapter.save_pretrained(self.run_dir / "model")
        return result
