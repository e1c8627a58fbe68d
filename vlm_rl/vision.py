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

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mmrl.config import BaseConfig, ConfigError, option
from mmrl.registry import TRAINERS
from mmrl.trainer import Trainer, warmup_cosine
from vlm_rl.data import DataConfig, round_box
from vlm_rl.models import ImageInput, VLMAdapter
from vlm_rl.sft import VLMModelConfig, load_or_build
from vlm_rl.tasks import SHAPES, TaskConfig, ZoomExample, make_example
from vlm_rl.tools import ImageStore, ToolCall


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


BACKGROUND = len(SHAPES)  # the label of an output token that does not show the small object
_IGNORE = -100  # a token that shows only a sliver of it: neither label is right
_MIN_OVERLAP = 0.2  # a token shows the object when its cell holds this share of the object's box


def crop_with_labels(example: ZoomExample, adapter: VLMAdapter) -> tuple[ImageInput, torch.Tensor]:
    """The crop a demonstration of this detail question shows, and a label per output token of the
    vision tower: the small object's shape where the token's cell covers enough of the object's box,
    BACKGROUND where it covers none of it."""
    observation = ImageStore(example.image).crop(ToolCall("crop", round_box(example.target_box)))
    if observation.image is None or observation.box is None:
        raise ValueError(f"the crop of example {example.id} failed: {observation.text}")
    image = adapter.encode_image(observation.image)
    left, top, right, bottom = observation.box  # pixels of the original
    scale_x, scale_y = image.size[0] / (right - left), image.size[1] / (bottom - top)
    side = example.canvas_size
    x1, y1, x2, y2 = example.objects[example.target].box
    x1, x2 = (x1 * side - left) * scale_x, (x2 * side - left) * scale_x  # in the resized crop
    y1, y2 = (y1 * side - top) * scale_y, (y2 * side - top) * scale_y
    cell = adapter.image_processor.patch_size * adapter.image_processor.merge_size
    rows, cols = image.size[1] // cell, image.size[0] // cell
    if rows * cols != image.num_tokens:
        raise ValueError(f"{image.num_tokens} image tokens are not a {rows}x{cols} grid of merged patches")
    # the merger emits one token per merge window, windows in row-major order
    cx1 = torch.arange(cols) * cell
    cy1 = torch.arange(rows) * cell
    overlap_x = (torch.clamp(cx1 + cell, max=x2) - torch.clamp(cx1, min=x1)).clamp(min=0)
    overlap_y = (torch.clamp(cy1 + cell, max=y2) - torch.clamp(cy1, min=y1)).clamp(min=0)
    share = overlap_y[:, None] * overlap_x[None, :] / ((x2 - x1) * (y2 - y1))
    shape = SHAPES.index(example.objects[example.target].shape)
    labels = torch.full((rows, cols), _IGNORE)
    labels[share == 0] = BACKGROUND
    labels[share >= _MIN_OVERLAP] = shape
    return image, labels.flatten()


class TokenReader(nn.Module):
    """The VLM's vision tower and a head that names, per output token, the shape it shows (or none)."""

    def __init__(self, visual: nn.Module, width: int) -> None:
        super().__init__()
        self.visual = visual
        self.head = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, len(SHAPES) + 1))

    def forward(self, images: list[ImageInput]) -> torch.Tensor:
        """Logits per output token of every image, concatenated: [tokens, shapes + 1]."""
        device = self.head[0].weight.device
        pixels = torch.cat([image.pixel_values for image in images]).to(device)
        grid = torch.stack([image.grid_thw for image in images]).to(device)
        output = self.visual(pixels, grid_thw=grid)
        return self.head(getattr(output, "pooler_output", output))  # transformers 5: the merged tokens


def read_shapes(logits: torch.Tensor, images: list[ImageInput]) -> torch.Tensor:
    """Each image's shape, without knowing where the object is: the shape with the most probability
    summed over the image's tokens (background tokens put little on any shape)."""
    per_image = logits.softmax(dim=-1)[:, :BACKGROUND].split([image.num_tokens for image in images])
    return torch.stack([probs.sum(dim=0).argmax() for probs in per_image])


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with the object's few tokens and the many background ones weighted equally."""
    losses = []
    for selected in (labels < BACKGROUND) & (labels >= 0), labels == BACKGROUND:
        if selected.any():
            losses.append(nn.functional.cross_entropy(logits[selected], labels[selected]))
    return torch.stack(losses).sum()


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
        if cfg.data.source != "zoom_task":
            raise ConfigError(
                "config error: the vision pre-stage reads the synthetic task's crops; "
                f"data.source must be 'zoom_task', got {cfg.data.source!r}"
            )
        # every question a detail question: each is about the small object in one region
        self.task = TaskConfig(
            canvas_size=cfg.data.canvas_size, detail_fraction=1.0, max_large=cfg.data.max_large
        )
        self.adapter: VLMAdapter = load_or_build(cfg.model, cfg.data, cfg.seed).to(self.accelerator.device)
        self.heldout = [self.example(i, "heldout") for i in range(cfg.data.heldout_size)]
        width = self.adapter.model.config.text_config.hidden_size  # the merger projects to the LM's width
        reader = TokenReader(self.adapter.model.model.visual, width)
        self.prepare_model_and_optimizer(
            reader,
            lr=cfg.train.lr,
            lr_factor=lambda step: warmup_cosine(step, cfg.train.warmup_steps, cfg.steps),
        )

    def example(self, index: int, split: str) -> tuple[ImageInput, torch.Tensor, int]:
        example = make_example(
            index % self.config.data.train_size if split == "train" else index,
            self.config.data.seed,
            split,
            self.task,
        )
        image, labels = crop_with_labels(example, self.adapter)
        return image, labels, SHAPES.index(example.objects[example.target].shape)

    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        shapes_right = tokens_right = object_tokens = 0
        with torch.no_grad():
            for start in range(0, len(self.heldout), 64):
                chunk = self.heldout[start : start + 64]
                images = [image for image, _, _ in chunk]
                logits = self.model(images).cpu()
                shapes = torch.tensor([shape for _, _, shape in chunk])
                shapes_right += int((read_shapes(logits, images) == shapes).sum())
                labels = torch.cat([labels for _, labels, _ in chunk])
                on_object = (labels >= 0) & (labels < BACKGROUND)
                tokens_right += int((logits[on_object].argmax(dim=-1) == labels[on_object]).sum())
                object_tokens += int(on_object.sum())
        return {
            "crop_shape_accuracy": shapes_right / len(self.heldout),
            "object_token_accuracy": tokens_right / max(object_tokens, 1),
        }

    def train_step(self, step: int) -> dict[str, Any]:
        cfg = self.config
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        size = cfg.train.batch_size
        first = (step * world + rank) * size  # every process its own questions, disjoint across steps
        batch = [self.example(i, "train") for i in range(first, first + size)]
        images = [image for image, _, _ in batch]
        labels = torch.cat([labels for _, labels, _ in batch]).to(self.accelerator.device)
        self.model.train()
        logits = self.model(images)
        loss = token_loss(logits, labels)
        grad_norm = self.optimizer_step(loss, cfg.train.max_grad_norm)
        self.scheduler.step()
        shapes = torch.tensor([shape for _, _, shape in batch])
        return {
            "loss": loss.detach(),
            "accuracy": float((read_shapes(logits.detach().cpu(), images) == shapes).float().mean()),
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
        }

    def train(self) -> dict[str, Any]:
        result = super().train()
        if self.is_main:
            self.adapter.save_pretrained(self.run_dir / "model")
        return result
