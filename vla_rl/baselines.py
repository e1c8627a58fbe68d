"""What each method that learns from the replay buffer trains on: the critics' targets, and the actor's
rows, targets and weights. `BUFFER_METHODS` maps the config's `method` to them; HABC is one entry, its
math in `vla_rl.habc`. (grpo learns from each iteration's own episodes instead: `vla_rl.grpo`.)

- habc: the gated viability / efficiency advantages of `vla_rl.habc`, intervention-aware credit.
- awr: one critic head regresses the Monte-Carlo return gamma^(steps to end) * success of every step,
  policy and expert alike; A = G - V(s); the same clipped exponential weights as habc; no gate, no
  intervention-aware credit. Per chunk, every step executed from a chunk takes the weight of the
  chunk's first state.
- bc: behaviour cloning on intervention steps and on the policy steps of successful episodes.
- dagger: every visited state, relabelled by the scripted expert (chunk targets are the expert's
  actions along the visited trajectory).

Every entry is called as `critic_targets(tr, critics, cfg)` and `actor(tr, critics, cfg, horizon)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from vla_rl.config import VLAHABCConfig
from vla_rl.habc import (
    Critics,
    CriticTargets,
    Gate,
    Weighting,
    advantage_weights,
    critic_targets,
    executed_chunks,
    habc_weights,
    heads,
    spread_over_chunks,
    weight_stats,
)
from vla_rl.online import Transitions


class ActorTargets(NamedTuple):
    """What the actor trains on this iteration."""

    rows: Tensor  # rows whose chunks the minibatches are drawn from
    weights: Tensor  # (N,) weight of every transition: each target position carries its own step's
    relabel: bool  # targets are the expert's actions at the visited states, not the executed ones
    stats: dict[str, Any]


class BufferMethod(NamedTuple):
    """One update rule on the replay buffer: the critics' targets (None: no critic) and the actor's."""

    critic_targets: Callable[[Transitions, Critics, VLAHABCConfig], CriticTargets] | None
    actor: Callable[[Transitions, Critics, VLAHABCConfig, int], ActorTargets]


def habc_critic_targets(tr: Transitions, critics: Critics, cfg: VLAHABCConfig) -> CriticTargets:
    """Viability on policy segments, efficiency on the policy's own successes (`habc.critic_targets`)."""
    c = cfg.critic
    credit = "intervention_credit" not in cfg.habc.ablate
    return critic_targets(critics, tr, c.gamma_v, c.gamma_e, c.lam, credit)


def habc_actor(tr: Transitions, critics: Critics, cfg: VLAHABCConfig, horizon: int) -> ActorTargets:
    """The executed chunks, weighted by HABC's gated advantage (`habc.habc_weights`)."""
    c, a, h = cfg.critic, cfg.actor, cfg.habc
    viability, efficiency = heads(critics, tr, c.gamma_v, c.gamma_e, "intervention_credit" not in h.ablate)
    chunks = executed_chunks(tr.chunk_step, tr.seg_left, horizon) if a.per_chunk else None
    weights, stats = habc_weights(
        tr.intervention,
        viability,
        efficiency,
        Gate(h.gate_k, h.gate_tau, frozenset(h.ablate)),
        Weighting(a.beta, a.w_max, a.normalize),
        h.intervention_weight,
        chunks,
    )
    return ActorTargets(tr.actor_rows, weights, False, stats)


def monte_carlo_returns(tr: Transitions, gamma: float) -> Tensor:
    """gamma^(steps to the episode's end) * success of every transition: AWR's critic target."""
    return tr.success.float() * gamma ** (tr.steps_left - 1).float()


def awr_critic_targets(tr: Transitions, critics: Critics, cfg: VLAHABCConfig) -> CriticTargets:
    """The viability head regresses the Monte-Carlo return of every step; the efficiency head is unused."""
    rows = torch.arange(len(tr))
    return CriticTargets(rows, monte_carlo_returns(tr, cfg.critic.gamma_v), rows[:0], torch.zeros(0))


def awr_actor(tr: Transitions, critics: Critics, cfg: VLAHABCConfig, horizon: int) -> ActorTargets:
    """The executed chunks of every step, weighted by the clipped exp(beta (G - V(s)))."""
    a = cfg.actor
    with torch.no_grad():
        value = torch.sigmoid(critics(tr.state)[0])
    advantage = monte_carlo_returns(tr, cfg.critic.gamma_v) - value
    w = advantage_weights(advantage, Weighting(a.beta, a.w_max, a.normalize))
    if a.per_chunk:  # every step executed from a chunk takes the weight of the chunk's first state
        chunks = executed_chunks(tr.chunk_step, tr.seg_left, horizon)
        spread_over_chunks(w, w[chunks.decisions], chunks)
    stats = {"viability_mean": float(value.mean()), "adv_std": float(advantage.std(unbiased=False))}
    return ActorTargets(tr.actor_rows, w, False, stats | weight_stats(w, a.w_max))


def bc_actor(tr: Transitions, critics: Critics, cfg: VLAHABCConfig, horizon: int) -> ActorTargets:
    """Intervention steps and the policy's chunks from successful episodes, weight 1."""
    rows = tr.actor_rows[(tr.intervention | tr.success)[tr.actor_rows]]
    return ActorTargets(rows, torch.ones(len(tr)), False, {})


def dagger_actor(tr: Transitions, critics: Critics, cfg: VLAHABCConfig, horizon: int) -> ActorTargets:
    """Every visited state, with the expert's actions as targets, weight 1."""
    return ActorTargets(torch.arange(len(tr)), torch.ones(len(tr)), True, {})


BUFFER_METHODS: dict[str, BufferMethod] = {
    "habc": BufferMethod(habc_critic_targets, habc_actor),
    "awr": BufferMethod(awr_critic_targets, awr_actor),
    "bc": BufferMethod(None, bc_actor),
    "dagger": BufferMethod(None, dagger_actor),
}
