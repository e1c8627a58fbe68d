"""What every update rule of the robot trainer takes and gives: the iteration's data (`Collected`), the
trainer as the update sees it (`Learner`), and the one call the trainer makes (`MethodUpdate.update`),
the same for every method."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from accelerate import Accelerator
from torch import Tensor, nn

from vla_rl.branching import BranchedGroups
from vla_rl.config import VLAOnlineConfig
from vla_rl.lerobot_policy import LeRobotPolicy
from vla_rl.methods.critics import Critics
from vla_rl.online import Episode
from vla_rl.policy import ClippedGaussian, VLAPolicy
from vla_rl.replay_buffer import ReplayBuffer

if TYPE_CHECKING:
    from sim.experts import Expert


@dataclass
class Collected:
    """One iteration's rollouts: its episodes (a branched iteration's leaves), the branched groups they
    are the leaves of (None: flat groups), and the groups the sampler dropped (no method trains on
    them). Every episode is in the replay buffer already."""

    episodes: list[Episode]
    branched: BranchedGroups | None
    dropped: set[int]


class Learner(Protocol):
    """What an update may use of the trainer (`vla_rl.trainer.VLAOnlineTrainer`): the config, the policy
    and the module that trains it (the policy, or its DDP wrapper), the expert (relabelling), the replay
    buffer with its episodes' lengths, the critics and their optimizer, the demonstrations, and the
    trainer's optimizer steps."""

    config: VLAOnlineConfig
    policy: VLAPolicy | LeRobotPolicy
    model: nn.Module
    lerobot: bool
    expert: Expert
    accelerator: Accelerator
    buffer: ReplayBuffer
    episode_length: dict[int, int]
    critics: Critics
    critic_optimizer: torch.optim.Optimizer
    demo_frames: dict[str, Tensor] | None

    @property
    def horizon(self) -> int: ...

    def demo_inputs(self, frames: dict[str, Tensor]) -> dict[str, Any]: ...

    def optimizer_step(
        self,
        loss: Tensor,
        max_grad_norm: float = math.inf,
        patience: int | None = None,
        what: str = "",
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> Tensor: ...

    def actor_step(self, loss: Tensor, dist: ClippedGaussian | None) -> dict[str, float] | None: ...

    def actor_metrics(self, steps: list[dict[str, float] | None]) -> dict[str, Any]: ...


class MethodUpdate(Protocol):
    """One update rule (the config's `method`): what it does with an iteration's rollouts."""

    @property
    def trains_critics(self) -> bool:
        """Whether the update trains the critics (the memory plan counts a critic update)."""
        ...

    def update(self, learner: Learner, collected: Collected, generator: torch.Generator) -> dict[str, Any]:
        """Train the policy (and the critics) on the iteration; returns the update's metrics."""
        ...


def mean_or_nan(values: list[float]) -> float:
    """The mean, or NaN when there was nothing to average (the trainer drops such metrics)."""
    return float(np.mean(values)) if values else math.nan
