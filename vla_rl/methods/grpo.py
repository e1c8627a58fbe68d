"""The GRPO baseline's update rule (method grpo, `GRPO`): binary success as reward, advantages
normalised within the groups of episodes that share a reset seed (`grpo.advantage`, a group
estimator), and a PPO-clip loss (`grpo.loss`, a policy loss) on the log-probs of the actions the policy
executed from each chunk it sampled, on this iteration's episodes only (no replay buffer; the recipe
turns interventions off).

Log-probs are those of the exploration distribution, the policy's std times `rollout.std_scale`; the
behaviour log-probs are computed once before the first update, since the policy has not changed since
the rollouts. Chunks whose episode has a zero (or masked) advantage carry no signal and are dropped.

With snapshot branching (`grpo.branch_every`, `vla_rl.branching`) a group is a tree. A tree estimator
(node credit) scores every node from the leaves' success fused up the tree
(`mmrl.credit.assign_credit`), and every chunk executed on an edge is trained once, with the
advantage of the node the edge leads to, by the same loss. A group estimator (flat credit) scores the
tree's leaves as the group and trains every leaf's whole episode from reset with its advantage, so a
chunk on a shared edge counts once per leaf below it: flat GRPO on the leaves, at the tree's env cost.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmrl.advantages import Advantages
from mmrl.credit import assign_credit
from mmrl.registry import ADVANTAGES, LOSSES
from vla_rl.branching import BranchedGroups
from vla_rl.methods.interface import Collected, Learner
from vla_rl.online import Episode
from vla_rl.policy import VLAPolicy

Chunk = tuple[int, int, int]  # (episode, start step, actions executed)


def group_advantages(episodes: list[Episode], estimator: str) -> Advantages:
    """Advantages of the episodes' binary success within their groups, by the named estimator."""
    rewards = torch.tensor([float(e.success) for e in episodes])
    return ADVANTAGES.get(estimator)(rewards=rewards, group_ids=torch.tensor([e.group for e in episodes]))


def sampled_chunks(episodes: list[Episode], advantages: Advantages) -> list[Chunk]:
    """Every chunk the policy sampled and executed at least one action from, in episodes whose
    advantage is non-zero and not masked out of the loss."""
    adv, keep = advantages.values, advantages.loss_mask
    return [
        (i, t0, k)
        for i, e in enumerate(episodes)
        for t0, k in e.decisions
        if k > 0 and adv[i] != 0 and keep[i]
    ]


def chunk_batch(
    policy: VLAPolicy, episodes: list[Episode], items: list[Chunk], adv: Tensor
) -> tuple[dict[str, Tensor], Tensor, Tensor, Tensor]:
    """The policy's inputs at each chunk's start, its executed actions padded to the horizon, their
    mask and the episode's advantage, on the policy's device."""
    horizon, device = policy.config.horizon, policy.device
    obs = {
        "image": np.stack([episodes[i].images[t0] for i, t0, _ in items]),
        "state": np.stack([episodes[i].states[t0] for i, t0, _ in items]),
    }
    actions = np.zeros((len(items), horizon, episodes[0].actions.shape[1]), np.float32)
    mask = torch.zeros(len(items), horizon, dtype=torch.bool)
    for b, (i, t0, k) in enumerate(items):
        actions[b, :k] = episodes[i].actions[t0 : t0 + k]
        mask[b, :k] = True
    a = torch.tensor([float(adv[i]) for i, _, _ in items])
    inputs = policy.prepare(obs, [episodes[i].instruction for i, _, _ in items])
    inputs["state"] = torch.as_tensor(obs["state"], dtype=torch.float32, device=device)
    return inputs, torch.from_numpy(actions).to(device), mask.to(device), a.to(device)


