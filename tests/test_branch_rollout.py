"""BranchGRPO's tree pieces without a model: plans, keys, credit on paths, pruning, stored-step log-probs."""

import pytest
import torch

from diffusion_rl.branch_rollout import (
    StepRecord,
    TreePlan,
    ancestors,
    noise_scale,
    plan_for,
    set_leaf_rewards,
    step_log_probs,
    trained_edges,
    training_samples,
)
from diffusion_rl.config import PruneConfig, RolloutConfig
from diffusion_rl.sde import sde_step, shifted_sigmas
from mmrl.advantages import Advantages, tree_depthwise
from mmrl.config import ConfigError
from mmrl.credit import assign_credit
from mmrl.tree import RolloutTree, fused_node_advantages


def keyed_tree(plan: TreePlan, records_per_edge: int = 1) -> RolloutTree:
    """The full tree of `plan` with the rollout's node states: a key and one StepRecord per edge
    step (steps numbered by depth, x the parent's key so that siblings share their first input)."""
    tree = RolloutTree(root_state={"key": 0, "records": []})
    frontier = [0]
    for depth in range(1, len(plan.split_steps) + 1):
        children = []
        for node in frontier:
            parent_key = tree.nodes[node].state["key"]
            for c in range(plan.factors()[depth - 1]):
                key = plan.child_key(parent_key, c)
                records = [
                    StepRecord(
                        10 * depth + k,
                        torch.full((1,), float(parent_key if k == 0 else key)),
                        torch.zeros(1),
                        0.0,
                    )
                    for k in range(records_per_edge)
                ]
                children.append(tree.add_child(node, state={"key": key, "records": records}))
        frontier = children
    return tree


def test_plan_rescales_splits_and_marks_stochastic_steps():
    rollout = RolloutConfig(steps=10, split_steps=[0, 4, 6], sde_window=[0, 2], branch_factor=2)
    plan = plan_for(rollout)
    assert plan.sde_mask == [True, True, False, False, True, False, True, False, False, False]
    few = plan_for(rollout, steps=5, branch_factor=3)
    assert (few.split_steps, few.branch_factor) == ([0, 2, 3], 3)
    assert few.sde_mask == [True, False, True, True, False]
    ddim = plan_for(RolloutConfig(steps=4, split_steps=[0], sde="ddim"))
    assert ddim.sde_mask == [True, True, True, False]  # the last DDIM step has no noise
    with pytest.raises(ConfigError, match="too few"):
        plan_for(rollout, steps=2)


def test_keys_number_a_full_tree_and_ancestors_close_the_paths():
    plan = plan_for(RolloutConfig(steps=8, split_steps=[0, 2, 4], branch_factor=2))
    assert plan.leaf_keys() == list(range(7, 15))
    assert [plan.child_key(3, i) for i in range(2)] == [7, 8]
    assert ancestors(plan, [7, 14]) == {0, 1, 3, 7, 2, 6, 14}
    assert ancestors(plan, []) == {0}


def test_a_factor_per_split_numbers_the_tree_of_the_largest_factor():
    """[4, 2, 2]: 4 children of the root, then 2 and 2; keys are those of the full 4-ary tree, so every
    key names one node and its parent is (key - 1) // 4 at any depth; one factor for all keeps the
    keys a uniform tree always had."""
    rollout = RolloutConfig(steps=8, split_steps=[0, 2, 4], branch_factor=[4, 2, 2])
    plan = plan_for(rollout)
    assert plan.factors() == [4, 2, 2] and rollout.leaves_per_tree() == 16
    assert plan.rows_per_step() == [4, 4, 8, 8, 16, 16, 16, 16]
    leaves = plan.leaf_keys()
    assert len(leaves) == len(set(leaves)) == 16
    assert leaves[:4] == [4 * (4 * 1 + 1) + 1, 4 * (4 * 1 + 1) + 2, 4 * (4 * 1 + 2) + 1, 4 * (4 * 1 + 2) + 2]
    tree = keyed_tree(plan)
    assert [len([n for n in tree.nodes if n.depth == d]) for d in range(4)] == [1, 4, 8, 16]
    keys = [node.state["key"] for node in tree.nodes]
    assert len(set(keys)) == len(keys)
    assert sorted(tree.nodes[n].state["key"] for n in tree.leaves()) == sorted(leaves)
    assert ancestors(plan, [leaves[0]]) == {0, 1, 5, leaves[0]}
    uniform = plan_for(RolloutConfig(steps=8, split_steps=[0, 2, 4], branch_factor=[2, 2, 2]))
    assert uniform.leaf_keys() == plan_for(RolloutConfig(steps=8, split_steps=[0, 2, 4])).leaf_keys()


