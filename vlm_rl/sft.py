"""Operation-aware supervised fine-tuning (`mmrl pretrain vlm`): demonstrations with and without a zoom.

Each training question gets a demonstration that either answers directly or first crops the
question's target box, looks at the crop and then answers. Whether a demonstration zooms is drawn
per question: with probability `train.tool_fraction` on questions that need a zoom (or whose kind is
unknown) and `train.global_tool_fraction` on questions answerable from the full view. Equal shares
(the default) teach *how* to zoom and to answer from either view and leave *when* to rollout-guided
RL; unequal shares also show when a zoom pays. Only the assistant's tokens are trained (the crop shown
back is masked).

Without `model.path`, a new tiny Qwen2-VL of the real architecture is built with a word-level
tokenizer over the task's vocabulary; the result is saved with `save_pretrained` to
``OUTPUT_DIR/model``, which the RL recipes start from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mmrl.config import BaseConfig, ConfigError, option
from mmrl.registry import TRAINERS
from mmrl.trainer import Trainer, warmup_cosine
from vlm_rl.config import TOOL_MODES, ToolRolloutConfig
from vlm_rl.conversation import prompt_segment
from vlm_rl.data import DataConfig, Question, QuestionSet, demonstration, keyed_rng, task_vocabulary
from vlm_rl.heldout_eval import evaluate_questions
from vlm_rl.models import TinyVLMSpec, VLMAdapter
from vlm_rl.trainer import load_policy


@dataclass
class VLMModelConfig:
    path: str | None = option(None, "local checkpoint to fine-tune; null builds a new tiny Qwen2-VL")
    architecture: Literal["qwen2_vl", "qwen2_5_vl"] = option("qwen2_vl", "tiny model: architecture")
    hidden: int = option(128, "tiny model: text width", min=8)
    layers: int = option(4, "tiny model: text layers", min=1)
    vision_width: int = option(64, "tiny model: vision tower width", min=8)
    vision_depth: int = option(2, "tiny model: vision blocks", min=1)
    patch_size: int = option(7, "tiny model: vision patch side in pixels (Qwen2-VL's is 14)", min=2)
    max_pixels: int = option(112 * 112, "image processor: most pixels per image after resizing", min=196)


@dataclass
class SFTTrainConfig:
    lr: float = option(2e-3, "AdamW peak learning rate (linear warm-up, cosine decay)", min=0.0)
    warmup_steps: int = option(100, "linear warm-up steps", min=0)
    batch_size: int = option(32, "demonstrations per step on each process", min=1)
    tool_fraction: float = option(
        0.5,
        "share of demonstrations that zoom first (on questions needing it or of unknown kind)",
        min=0.0,
        max=1.0,
    )
    global_tool_fraction: float | None = option(
        None, "that share on questions answerable without a zoom (null: tool_fraction)", min=0.0, max=1.0
    )
    max_grad_norm: float = option(1.0, "gradient clipping norm", min=0.0)
    weight_decay: float = option(0.0, "AdamW weight decay", min=0.0)
    vision_lr_scale: float = option(
        1.0, "vision tower's lr relative to lr (below 1: keep a pre-trained tower's reading)", min=0.0
    )


@dataclass
class VLMSFTConfig(BaseConfig):
    trainer: str = option("vlm_sft", "trainer name", registry="trainer")
    model: VLMModelConfig = field(default_factory=VLMModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: ToolRolloutConfig = field(default_factory=ToolRolloutConfig)
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    eval_modes: list[str] = option(
        list(TOOL_MODES), "tool modes evaluated before and after", choices=TOOL_MODES
    )


def zoom_share(question: Question, train: SFTTrainConfig) -> float:
    """Probability that this question's demonstration zooms first."""
    if question.kind == "global" and train.global_tool_fraction is not None:
        return train.global_tool_fraction
    return train.tool_fraction


def load_or_build(cfg: VLMModelConfig, data: DataConfig, seed: int) -> VLMAdapter:
    if cfg.path is not None:
        return load_policy(cfg.path)
    if data.source != "zoom_task":
        raise ConfigError(
            "config error: a new tiny model needs the synthetic task's vocabulary; with data.source = "
            f"{data.source!r} give model.path = a local checkpoint"
        )
    spec = TinyVLMSpec(
        architecture=cfg.architecture,
        hidden=cfg.hidden,
        layers=cfg.layers,
        vision_width=cfg.vision_width,
        vision_depth=cfg.vision_depth,
        patch_size=cfg.patch_size,
        min_pixels=(2 * cfg.patch_size) ** 2 * 4,
        max_pixels=cfg.max_pixels,
    )
    return VLMAdapter.tiny(task_vocabulary(data), spec, seed=seed)


@TRAINERS.register("vlm_sft")
class VLMSFTTrainer(Trainer):
    config_class = VLMSFTConfig
    config: VLMSFTConfig

    def setup(self) -> None:
        cfg = self.config
        self.adapter = load_or_build(cfg.model, cfg.data, cfg.seed).to(self.accelerator.device)
        self.train_set = QuestionSet(cfg.data, "train")
        heldout = QuestionSet(cfg.data, "heldout")
        self.train_set.check_images(self.adapter)  # refused now, not at the step that draws it
        heldout.check_images(self.adapter)
        self.heldout = [heldout[i] for i in range(len(heldout))]
        visual = list(self.adapter.model.model.visual.parameters())
        in_visual = {id(p) for p in visual}
        rest = [p for p in self.adapter.model.parameters() if id(p) not in in_visual]
        groups = [
            {"params": rest, "lr": cfg.train.lr},
            {"params": visual, "lr": cfg.train.lr * cfg.train.vision_lr_scale},
        ]
        self.prepare_model_and_optimizer(
            self.adapter.model,
            groups,
            lr=cfg.train.lr,
            weight_decay=cfg.train.weight_decay,
            lr_factor=self.lr_factor,
        )

    def lr_factor(self, step: int) -> float:
        return warmup_cosine(step, self.config.train.warmup_steps, self.config.steps)

    def evaluate(self) -> dict[str, float]:
        self.adapter.model.eval()
        return evaluate_questions(self.adapter, self.heldout, self.config.rollout, self.config.eval_modes)

    def train_step(self, step: int) -> dict[str, Any]:
        cfg = self.config
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        size = cfg.train.batch_size
        first = (step * world + rank) * size  # every process its own questions, disjoint across steps
        sequences, masks, tools = [], [], 0
        for index in range(first, first + size):
            question = self.train_set[index % len(self.train_set)]
            use_tool = keyed_rng(cfg.seed, index).random() < zoom_share(question, cfg.train)
            image = question.image
            prompt = prompt_segment(self.adapter, question, cfg.rollout.system_prompt, image)
            sequence, mask = demonstration(self.adapter, question, prompt, use_tool, image)
            sequences.append(sequence)
            masks.append(torch.tensor(mask))
            tools += use_tool
        batch = self.adapter.collate(sequences, "right")
        target = torch.nn.utils.rnn.pad_sequence(masks, batch_first=True)
        self.adapter.model.train()
        log_probs = self.adapter.token_log_probs(batch, target, model=self.model)
        loss = -log_probs.sum() / target.sum().clamp(min=1)
        grad_norm = self.optimizer_step(loss, cfg.train.max_grad_norm)
        self.scheduler.step()
        return {
            "loss": loss.detach(),
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "tool_demonstrations": tools / size,
        }

    def train(self) -> dict[str, Any]:
        result = super().train()
        if self.is_main:
            self.adapter.save_pretrained(self.run_dir / "model")
        return result
