"""BranchGRPO's tree rollout, top to bottom: the plan of every tree (where it splits, which steps are
stochastic), the rollout that branches every node at the split steps (and the log-probs of its stored
steps, recomputed by the update), the leaves' rewards fused up the tree into node advantages, and the
edges that depth and width pruning leave to train.

Every random draw is keyed by (seed, step, tree, node key, denoising step), and node keys number a
full k-ary tree (k the largest branch factor), so any subset of leaves (a skeleton of keys) replays
exactly: this is what Sol-RL's
exploration (`diffusion_rl.quantized_exploration`) relies on. The credit and pruning themselves are
`mmrl.tree`'s, shared with the other tree trainers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffusion_rl.config import PruneConfig, RolloutConfig, split_factors
from diffusion_rl.models import Conditioning, FlowPipeline
from diffusion_rl.sde import (
    StepOutput,
    adams_bashforth2_step,
    initial_noise_std,
    ode_step,
    sde_step,
    sde_step_mask,
)
from mmrl.config import ConfigError
from mmrl.noise import NoiseKey, keyed_randn_batch
from mmrl.tree import Edge, RolloutTree, depth_prune, width_prune

# ---------------------------------------------------------------------------------------------
# The plan


@dataclass
class StepRecord:
    """One stochastic denoising step of an edge: enough to recompute its log-prob later."""

    step: int
    x: torch.Tensor
    x_next: torch.Tensor
    old_logp: float


@dataclass
class TreePlan:
    """The shape every tree of a rollout takes, and which steps are stochastic."""

    steps: int
    split_steps: list[int]
    branch_factor: int | list[int]  # children per node: at every split, or one number per split
    sde_mask: list[bool]

    def factors(self) -> list[int]:
        """Children per node at each split step."""
        return split_factors(self.branch_factor, len(self.split_steps))

    def factor_at(self, step: int) -> int:
        return self.factors()[self.split_steps.index(step)]

    def child_key(self, parent_key: int, index: int) -> int:
        """Heap numbering of a k-ary tree, k the largest factor: keys (and so noise) do not depend on
        which nodes exist, and a key's parent is (key - 1) // k at any depth."""
        return parent_key * max(self.factors()) + index + 1

    def rows_per_step(self) -> list[int]:
        """How many nodes one tree evaluates at each step (its leaves at the last)."""
        rows, per_step = 1, []
        for i in range(self.steps):
            rows *= self.factor_at(i) if i in self.split_steps else 1
            per_step.append(rows)
        return per_step

    def leaf_keys(self) -> list[int]:
        keys = [0]
        for factor in self.factors():
            keys = [self.child_key(k, i) for k in keys for i in range(factor)]
        return keys


def ancestors(plan: TreePlan, leaf_keys: list[int]) -> set[int]:
    """Every key on the paths from the root to `leaf_keys` (the skeleton of a replay)."""
    keep, arity = {0}, max(plan.factors())
    for key in leaf_keys:
        while key not in keep:
            keep.add(key)
            key = (key - 1) // arity
    return keep


