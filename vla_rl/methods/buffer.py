"""The update rule of the methods that learn from the whole replay buffer (`BufferUpdate`): train the
critics on the method's targets (for those that have critics), then the actor by weighted chunk
regression on the method's rows and weights. HABC is one such method (`vla_rl.methods.habc`); the
others are here:

- awr (`AWR`): one critic head regresses the Monte-Carlo return gamma^(steps to end) * success of every
  step, policy and expert alike; A = G - V(s); the same clipped exponential weights as habc; no gate,
  no intervention-aware credit. Per chunk, every step executed from a chunk takes the weight of the
  chunk's first state.
- bc (`ONLINE_BC`): behaviour cloning on intervention steps and on the policy steps of successful
  episodes.
- dagger (`DAGGER`): every visited state, relabelled by the scripted expert (chunk targets are the
  expert's actions along the visited trajectory).

The actor loss is -E[w log pi(a | s)] over action chunks. An expert step t regresses steps
t .. t+horizon-1 of its own segment (masked past the segment's end); a policy step is trained only
where the policy sampled a chunk, on the actions it executed from that chunk (a step inside a chunk was
decided at an earlier state). Each position carries the weight of its own step. With demonstrations
(`train.demos` or `train.demo_episodes`), `train.demo_fraction` of every actor batch comes from them
(weight 1). A LeRobot flow-matching policy trains by its weighted flow-matching loss instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from mmrl.losses import aggregate_loss
from vla_rl.config import VLAOnlineConfig
from vla_rl.episodes import expert_errors
from vla_rl.methods.critics import Critics, CriticTargets, critic_losses
from vla_rl.methods.interface import Collected, Learner, mean_or_nan
from vla_rl.methods.weighting import (
    Weighting,
    advantage_weights,
    executed_chunks,
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


CriticTargetsOf = Callable[[Transitions, Critics, VLAOnlineConfig], CriticTargets]
ActorTargetsOf = Callable[[Transitions, Critics, VLAOnlineConfig, int], ActorTargets]


@dataclass(frozen=True)
class BufferUpdate:
    """One update rule on the replay buffer: the critics' targets (None: no critic) and the actor's,
    called as `critic_targets(tr, critics, cfg)` and `actor_targets(tr, critics, cfg, horizon)`."""

    critic_targets: CriticTargetsOf | None
    actor_targets: ActorTargetsOf

    @property
    def trains_critics(self) -> bool:
        return self.critic_targets is not None

    def update(self, learner: Learner, collected: Collected, generator: torch.Generator) -> dict[str, Any]:
        """The critic and actor updates on the whole replay buffer (`collected` is in it already)."""
        metrics: dict[str, Any] = {}
        tr = Transitions.from_buffer(learner.buffer, learner.episode_length)
        if self.critic_targets is not None:
            metrics.update(train_critics(learner, tr, self.critic_targets, generator))
        targets = self.actor_targets(tr, learner.critics, learner.config, learner.horizon)
        metrics.update(targets.stats)
        metrics.update(train_actor(learner, tr, targets, generator))
        return metrics


def train_critics(
    learner: Learner, tr: Transitions, targets_of: CriticTargetsOf, generator: torch.Generator
) -> dict[str, Any]:
    """Minibatch updates of the critic heads on the method's targets (BCE for viability, MSE for u)."""
    c = learner.config.critic
    learner.critics.fit_normalization(tr.state)
    targets = targets_of(tr, learner.critics, learner.config)
    v_losses, e_losses, skipped = [], [], 0
    for _ in range(c.updates if len(targets.v_rows) else 0):
        v_loss, e_loss = critic_losses(learner.critics, tr.state, targets, c.batch_size, generator)
        loss = v_loss
        if e_loss is not None:
            loss = loss + e_loss
            e_losses.append(e_loss.item())
        if not torch.isfinite(loss):
            skipped += 1
            continue
        learner.optimizer_step(loss, 1.0, model=learner.critics, optimizer=learner.critic_optimizer)
        v_losses.append(v_loss.item())
    return {
        "critic_v_loss": mean_or_nan(v_losses),
        "critic_e_loss": mean_or_nan(e_losses),
        "critic_e_transitions": len(targets.e_rows),
        "critic_skipped_updates": skipped,
    }


def _concat(values: list[Any]) -> Any:
    """Batch parts joined: tensors along the first dimension, lists (instructions) end to end."""
    return sum(values, []) if isinstance(values[0], list) else torch.cat(values)


