"""mmrl.credit: one call turns trees and an estimator into the advantage each trained step carries."""

import pytest
import torch

from mmrl.credit import GroupedRewards, assign_credit
from mmrl.registry import ADVANTAGES
from mmrl.tree import RolloutTree, fused_node_advantages


def branched_tree(rewards: list[float]) -> RolloutTree:
    """A root with two children, each with two leaves, the leaves rewarded in order."""
    tree = RolloutTree("prompt")
    for half in range(2):
        middle = tree.add_child(0, f"m{half}")
        for k in range(2):
            leaf = tree.add_child(middle, f"l{half}{k}")
            tree.set_leaf_reward(leaf, rewards[2 * half + k])
    return tree


def test_a_group_estimator_scores_each_trees_leaves_as_one_group_and_credits_whole_paths():
    trees = [branched_tree([1.0, 0.0, 0.0, 0.0]), branched_tree([0.0, 1.0, 1.0, 1.0])]
    credit = assign_credit(trees, "grpo")
    assert credit.per_leaf
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    expected = ADVANTAGES.get("grpo")(rewards, torch.arange(2).repeat_interleave(4)).values.tolist()
    keys = [(t, leaf) for t in range(2) for leaf in trees[t].leaves()]
    assert [credit.leaves[k] for k in keys] == expected
    # the winning leaf of tree 0 is above its group mean, and so is the middle node above it
    assert credit.leaves[(0, 2)] > 0 > credit.leaves[(0, 3)]
    assert credit.nodes[(0, 1)] == pytest.approx((credit.leaves[(0, 2)] + credit.leaves[(0, 3)]) / 2)
    # trained as a leaf's path, an edge carries the leaf's advantage, not its node's
    assert credit.path_advantage((0, 3), (0, 1)) == credit.leaves[(0, 3)]


def test_a_tree_estimator_gives_each_edge_its_nodes_advantage():
    trees = [branched_tree([1.0, 1.0, 0.0, 0.0])]
    credit = assign_credit(trees, "tree_depthwise")
    assert not credit.per_leaf
    assert credit.nodes == fused_node_advantages(
        [branched_tree([1.0, 1.0, 0.0, 0.0])], ADVANTAGES.get("tree_depthwise")
    )
    # the branch whose leaves won is credited above the one whose leaves lost, whatever leaf asks
    assert credit.nodes[(0, 1)] > 0 > credit.nodes[(0, 4)]
    assert credit.path_advantage((0, 6), (0, 1)) == credit.nodes[(0, 1)]
    assert credit.leaves == {key: credit.nodes[key] for key in [(0, 2), (0, 3), (0, 5), (0, 6)]}


def test_a_flat_group_is_a_depth_one_tree():
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.25])
    credit = assign_credit([RolloutTree.flat("q", ["a", "b", "c", "d"], rewards.tolist())], "grpo")
    expected = ADVANTAGES.get("grpo")(rewards, torch.zeros(4, dtype=torch.long)).values.tolist()
    assert [credit.leaves[(0, n)] for n in range(1, 5)] == expected
    assert credit.nodes == credit.leaves  # in a depth-1 tree every node is a leaf


def test_clip_bounds_both_kinds():
    trees = [RolloutTree.flat("q", list("abcdefgh"), [1.0] + [0.0] * 7)]
    for estimator in ("grpo", "tree_depthwise"):
        credit = assign_credit(trees, estimator, clip=0.5)
        assert max(abs(a) for a in credit.nodes.values()) <= 0.5
        assert max(credit.leaves.values()) == 0.5


def test_every_process_leaves_are_one_estimate_and_this_process_reads_its_own():
    mine = [RolloutTree.flat("q", ["a", "b"], [1.0, 0.0])]
    everyone = GroupedRewards(torch.tensor([5.0, 3.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1]), offset=2)
    credit = assign_credit(mine, "grpo", everyone=everyone)
    expected = ADVANTAGES.get("grpo")(everyone.rewards, everyone.groups).values[2:].tolist()
    assert [credit.leaves[(0, 1)], credit.leaves[(0, 2)]] == expected