def plan_for(rollout: RolloutConfig, steps: int | None = None, branch_factor: int | None = None) -> TreePlan:
    """The rollout's tree plan, optionally with fewer steps (split steps rescaled) or another factor."""
    steps = steps or rollout.steps
    splits = [s * steps // rollout.steps for s in rollout.split_steps]
    if len(set(splits)) != len(splits):
        raise ConfigError(
            f"config error: explore.steps = {steps} is too few to keep the split steps "
            f"{rollout.split_steps} of {rollout.steps} steps apart"
        )
    window = None
    if rollout.sde_window is not None:
        window = (
            rollout.sde_window[0] * steps // rollout.steps,
            rollout.sde_window[1] * steps // rollout.steps,
        )
    sde_mask = sde_step_mask(steps, splits, window)
    if rollout.sde == "ddim":  # DDIM's last step (to sigma = 0) has no noise: it is an ODE step
        sde_mask[-1] = False
    return TreePlan(steps, splits, branch_factor or rollout.branch_factor, sde_mask)


# ---------------------------------------------------------------------------------------------
# The splits: the rollout, and the log-probs of its stored steps


@torch.no_grad()
def rollout_trees(
    pipe: FlowPipeline,
    cond: Conditioning,
    uncond: Conditioning,
    tree_ids: list[int],
    plan: TreePlan,
    rollout: RolloutConfig,
    seed: int,
    step: int,
    skeletons: list[set[int]] | None = None,
) -> tuple[list[RolloutTree], torch.Tensor, int]:
    """Denoise one tree per prompt; return the trees, the leaf latents (tree-major order) and the
    number of model evaluations. `tree_ids` name the trees in their noise keys and must differ within
    a step (a prompt drawn twice still gets two different trees). A node's `state` holds its noise
    key and its `StepRecord`s; a skeleton (a set of keys) restricts the tree to those nodes, for exact
    replays."""
    device = pipe.device
    sigmas = pipe.sigmas(plan.steps)
    trees = [RolloutTree(root_state={"key": 0, "records": []}) for _ in tree_ids]
    rows = [(t, 0) for t in range(len(trees))]  # (tree index, node id)

    # Noise is keyed by position on the full schedule (rollout.steps), so an exploration pass with
    # fewer steps starts from the same initial noise as its full-step replay and draws the same noise
    # at its split steps. Initial noise is keyed by the node that starts from it (the root, or with
    # `shared_initial_noise` off each child of the first split) and by rollout.steps, never a step index.
    same_splits = len(plan.split_steps) == len(rollout.split_steps)
    full_split = dict(zip(plan.split_steps, rollout.split_steps, strict=True)) if same_splits else {}

    def schedule_index(i: int) -> int:
        return full_split.get(i, i * rollout.steps // plan.steps)

    def branch(parents: list[tuple[int, int]], factor: int) -> tuple[list[tuple[int, int]], list[int]]:
        """Add every node's `factor` children (those in the skeleton); return their rows and their
        parents'."""
        new_rows, parent_rows = [], []
        for r, (t, node) in enumerate(parents):
            parent_key = trees[t].nodes[node].state["key"]
            for c in range(factor):
                key = plan.child_key(parent_key, c)
                if skeletons is not None and key not in skeletons[t]:
                    continue
                new_rows.append((t, trees[t].add_child(node, state={"key": key, "records": []})))
                parent_rows.append(r)
        return new_rows, parent_rows

    splits = set(plan.split_steps)

    def deterministic(i: int) -> bool:
        return not plan.sde_mask[i] and i not in splits

    if not rollout.shared_initial_noise:  # the split at step 0 happens before it, on the initial noise
        rows, _ = branch(rows, plan.factor_at(0))
        splits.discard(0)
    initial_keys = [
        NoiseKey(seed, step, tree_ids[t], trees[t].nodes[n].state["key"], rollout.steps) for t, n in rows
    ]
    x = keyed_randn_batch(pipe.latent_shape(), initial_keys, device=device) * initial_noise_std(sigmas[0])
    evaluations = 0
    previous: tuple[torch.Tensor, torch.Tensor] | None = None  # last ODE velocity and its sigma step
    i = 0
    while i < plan.steps:
        tree_index = [t for t, _ in rows]
        v = pipe.velocity(
            x, sigmas[i].expand(len(rows)), cond[tree_index], rollout.guidance_scale, uncond[tree_index]
        )
        evaluations += len(rows)
        if deterministic(i):  # ODE: up to `ode_stride` steps in one, never across a stochastic step
            end = i + 1
            while end < min(i + rollout.ode_stride, plan.steps) and deterministic(end):
                end += 1
            if previous is None:
                x_next = ode_step(v, x, sigmas[i], sigmas[end])
            else:
                x_next = adams_bashforth2_step(v, previous[0], x, sigmas[i], sigmas[end], previous[1])
            previous = (v, sigmas[end] - sigmas[i]) if rollout.ode_stride > 1 else None
            x, i = x_next, end
            continue
        previous = None
        if i in splits:  # children share the parent's velocity at the split step
            rows, parent_rows = branch(rows, plan.factor_at(i))
            x, v = x[parent_rows], v[parent_rows]
        if plan.sde_mask[i]:
            keys = [
                NoiseKey(seed, step, tree_ids[t], trees[t].nodes[n].state["key"], schedule_index(i))
                for t, n in rows
            ]
            noise = keyed_randn_batch(pipe.latent_shape(), keys, device=device)
            scale = noise_scale(rollout, i in plan.split_steps)
            out = sde_step(rollout.sde, v, x, sigmas[i], sigmas[i + 1], noise_scale=scale, noise=noise)
            for r, (t, n) in enumerate(rows):
                trees[t].nodes[n].state["records"].append(
                    StepRecord(i, x[r].clone(), out.prev_sample[r].clone(), float(out.log_prob[r]))
                )
            x = out.prev_sample
        i += 1
    for t, tree in enumerate(trees):  # leaves in tree order, matching `rows`
        assert [n for tt, n in rows if tt == t] == tree.leaves()
    for tree in trees:
        for node in tree.nodes:
            node.old_logp = torch.tensor([r.old_logp for r in node.state["records"]])
    return trees, x, evaluations


def noise_scale(rollout: RolloutConfig, at_split: bool) -> float:
    """The SDE noise scale of a stochastic step: `rollout.split_noise_scale` times more at a split."""
    return rollout.noise_level * (rollout.split_noise_scale if at_split else 1.0)


def step_log_probs(
    rollout: RolloutConfig,
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    x_next: torch.Tensor,
    is_split: torch.Tensor,
) -> StepOutput:
    """Log-probs of stored steps x -> x_next under velocity `v` (the update's, from the policy being
    trained), each with the noise scale its rollout step had."""
    scales = {False: noise_scale(rollout, False), True: noise_scale(rollout, True)}
    if scales[False] == scales[True] or is_split.all() or not is_split.any():
        scale = scales[bool(is_split[0])]
        return sde_step(rollout.sde, v, x, sigma, sigma_next, noise_scale=scale, prev_sample=x_next)
    log_prob = torch.empty(len(x), device=x.device)
    mean = torch.empty(x.shape, device=x.device)
    std = torch.empty((len(x),) + (1,) * (x.dim() - 1), device=x.device)
    for split in (False, True):
        idx = (is_split == split).nonzero().squeeze(1).to(x.device)
        part = sde_step(
            rollout.sde,
            v[idx],
            x[idx],
            sigma[idx],
            sigma_next[idx],
            noise_scale=scales[split],
            prev_sample=x_next[idx],
        )
        log_prob[idx], mean[idx] = part.log_prob, part.mean
        std[idx] = part.std.expand((len(idx),) + (1,) * (x.dim() - 1))
    return StepOutput(x_next, log_prob, mean, std)


# ---------------------------------------------------------------------------------------------
# Rewards, fused up the tree into credit, and the edges left to train


def set_leaf_rewards(trees: list[RolloutTree], rewards: torch.Tensor) -> None:
    """Put `rewards` (one per leaf, tree-major as `rollout_trees` returns the leaves) on the leaves."""
    per_tree = rewards.view(len(trees), -1)
    for tree, row in zip(trees, per_tree.tolist(), strict=True):
        for leaf, reward in zip(tree.leaves(), row, strict=True):
            tree.set_leaf_reward(leaf, reward)


def trained_edges(tree: RolloutTree, node_advantages: list[float], prune: PruneConfig) -> list[Edge]:
    """The edges BranchGRPO trains: width pruning of the leaves' edges by advantage (`node_advantages`
    indexed by node id), then depth pruning, both as `mmrl.tree` defines them."""
    edges = None if prune.width == "none" else width_prune(tree, node_advantages, mode=prune.width)
    return depth_prune(tree, prune.depths, edges)


def training_samples(
    trees: list[RolloutTree],
    advantages: dict[tuple[int, int], float],
    prune: PruneConfig,
    leaf_weighted: bool = False,
) -> list[list[tuple[int, StepRecord, float, float]]]:
    """(tree index, step record, advantage, weight) for every stochastic step of every trained edge,
    in groups that share their input: siblings' first steps start from their parent's latent at the
    split, so the update evaluates the model once for them, as the rollout did. The weight is 1, or
    with `leaf_weighted` the number of leaves below the edge (it stands for that many paths)."""
    groups: dict[tuple[int, int, int], list[tuple[int, StepRecord, float, float]]] = {}
    for t, tree in enumerate(trees):
        node_advantages = [advantages.get((t, n), 0.0) for n in range(len(tree))]
        leaves_below = tree.leaf_counts() if leaf_weighted else [1] * len(tree)
        for parent, child in trained_edges(tree, node_advantages, prune):
            for k, record in enumerate(tree.nodes[child].state["records"]):
                key = (t, parent if k == 0 else child, record.step)
                sample = (t, record, node_advantages[child], float(leaves_below[child]))
                groups.setdefault(key, []).append(sample)
    return list(groups.values())