def test_leaf_rewards_go_to_the_leaves_in_tree_major_order():
    plan = plan_for(RolloutConfig(steps=4, split_steps=[0, 2], branch_factor=2))
    trees = [keyed_tree(plan), keyed_tree(plan)]
    set_leaf_rewards(trees, torch.arange(8.0))
    assert [trees[1].nodes[leaf].reward for leaf in trees[1].leaves()] == [4.0, 5.0, 6.0, 7.0]


def test_pruning_is_mmrl_trees_width_then_depth():
    plan = plan_for(RolloutConfig(steps=6, split_steps=[0, 2, 4], branch_factor=2))
    tree = keyed_tree(plan)  # 15 nodes, leaves 7..14
    advantages = [0.0] * 7 + [0.1, 0.9, 0.3, 0.2, 0.8, 0.4, 0.6, 0.5]
    everything = trained_edges(tree, advantages, PruneConfig())
    assert len(everything) == 14
    no_depth_1 = trained_edges(tree, advantages, PruneConfig(depths=[1]))
    assert [e.child for e in no_depth_1] == list(range(3, 15))
    halves = trained_edges(tree, advantages, PruneConfig(width="top_half_per_branch", depths=[2]))
    # depth 1 kept (1, 2); depth 2 dropped; the better leaf of every pair: 8, 9, 11, 13
    assert [e.child for e in halves] == [1, 2, 8, 9, 11, 13]


def test_training_samples_group_siblings_first_steps_and_carry_the_childs_advantage():
    plan = plan_for(RolloutConfig(steps=6, split_steps=[0, 2], branch_factor=2))
    trees = [keyed_tree(plan, records_per_edge=2)]
    advantages = {(0, n): float(n) for n in range(1, 7)}
    groups = training_samples(trees, advantages, PruneConfig())
    samples = [s for group in groups for s in group]
    assert len(samples) == 6 * 2
    # first steps of siblings share (parent, step): 3 parents (root, 1, 2), so 12 - 3 groups
    assert len(groups) == 9
    assert sorted(len(g) for g in groups) == [1] * 6 + [2] * 3
    child_of = {id(r): n for n in range(1, 7) for r in trees[0].nodes[n].state["records"]}
    assert all(a == float(child_of[id(r)]) and w == 1.0 for _, r, a, w in samples)
    # flat credit: an edge counts once per leaf below it (2 under each child of the root)
    weighted = [s for group in training_samples(trees, advantages, PruneConfig(), True) for s in group]
    assert all(w == (2.0 if child_of[id(r)] <= 2 else 1.0) for _, r, _, w in weighted)
    pruned = training_samples(trees, advantages, PruneConfig(depths=[2]))
    assert sum(len(g) for g in pruned) == 2 * 2


def test_step_log_probs_use_each_steps_noise_scale():
    rollout = RolloutConfig(noise_level=0.7, split_noise_scale=2.0)
    assert noise_scale(rollout, False) == 0.7 and noise_scale(rollout, True) == pytest.approx(1.4)
    generator = torch.Generator().manual_seed(0)
    x, v = torch.randn(4, 3, 4, 4, generator=generator), torch.randn(4, 3, 4, 4, generator=generator)
    sigmas = shifted_sigmas(6)
    sigma, sigma_next = sigmas[[1, 2, 1, 3]], sigmas[[2, 3, 2, 4]]
    x_next = x - 0.1 * v + 0.05 * torch.randn(4, 3, 4, 4, generator=generator)
    is_split = torch.tensor([False, True, True, False])
    out = step_log_probs(rollout, v, x, sigma, sigma_next, x_next, is_split)
    for row, split in enumerate(is_split.tolist()):
        alone = sde_step(
            "flow_grpo",
            v[row : row + 1],
            x[row : row + 1],
            sigma[row : row + 1],
            sigma_next[row : row + 1],
            noise_scale=1.4 if split else 0.7,
            prev_sample=x_next[row : row + 1],
        )
        torch.testing.assert_close(out.log_prob[row], alone.log_prob[0])
        torch.testing.assert_close(out.mean[row], alone.mean[0])
    assert (
        out.log_prob[1]
        != step_log_probs(RolloutConfig(), v, x, sigma, sigma_next, x_next, is_split).log_prob[1]
    )


def test_fused_node_advantages_takes_any_tree_estimator_and_its_mask():
    plan = plan_for(RolloutConfig(steps=4, split_steps=[0, 2], branch_factor=2))
    trees = [keyed_tree(plan)]
    set_leaf_rewards(trees, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert (
        fused_node_advantages(trees, tree_depthwise, clip=5.0)
        == assign_credit(trees, "tree_depthwise", clip=5.0).nodes
    )  # the credit of a tree estimator is its fused node advantages

    def leaves_only(node_rewards, tree_ids, depths):
        return Advantages(node_rewards - 0.25, depths == 2)

    credit = fused_node_advantages(trees, leaves_only)
    assert credit == {(0, 1): 0.0, (0, 2): 0.0, (0, 3): 0.75, (0, 4): -0.25, (0, 5): -0.25, (0, 6): -0.25}
