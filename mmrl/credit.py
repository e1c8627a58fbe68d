"""Credit assignment: the one place that turns a rollout and the configured advantage estimator into
the advantage every trained step carries.

A rollout is a list of `RolloutTree`s with rewards on their leaves; a flat GRPO group is the depth-1
tree `RolloutTree.flat` builds. The estimator decides the credit:

- a *tree* estimator (kind "tree") scores every node from the rewards fused up its tree, and each edge
  is trained once with A(the node it leads to) (node credit);
- a *group* estimator (kind "group") scores the leaves with each tree's leaves as one group, and each
  leaf's whole path is trained with the leaf's advantage, so an edge shared by k leaves counts k times
  (flat credit: flat GRPO's loss on every leaf's path).

Trainers call `assign_credit` and read `Credit`; none of them asks which kind the estimator is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from mmrl.registry import ADVANTAGES
from mmrl.tree import RolloutTree, fused_node_advantages

NodeKey = tuple[int, int]  # (tree index, node id)


class GroupedRewards(NamedTuple):
    """Leaf rewards of every process, for a group estimator that must see all of them: `rewards` and
    `groups` (one group id per leaf) over all processes, and `offset`, where this process's leaves
    (tree-major, in leaf order) start."""

    rewards: Tensor
    groups: Tensor
    offset: int


@dataclass(frozen=True)
class Credit:
    """nodes: A for every non-root node, keyed (tree index, node id): a tree estimator's A(node), or
    for a group estimator the mean advantage of the leaves below the node.
    leaves: A for every leaf, keyed the same way.
    per_leaf: True when each leaf's path is trained with `leaves[leaf]` (an edge once per leaf below
    it), False when each edge is trained once with `nodes[node]`."""

    nodes: dict[NodeKey, float]
    leaves: dict[NodeKey, float]
    per_leaf: bool

    def path_advantage(self, leaf: NodeKey, node: NodeKey) -> float:
        """The advantage the edge into `node` carries when it is trained as part of `leaf`'s path."""
        return self.leaves[leaf] if self.per_leaf else self.nodes[node]


def assign_credit(
    trees: Sequence[RolloutTree],
    estimator: str,
    *,
    fusion: str = "mean",
    clip: float | None = None,
    everyone: GroupedRewards | None = None,
) -> Credit:
    """The credit of `trees` (leaf rewards set) under the `ADVANTAGES` entry `estimator`.

    fusion: how a tree estimator's node rewards come from the leaves (`RolloutTree.fuse_rewards`).
    clip: the advantages are clamped to [-clip, clip] (a tree estimator clips inside, as its `clip`
    option); None leaves them as they are.
    everyone: for a group estimator, the rewards and groups of every process's leaves; by default the
    leaves of `trees`, one group per tree. A tree estimator ignores it (a tree lives on one process).
    """
    keys = [(t, leaf) for t, tree in enumerate(trees) for leaf in tree.leaves()]
    if ADVANTAGES.has_kind(estimator, "tree"):
        options = {} if clip is None else {"clip": clip}
        nodes = fused_node_advantages(trees, ADVANTAGES.get(estimator), fusion, **options)
        return Credit(nodes, {key: nodes[key] for key in keys}, per_leaf=False)

    if everyone is None:
        rewards = torch.tensor([trees[t].nodes[leaf].reward for t, leaf in keys])
        everyone = GroupedRewards(rewards, torch.tensor([t for t, _ in keys]), 0)
    result = ADVANTAGES.get(estimator)(everyone.rewards, everyone.groups)
    values = result.values * result.loss_mask
    if clip is not None:
        values = values.clamp(-clip, clip)
    own = values[everyone.offset : everyone.offset + len(keys)].tolist()
    leaves = dict(zip(keys, own, strict=True))
    return Credit(_mean_over_leaves_below(trees, leaves), leaves, per_leaf=True)


def _mean_over_leaves_below(
    trees: Sequence[RolloutTree], leaves: dict[NodeKey, float]
) -> dict[NodeKey, float]:
    """Every non-root node's mean leaf advantage over the leaves below it (a leaf's own for a leaf)."""
    nodes = {}
    for t, tree in enumerate(trees):
        total, count = [0.0] * len(tree), [0] * len(tree)
        for leaf in tree.leaves():
            for _, child in tree.path_to(leaf):
                total[child] += leaves[(t, leaf)]
                count[child] += 1
        nodes.update({(t, n): total[n] / count[n] for n in range(1, len(tree))})
    return nodes