def train_actor(
    learner: Learner, tr: Transitions, targets: ActorTargets, generator: torch.Generator
) -> dict[str, Any]:
    """Weighted chunk regression on minibatches drawn uniformly from the targets' rows, with a
    `demo_fraction` share of each batch drawn from the demonstrations (weight 1) when there are any."""
    cfg = learner.config.train
    horizon, rows, weights = learner.horizon, targets.rows, targets.weights
    demo_frames = learner.demo_frames
    n_demo = round(cfg.batch_size * cfg.demo_fraction) if demo_frames is not None else 0
    n_online = cfg.batch_size - n_demo if len(rows) else 0
    device = learner.accelerator.device
    steps = []
    for _ in range(cfg.updates if n_online + n_demo else 0):
        parts = []  # (inputs, target actions, mask, weight), each (B, horizon, ...)
        if n_online:
            pick = rows[torch.randint(len(rows), (n_online,), generator=generator)]
            chunk, mask = tr.chunk_rows(pick, horizon, executed=not targets.relabel)
            if targets.relabel:
                moment = f"while relabelling the buffer's states (method {learner.config.method})"
                with expert_errors(learner.expert, learner.config.rollout.task, moment):
                    relabelled = learner.expert(tr.state[chunk].reshape(-1, tr.state.shape[1]).numpy())
                actions = torch.from_numpy(relabelled).reshape(*chunk.shape, -1).float()
            else:
                actions = tr.action[chunk]
            inputs = tr.policy_inputs(learner.policy, pick)
            if not learner.lerobot:  # the auxiliary object-position head's targets
                inputs["state"] = tr.state[pick].to(device)
            parts.append((inputs, actions, mask, weights[chunk]))
        if demo_frames is not None and n_demo:
            demo = torch.randint(len(demo_frames["actions"]), (n_demo,), generator=generator)
            frames = {k: v[demo] for k, v in demo_frames.items()}
            demo_weight = torch.ones(n_demo, horizon)
            parts.append((learner.demo_inputs(frames), frames["actions"], frames["mask"], demo_weight))
        inputs = {k: _concat([p[0][k] for p in parts]) for k in parts[0][0]}
        actions, mask, weight = (torch.cat([p[i] for p in parts]).to(device) for i in (1, 2, 3))
        learner.model.train()
        if learner.lerobot:  # weighted flow matching: no likelihood, no auxiliary head
            loss, dist = learner.policy.chunk_loss(inputs, actions, mask, weight, generator), None
        else:
            dist = learner.model(inputs)
            loss = aggregate_loss(-weight * dist.log_prob(actions).sum(-1), mask, "token_mean")
        steps.append(learner.actor_step(loss, dist))
    return learner.actor_metrics(steps)


# ---------------------------------------------------------------------------------------------
# AWR, online BC and DAgger


def monte_carlo_returns(tr: Transitions, gamma: float) -> Tensor:
    """gamma^(steps to the episode's end) * success of every transition: AWR's critic target."""
    return tr.success.float() * gamma ** (tr.steps_left - 1).float()


def awr_critic_targets(tr: Transitions, critics: Critics, cfg: VLAOnlineConfig) -> CriticTargets:
    """The viability head regresses the Monte-Carlo return of every step; the efficiency head is unused."""
    rows = torch.arange(len(tr))
    return CriticTargets(rows, monte_carlo_returns(tr, cfg.critic.gamma_v), rows[:0], torch.zeros(0))


def awr_actor_targets(tr: Transitions, critics: Critics, cfg: VLAOnlineConfig, horizon: int) -> ActorTargets:
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


def online_bc_actor_targets(
    tr: Transitions, critics: Critics, cfg: VLAOnlineConfig, horizon: int
) -> ActorTargets:
    """Intervention steps and the policy's chunks from successful episodes, weight 1."""
    rows = tr.actor_rows[(tr.intervention | tr.success)[tr.actor_rows]]
    return ActorTargets(rows, torch.ones(len(tr)), False, {})


def dagger_actor_targets(
    tr: Transitions, critics: Critics, cfg: VLAOnlineConfig, horizon: int
) -> ActorTargets:
    """Every visited state, with the expert's actions as targets, weight 1."""
    return ActorTargets(torch.arange(len(tr)), torch.ones(len(tr)), True, {})


AWR = BufferUpdate(awr_critic_targets, awr_actor_targets)
ONLINE_BC = BufferUpdate(None, online_bc_actor_targets)
DAGGER = BufferUpdate(None, dagger_actor_targets)