def update_grpo(learner: Learner, episodes: list[Episode], generator: torch.Generator) -> dict[str, Any]:
    """Group advantages over the episodes, then `train_chunks`; returns the update's metrics."""
    if not episodes:  # every group filtered out by the sampler
        return {"grpo_chunks": 0, "actor_updates": 0, "skipped_updates": 0}
    return train_chunks(
        learner, episodes, group_advantages(episodes, learner.config.grpo.advantage), generator
    )


def update_branched_grpo(
    learner: Learner, groups: BranchedGroups, generator: torch.Generator
) -> dict[str, Any]:
    """Node advantages over the groups' trees, then `train_chunks` on the edges (one `Episode` each,
    carrying the advantage of the node it leads to), or with a group estimator `update_grpo` on the
    leaves' whole episodes; returns the update's metrics."""
    if not groups.trees:  # every group filtered out by the sampler
        return update_grpo(learner, [], generator)
    credit = assign_credit(groups.trees, learner.config.grpo.advantage)
    if credit.per_leaf:
        return update_grpo(learner, groups.leaves, generator)
    edges = groups.edges()
    values = torch.tensor([credit.nodes[(t, n)] for t, n, _ in edges])
    advantages = Advantages(values, torch.ones(len(values), dtype=torch.bool))
    return train_chunks(learner, [edge for *_, edge in edges], advantages, generator)


def train_chunks(
    learner: Learner, episodes: list[Episode], advantages: Advantages, generator: torch.Generator
) -> dict[str, Any]:
    """`train.updates` minibatches of the episodes' sampled chunks, drawn by reshuffled passes, each a
    `grpo.loss` step through the learner's `actor_step`; returns the update's metrics."""
    cfg, g = learner.config, learner.config.grpo
    batch_size, scale = cfg.train.batch_size, cfg.rollout.std_scale
    chunks = sampled_chunks(episodes, advantages)
    adv = advantages.values
    stats: dict[str, Any] = {"grpo_chunks": len(chunks), "grpo_adv_abs_mean": float(adv.abs().mean())}
    if not chunks:
        return stats | {"actor_updates": 0, "skipped_updates": 0}
    old_parts = []
    with torch.no_grad():
        for start in range(0, len(chunks), batch_size):
            inputs, actions, _, _ = chunk_batch(
                learner.policy, episodes, chunks[start : start + batch_size], adv
            )
            old_parts.append(learner.policy(inputs).scaled(scale).log_prob(actions).sum(-1))
    old = torch.cat(old_parts)
    loss_fn = LOSSES.get(g.loss)
    steps = []
    order = torch.randperm(len(chunks), generator=generator)
    cursor = 0
    for _ in range(cfg.train.updates):
        if cursor >= len(order):
            order, cursor = torch.randperm(len(chunks), generator=generator), 0
        pick = order[cursor : cursor + batch_size]
        cursor += batch_size
        inputs, actions, mask, a = chunk_batch(
            learner.policy, episodes, [chunks[i] for i in pick.tolist()], adv
        )
        learner.model.train()
        dist = learner.model(inputs)
        logp = dist.scaled(scale).log_prob(actions).sum(-1)
        out = loss_fn(logp, old[pick], a, mask, clip_low=g.clip_low, clip_high=g.clip_high)
        step = learner.actor_step(out.loss, dist)
        if step is not None:
            step |= {k: float(v) for k, v in out.metrics.items() if k in ("clip_fraction", "approx_kl")}
        steps.append(step)
    return stats | learner.actor_metrics(steps)


class GRPOUpdate:
    """GRPO on the iteration's own episodes: flat groups (`update_grpo`) or branched ones
    (`update_branched_grpo`), without the groups the sampler dropped; no critics."""

    trains_critics = False

    def update(self, learner: Learner, collected: Collected, generator: torch.Generator) -> dict[str, Any]:
        dropped = collected.dropped
        if collected.branched is not None:
            return update_branched_grpo(learner, collected.branched.without(dropped), generator)
        kept = [e for e in collected.episodes if e.group not in dropped] if dropped else collected.episodes
        return update_grpo(learner, kept, generator)


GRPO = GRPOUpdate()
