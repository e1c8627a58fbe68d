"""Sol-RL: explore a large candidate pool with the policy in low precision, train only on a few of its
leaves replayed exactly in full precision.

1. The pool: exploration trees (`exploration_plan`: `explore.branch_factor` children per split,
   optionally fewer denoising steps) rolled out with the denoiser fake-quantised
   (`mmrl.precision.explore_precision`, e.g. NVFP4) and rewarded.
2. The contrastive keep: per prompt, the best keep/2 and the worst keep/2 leaves by the pool's reward
   (`keep_best_and_worst`), which give the largest reward spread for the advantage.
3. The exact replay: the kept leaves' keys and their ancestors form a skeleton; rolling out only that
   skeleton in full precision on the full schedule (`replay_plan`) draws the same keyed noise as the
   pool did (`diffusion_rl.branch_rollout`), so a replayed leaf is the full-precision sample of its key.
4. The rank agreement: Kendall tau between the pool's and the replay's rewards of the kept leaves, a
   measure of how well the low precision ranks candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffusion_rl.branch_rollout import TreePlan, ancestors, plan_for
from diffusion_rl.config import ExploreConfig, RolloutConfig
from mmrl.tree import RolloutTree


def exploration_plan(rollout: RolloutConfig, explore: ExploreConfig) -> TreePlan:
    """The pool's trees: the rollout's splits with `explore.branch_factor` children, on
    `explore.steps` denoising steps (split steps rescaled) when it is set."""
    return plan_for(rollout, explore.steps, explore.branch_factor)


def replay_plan(rollout: RolloutConfig, explore: ExploreConfig) -> TreePlan:
    """The replay's trees: the full schedule with the pool's branch factor, so that a kept key names
    the same node (and draws the same noise) as in the pool."""
    return plan_for(rollout, branch_factor=explore.branch_factor)


def keep_best_and_worst(rewards: torch.Tensor, keep: int) -> list[int]:
    """Indices, ascending, of the keep/2 highest and the keep/2 lowest of one tree's leaf `rewards`."""
    order = rewards.argsort(descending=True).tolist()
    half = keep // 2
    return sorted(set(order[:half] + order[-half:]))


@dataclass
class KeptLeaves:
    """What the pool hands to the replay."""

    skeletons: list[set[int]]  # per tree: the kept leaves' keys and their ancestors
    pool_rewards: dict[tuple[int, int], float]  # (tree index, leaf key) -> the kept leaf's pool reward


def keep_for_replay(plan: TreePlan, trees: list[RolloutTree], rewards: torch.Tensor, keep: int) -> KeptLeaves:
    """The best and worst leaves of every pool tree (`rewards`: one per leaf, tree-major) as replay
    skeletons, with their pool rewards for `rank_agreement`."""
    per_tree = rewards.view(len(trees), -1)
    skeletons, pool_rewards = [], {}
    for t, tree in enumerate(trees):
        chosen = keep_best_and_worst(per_tree[t], keep)
        leaves = tree.leaves()
        keys = [tree.nodes[leaves[c]].state["key"] for c in chosen]
        skeletons.append(ancestors(plan, keys))
        pool_rewards.update({(t, k): float(per_tree[t, c]) for k, c in zip(keys, chosen, strict=True)})
    return KeptLeaves(skeletons, pool_rewards)


def kendall_tau(a: torch.Tensor, b: torch.Tensor) -> float:
    """Rank agreement of two score vectors (tau-a; 1 = same order, -1 = reversed; ties count 0)."""
    n = len(a)
    if n < 2:
        return float("nan")
    da = torch.sign(a.unsqueeze(0) - a.unsqueeze(1))
    db = torch.sign(b.unsqueeze(0) - b.unsqueeze(1))
    return float((da * db).triu(1).sum() / (n * (n - 1) / 2))


def rank_agreement(kept: KeptLeaves, trees: list[RolloutTree], rewards: torch.Tensor) -> float:
    """Kendall tau between the pool's (low precision) and the replay's (full precision) rewards of
    the kept leaves; `trees` and `rewards` (one per leaf, tree-major) are the replay's."""
    low, high = [], []
    offset = 0
    for t, tree in enumerate(trees):
        for leaf in tree.leaves():
            low.append(kept.pool_rewards[(t, tree.nodes[leaf].state["key"])])
            high.append(float(rewards[offset]))
            offset += 1
    return kendall_tau(torch.tensor(low), torch.tensor(high))
