"""Supervised pretraining of the digit-reversal model (`mmrl pretrain tiny_lm`): behaviour cloning on
demonstrations with some digits corrupted, so that `tiny_grpo` starts from a model that already does
something. The result is saved with save_pretrained in the run directory's model/ folder."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Qwen2ForCausalLM

from mmrl.config import BaseConfig, option
from mmrl.examples.digits import (
    DIGITS,
    DigitReversalTrainer,
    TinyModelConfig,
    TinyTaskConfig,
    answer_logprobs,
    check_task_size,
)
from mmrl.registry import TRAINERS


@dataclass
class TinySFTTrainConfig:
    lr: float = option(3e-3, "AdamW learning rate", min=0.0)
    batch_size: int = option(64, "demonstrations per step", min=1)
    label_noise: float = option(
        0.5, "probability that a demonstrated digit is replaced by a random one", min=0.0, max=1.0
    )


@dataclass
class TinySFTConfig(BaseConfig):
    trainer: str = option("tiny_sft", "trainer name", registry="trainer")
    model: TinyModelConfig = dataclasses.field(default_factory=TinyModelConfig)
    task: TinyTaskConfig = dataclasses.field(default_factory=TinyTaskConfig)
    train: TinySFTTrainConfig = dataclasses.field(default_factory=TinySFTTrainConfig)

    def __post_init__(self) -> None:
        check_task_size(self.task)


@TRAINERS.register("tiny_sft")
class TinySFTTrainer(DigitReversalTrainer):
    """Behaviour cloning on corrupted demonstrations; the result is saved with save_pretrained."""

    config_class = TinySFTConfig
    config: TinySFTConfig

    def setup_training(self, model: Qwen2ForCausalLM) -> None:
        self.prepare_model_and_optimizer(model, lr=self.config.train.lr)
        self.data_generator = torch.Generator().manual_seed(self.config.seed)

    def trainer_state(self) -> dict[str, Any]:
        return {"data_generator": self.data_generator.get_state()}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.data_generator.set_state(state["data_generator"])

    def train_step(self, step: int) -> dict[str, Any]:
        cfg = self.config
        g = self.data_generator
        index = torch.randint(0, len(self.train_prompts), (cfg.train.batch_size,), generator=g)
        prompts = self.train_prompts[index]
        targets = prompts.flip(-1).clone()
        noisy = torch.rand(targets.shape, generator=g) < cfg.train.label_noise
        targets[noisy] = torch.randint(0, DIGITS, (int(noisy.sum()),), generator=g)
        loss = -answer_logprobs(self.model, prompts, targets).mean()
        self.optimizer_step(loss)
        return {"loss": loss.detach()}

    def train(self) -> dict[str, Any]:
        result = super().train()
        if self.is_main:
            self.accelerator.unwrap_model(self.model).save_pretrained(self.run_dir / "model")
        return result
