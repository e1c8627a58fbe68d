import math

import pytest
import torch

from mmrl.tree import Edge, RolloutTree, batch_trees, depth_prune, width_prune


def binary_tree(depth: int) -> RolloutTree:
    """Every node splits in two down to `depth`; leaf rewards 0, 1, 2, ... left to right."""
    tree = RolloutTree(root_state="x0")
    frontier = [0]
    for _ in range(depth):
        frontier = [
            tree.add_child(node, state=f"s{node}.{k}", action=k, old_logp=0.0)
            for node in frontier
            for k in (0, 1)
        ]
    for reward, leaf in enumerate(frontier):
        tree.set_leaf_reward(leaf, float(reward))
    return tree


def small_tree() -> RolloutTree:
    """root -> a, b; a -> a0, a1, a2; b -> b0 (an unbalanced tree, like a tool rollout)."""
    tree = RolloutTree(root_state="prompt")
    a = tree.add_child(0, "a", old_logp=math.log(0.75))
    b = tree.add_child(0, "b", old_logp=math.log(0.25))
    for reward in (1.0, 0.0, 0.5):
        tree.set_leaf_reward(tree.add_child(a, "a-leaf", old_logp=0.0), reward)
    tree.set_leaf_reward(tree.add_child(b, "b-leaf", old_logp=torch.tensor([-1.0, -2.0])), 3.0)
    return tree


def test_binary_tree_with_four_splits_has_sixteen_leaves():
    tree = binary_tree(4)
    assert len(tree.leaves()) == 16
    assert len(tree) == 31
    assert tree.depth == 4
    assert [len([n for n in tree.nodes if n.depth == d]) for d in range(5)] == [1, 2, 4, 8, 16]
    assert len(tree.edges()) == 30


def test_flat_group_is_depth_one():
    tree = RolloutTree.flat(
        "prompt", ["y0", "y1", "y2"], rewards=[1.0, 0.0, 0.5], old_logps=[-1.0, -2.0, -3.0]
    )
    assert tree.depth == 1
    assert tree.leaves() == [1, 2, 3]
    assert tree.edges() == [(0, 1), (0, 2), (0, 3)]
    assert [tree.nodes[i].old_logp for i in tree.leaves()] == [-1.0, -2.0, -3.0]
    tree.fuse_rewards()
    assert tree.nodes[0].reward == pytest.approx(0.5)


def test_node_fields():
    tree = small_tree()
    leaf = tree.nodes[3]
    assert (leaf.parent_id, leaf.depth, leaf.state, leaf.is_leaf) == (1, 2, "a-leaf", True)
    assert tree.nodes[1].children == [3, 4, 5]
    with pytest.raises(ValueError, match="has children"):
        tree.set_leaf_reward(1, 1.0)


def test_path_to_runs_from_root_to_leaf():
    tree = binary_tree(3)
    leaf = tree.leaves()[5]
    path = tree.path_to(leaf)
    assert len(path) == 3
    assert path[0].parent == 0 and path[-1].child == leaf
    assert all(a.child == b.parent for a, b in zip(path, path[1:], strict=False))
    assert tree.path_to(0) == []


def test_fuse_mean_is_mean_of_leaves():
    tree = small_tree()
    tree.fuse_rewards("mean")
    rewards = [node.reward for node in tree.nodes]
    # a: mean(1, 0, 0.5) = 0.5; b: 3; root: mean of all four leaves (not of a and b)
    assert rewards[:3] == pytest.approx([(1 + 0 + 0.5 + 3) / 4, 0.5, 3.0])
    assert rewards[3:] == [1.0, 0.0, 0.5, 3.0]


def test_fuse_logprob_weighted_by_hand():
    tree = small_tree()
    # b's leaf has a two-step edge: its log-prob is the sum -3
    tree.fuse_rewards("logprob_weighted")
    assert tree.nodes[1].reward == pytest.approx(0.5)  # equal edge log-probs: plain mean
    assert tree.nodes[2].reward == pytest.approx(3.0)  # one child
    # root: softmax(log 0.75, log 0.25) = (0.75, 0.25)
    assert tree.nodes[0].reward == pytest.approx(0.75 * 0.5 + 0.25 * 3.0)


def test_fuse_needs_rewards_and_logprobs():
    tree = RolloutTree.flat("p", ["a", "b"], rewards=None)
    with pytest.raises(ValueError, match="no reward"):
        tree.fuse_rewards()
    tree.set_leaf_reward(1, 0.0)
    tree.set_leaf_reward(2, 1.0)
    with pytest.raises(ValueError, match="old_logp"):
        tree.fuse_rewards("logprob_weighted")
    with pytest.raises(ValueError, match="mean, logprob_weighted"):
        tree.fuse_rewards("max")


def test_depth_prune():
    tree = binary_tree(3)
    kept = depth_prune(tree, depths_to_drop=[1, 3])
    assert kept == [edge for edge in tree.edges() if tree.nodes[edge.child].depth == 2]
    assert len(kept) == 4
    assert depth_prune(tree, []) == tree.edges()


def test_width_prune_top_half_per_branch():
    tree = small_tree()
    advantages = torch.tensor([0.0, 0.0, 0.0, 1.0, -1.0, 0.5, 2.0])
    kept = width_prune(tree, advantages, mode="top_half_per_branch")
    # internal edges stay; a keeps its best leaf of three (3 // 2 = 1); b keeps its only leaf
    assert kept == [Edge(0, 1), Edge(0, 2), Edge(1, 3), Edge(2, 6)]


def test_width_prune_best_worst_quarter():
    tree = binary_tree(3)  # leaves 7..14
    advantages = torch.zeros(len(tree))
    advantages[7:15] = torch.tensor([0.1, 0.9, -0.5, 0.3, -0.9, 0.0, 0.8, 0.2])
    kept = width_prune(tree, advantages, mode="best_worst_quarter")
    kept_leaves = [edge.child for edge in kept if tree.nodes[edge.child].is_leaf]
    assert kept_leaves == [8, 9, 11, 13]  # best two (0.9, 0.8) and worst two (-0.9, -0.5)
    assert len(kept) == 6 + 4
    # composes with depth pruning
    assert depth_prune(tree, [1], edges=kept) == kept[2:]


def test_to_tensors_and_batch_trees():
    small, flat = small_tree(), RolloutTree.flat("q", ["y0", "y1"], rewards=[1.0, 0.0])
    small.fuse_rewards()
    single = small.to_tensors()
    assert single["parent_ids"].tolist() == [-1, 0, 0, 1, 1, 1, 2]
    assert single["depths"].tolist() == [0, 1, 1, 2, 2, 2, 2]
    assert single["rewards"][0].item() == pytest.approx(1.125)

    batch = batch_trees([small, flat])
    assert batch["tree_ids"].tolist() == [0] * 7 + [1] * 3
    assert batch["node_ids"].tolist() == list(range(7)) + [0, 1, 2]
    assert batch["parents"].tolist() == [-1, 0, 0, 1, 1, 1, 2, -1, 7, 7]  # rows in the batch
    assert batch["depths"].tolist() == single["depths"].tolist() + [0, 1, 1]
    assert torch.equal(batch["rewards"][:7], single["rewards"])
    assert math.isnan(batch["rewards"][7].item())  # the unfused root of the flat group
    assert batch["rewards"][8:].tolist() == [1.0, 0.0]
    assert {key: value.shape for key, value in batch.items()} == {key: (10,) for key in batch}
