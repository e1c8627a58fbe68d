"""The update helpers every trainer shares: `Trainer.optimizer_step` / `apply_gradients` drop a step whose
loss or gradient is not finite (`StepSkipped`, weights untouched), stop the run after `patience` such
steps in a row (`TrainingStopped`), and a finite step ends the streak."""

import math

import pytest
import torch

from mmrl.config import BaseConfig
from mmrl.run_stops import StepSkipped, TrainingStopped
from mmrl.trainer import Trainer


class LinearTrainer(Trainer):
    def setup(self) -> None:
        torch.manual_seed(0)
        self.prepare_model_and_optimizer(torch.nn.Linear(3, 1), lr=0.1, lr_factor=lambda i: 0.5)


@pytest.fixture
def trainer(tmp_path) -> LinearTrainer:
    trainer = LinearTrainer(BaseConfig(output_dir=str(tmp_path)))
    trainer.setup()
    return trainer


def weights(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def unchanged(trainer: Trainer, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def loss_of(trainer: Trainer, scale: float = 1.0) -> torch.Tensor:
    return scale * trainer.model(torch.ones(4, 3)).pow(2).mean()


def nan_gradient_loss(trainer: Trainer) -> torch.Tensor:
    """A finite loss whose weight gradient is NaN."""
    trainer.model.weight.register_hook(lambda grad: torch.full_like(grad, math.nan))
    return loss_of(trainer)


def test_prepare_builds_adamw_and_the_schedule(trainer):
    assert isinstance(trainer.optimizer.optimizer, torch.optim.AdamW)  # Accelerate's wrapper around it
    group = trainer.optimizer.param_groups[0]
    assert group["weight_decay"] == 0.01 and group["lr"] == pytest.approx(0.05)  # lr * lr_factor(0)
    assert isinstance(trainer.scheduler, torch.optim.lr_scheduler.LambdaLR)


def test_a_finite_step_descends_and_returns_the_unclipped_norm(trainer):
    before = loss_of(trainer).item()
    trainer.nan_streak = 2
    grad_norm = trainer.optimizer_step(loss_of(trainer), max_grad_norm=1e-3, patience=3)
    clipped = torch.cat([p.grad.flatten() for p in trainer.model.parameters()]).norm()
    assert grad_norm > 1e-3 and clipped.item() == pytest.approx(1e-3, rel=1e-4)
    assert loss_of(trainer).item() < before
    assert trainer.nan_streak == 0  # a finite step ends a streak of skipped ones


@pytest.mark.parametrize(
    ("make_loss", "reason"),
    [
        (lambda t: loss_of(t, math.nan), "non-finite actor loss"),
        (nan_gradient_loss, "non-finite actor gradient"),
    ],
)
def test_a_non_finite_loss_or_gradient_skips_the_step_and_keeps_the_weights(trainer, make_loss, reason):
    before = weights(trainer)
    with pytest.raises(StepSkipped, match=reason) as skipped:
        trainer.optimizer_step(make_loss(trainer), max_grad_norm=1.0, patience=3, what="actor ")
    assert unchanged(trainer, before)
    assert all(p.grad is None for p in trainer.model.parameters())  # nothing left for the next step
    assert trainer.nan_streak == 1 and trainer.skipped_steps == 1
    assert skipped.value.metrics["skipped"] == 1 and math.isnan(skipped.value.metrics["loss"])


def test_patience_skipped_steps_in_a_row_stop_the_run(trainer):
    before = weights(trainer)
    with pytest.raises(StepSkipped):
        trainer.optimizer_step(loss_of(trainer, math.nan), patience=2)
    with pytest.raises(
        TrainingStopped, match=r"non-finite gradient in 2 steps in a row \(train.nan_patience = 2\)"
    ):
        trainer.optimizer_step(nan_gradient_loss(trainer), patience=2)
    assert unchanged(trainer, before) and trainer.skipped_steps == 2


def test_a_finite_step_between_skips_resets_the_streak(trainer):
    with pytest.raises(StepSkipped):
        trainer.optimizer_step(loss_of(trainer, math.nan), patience=2)
    before = weights(trainer)
    trainer.optimizer_step(loss_of(trainer), patience=2)
    assert not unchanged(trainer, before) and trainer.nan_streak == 0
    with pytest.raises(StepSkipped):  # one in a row again, not the second
        trainer.optimizer_step(loss_of(trainer, math.nan), patience=2)
    assert trainer.nan_streak == 1 and trainer.skipped_steps == 2


def test_without_patience_a_non_finite_loss_is_not_checked(trainer):
    """Trainers that check their own inputs pass no patience: the update happens, NaN and all."""
    trainer.optimizer_step(loss_of(trainer, math.nan))
    assert not all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert trainer.nan_streak == 0 and trainer.skipped_steps == 0


def test_apply_gradients_steps_what_was_accumulated(trainer):
    trainer.backward(loss_of(trainer))
    single = trainer.model.weight.grad.clone()
    trainer.backward(loss_of(trainer))
    torch.testing.assert_close(trainer.model.weight.grad, 2 * single)
    before = weights(trainer)
    grad_norm = trainer.apply_gradients(patience=1)  # max_grad_norm inf: measured, not clipped
    total = torch.cat([p.grad.flatten() for p in trainer.model.parameters()]).norm()
    assert grad_norm.item() == pytest.approx(total.item())
    torch.testing.assert_close(trainer.model.weight.grad, 2 * single)
    assert not unchanged(trainer, before)


def test_a_second_network_steps_with_its_own_optimizer_and_clip(trainer):
    """Critics beside the policy: model= and optimizer= step that network only, clipped to its norm."""
    torch.manual_seed(1)
    critic = torch.nn.Linear(3, 1)
    critic_optimizer = torch.optim.SGD(critic.parameters(), lr=0.1)
    policy_before, critic_before = weights(trainer), [p.detach().clone() for p in critic.parameters()]
    loss = critic(torch.ones(4, 3)).sub(10).pow(2).mean()
    grad_norm = trainer.optimizer_step(loss, 0.5, model=critic, optimizer=critic_optimizer)
    assert unchanged(trainer, policy_before)
    assert grad_norm > 0.5
    assert torch.cat([p.grad.flatten() for p in critic.parameters()]).norm().item() == pytest.approx(0.5)
    assert critic(torch.ones(4, 3)).sub(10).pow(2).mean() < loss  # the critic moved toward its target
    assert not all(torch.equal(a, b) for a, b in zip(critic_before, critic.parameters(), strict=True))
