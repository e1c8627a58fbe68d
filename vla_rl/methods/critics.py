"""The critics HABC and AWR train on the privileged env state: two heads on one shared trunk, the rows
and targets each head regresses, and one minibatch of their losses."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CriticTargets(NamedTuple):
    """The rows each head trains on and their regression targets."""

    v_rows: Tensor
    v_target: Tensor  # viability in [0, 1]
    e_rows: Tensor
    e_target: Tensor  # scaled efficiency u in [-1, 0]


class Critics(nn.Module):
    """Viability and efficiency heads on one shared trunk over the privileged env state.

    A small MLP on the state vector (not the image): cheap to train every iteration on CPU, and in
    simulation a critic may use what the deployed policy cannot see. Inputs are standardised with
    statistics fixed from the first rollouts. Outputs: V_v = sigmoid(logit) in [0, 1] and the scaled
    efficiency u = (1 - gamma_e) V_e = -sigmoid(.) in [-1, 0].
    """

    def __init__(self, state_dim: int, hidden: int) -> None:
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Linear(state_dim, hidden),
            nn.LayerNorm(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
        )
        self.heads = nn.Linear(hidden, 2)
        self.register_buffer("mean", torch.zeros(state_dim))
        self.register_buffer("std", torch.ones(state_dim))
        self.register_buffer("ready", torch.tensor(False))

    def fit_normalization(self, states: Tensor) -> None:
        """Fix the input statistics once, from the first states seen."""
        if not bool(self.ready):
            self.mean.copy_(states.mean(0))
            self.std.copy_(states.std(0).clamp(min=1e-3))
            self.ready.fill_(True)

    def forward(self, state: Tensor) -> tuple[Tensor, Tensor]:
        """(viability logit, scaled efficiency u) per state."""
        out = self.heads(self.trunk((state - self.mean) / self.std))
        return out[:, 0], -torch.sigmoid(out[:, 1])


def critic_losses(
    critics: Critics, state: Tensor, targets: CriticTargets, batch_size: int, generator: torch.Generator
) -> tuple[Tensor, Tensor | None]:
    """One minibatch per head, drawn from its rows: BCE of the viability logits and MSE of u (None
    while no policy segment has ended in the policy's own success)."""
    v_pick = torch.randint(len(targets.v_rows), (batch_size,), generator=generator)
    logit, _ = critics(state[targets.v_rows[v_pick]])
    v_loss = F.binary_cross_entropy_with_logits(logit, targets.v_target[v_pick])
    if not len(targets.e_rows):
        return v_loss, None
    e_pick = torch.randint(len(targets.e_rows), (batch_size,), generator=generator)
    _, u = critics(state[targets.e_rows[e_pick]])
    return v_loss, F.mse_loss(u, targets.e_target[e_pick])
