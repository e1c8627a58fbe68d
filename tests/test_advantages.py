import math

import pytest
import torch

from mmrl.advantages import (
    Advantages,
    gae,
    grpo,
    grpo_global_std,
    mc_grpo,
    rloo,
    td1,
    tree_depthwise,
    tree_depthwise_nested,
    tree_depthwise_population_std,
    tree_value,
    treepo,
)
from mmrl.registry import ADVANTAGES

GROUP_ESTIMATORS = [grpo, grpo_global_std, rloo, mc_grpo]
TREE_ESTIMATORS = [tree_depthwise, tree_depthwise_population_std, tree_depthwise_nested, tree_value, treepo]


def group_means(values: torch.Tensor, group_ids: torch.Tensor) -> list[float]:
    return [values[group_ids == g].double().mean().item() for g in group_ids.unique()]


def test_every_estimator_is_registered_with_its_kind_and_returns_advantages():
    kinds = {
        "gae": "temporal",
        "td1": "temporal",
        "grpo": "group",
        "grpo_global_std": "group",
        "mc_grpo": "group",
        "rloo": "group",
        "tree_depthwise": "tree",
        "tree_depthwise_nested": "tree",
        "tree_depthwise_population_std": "tree",
        "tree_value": "tree",
        "treepo": "tree",
    }
    assert {name: ADVANTAGES.kind_of(name).name for name in ADVANTAGES.names()} == kinds
    assert ADVANTAGES.names_of_kind(("group", "tree")) == [
        "grpo",
        "grpo_global_std",
        "mc_grpo",
        "rloo",
        "tree_depthwise",
        "tree_depthwise_nested",
        "tree_depthwise_population_std",
        "tree_value",
        "treepo",
    ]
    rewards, ids = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 0])
    for name in ["grpo", "grpo_global_std", "mc_grpo", "rloo"]:
        out = ADVANTAGES.get(name)(rewards=rewards, group_ids=ids)
        assert isinstance(out, Advantages) and out.loss_mask.dtype == torch.bool
        assert out.values.shape == rewards.shape and out.returns is None


def test_grpo_hand_computed():
    # Group 7: [1, 3] -> mean 2, population std 1. Group 2: [0, 0, 6] -> mean 2, std sqrt(8).
    rewards = torch.tensor([1.0, 0.0, 3.0, 0.0, 6.0])
    ids = torch.tensor([7, 2, 7, 2, 2])
    out = grpo(rewards, ids, eps=0.0)
    s8 = math.sqrt(8)
    torch.testing.assert_close(out.values, torch.tensor([-1.0, -2 / s8, 1.0, -2 / s8, 4 / s8]))
    assert out.loss_mask.all()


def test_grpo_per_group_mean_zero_std_one_and_degenerate_groups_zero():
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2000,)) * 1000 + 17  # non-contiguous labels
    rewards = torch.rand(2000)
    rewards[ids == ids[0]] = 0.1  # one group with all-equal rewards
    values = grpo(rewards, ids).values
    assert (values[ids == ids[0]] == 0).all()
    for g in ids.unique():
        group = values[ids == g].double()
        assert abs(group.mean().item()) < 1e-5
        if g != ids[0]:
            assert abs(group.std(unbiased=False).item() - 1) < 1e-4
    single = grpo(torch.tensor([5.0, 1.0, 2.0]), torch.tensor([0, 1, 1])).values
    assert single[0] == 0


def test_grpo_global_std_hand_computed():
    rewards = torch.tensor([1.0, 3.0, 10.0, 10.0])
    ids = torch.tensor([0, 0, 1, 1])
    batch_std = rewards.std(unbiased=False).item()  # mean 6, deviations -5 -3 4 4 -> sqrt(66/4)
    assert math.isclose(batch_std, math.sqrt(16.5), rel_tol=1e-6)
    out = grpo_global_std(rewards, ids, eps=0.0)
    torch.testing.assert_close(out.values, torch.tensor([-1.0, 1.0, 0.0, 0.0]) / batch_std)


def test_rloo_hand_computed_and_sums_to_zero():
    rewards = torch.tensor([1.0, 2.0, 6.0, 4.0, 5.0])
    ids = torch.tensor([3, 3, 3, 9, -4])
    # Group 3: 1 - (2+6)/2 = -3, 2 - (1+6)/2 = -1.5, 6 - (1+2)/2 = 4.5; singleton groups -> 0.
    torch.testing.assert_close(rloo(rewards, ids).values, torch.tensor([-3.0, -1.5, 4.5, 0.0, 0.0]))
    torch.manual_seed(1)
    ids = torch.randint(0, 30, (500,))
    values = rloo(torch.randn(500), ids).values
    assert max(abs(m) for m in group_means(values, ids)) < 1e-5


def test_mc_grpo_hand_computed_pivot_and_ties():
    # Group 0: [3, 1, 2] -> median 2 (index 2), std sqrt(2/3). Group 5: [4, 4, 9] -> median 4,
    # tie between indices 3 and 4: the lowest index (3) is the pivot.
    rewards = torch.tensor([3.0, 1.0, 2.0, 4.0, 4.0, 9.0])
    ids = torch.tensor([0, 0, 0, 5, 5, 5])
    out = mc_grpo(rewards, ids, eps=0.0)
    s0, s5 = math.sqrt(2 / 3), torch.tensor([4.0, 4.0, 9.0]).std(unbiased=False).item()
    torch.testing.assert_close(out.values, torch.tensor([1 / s0, -1 / s0, 0.0, 0.0, 0.0, 5 / s5]))
    assert out.loss_mask.tolist() == [True, True, False, False, True, True]


def test_mc_grpo_one_pivot_per_group_with_zero_advantage():
    torch.manual_seed(2)
    ids = torch.arange(40).repeat_interleave(5)[torch.randperm(200)] * 3
    rewards = torch.randint(0, 3, (200,)).float()  # many ties
    out = mc_grpo(rewards, ids)
    for g in ids.unique():
        in_group = ids == g
        excluded = in_group & ~out.loss_mask
        assert excluded.sum() == 1
        assert out.values[excluded].item() == 0
        pivot = excluded.nonzero()[0, 0]
        assert rewards[pivot] == rewards[in_group].median()
        tied = (in_group & (rewards == rewards[pivot])).nonzero()[:, 0]
        assert pivot == tied.min()  # lowest index among ties


def test_mc_grpo_rejects_even_groups():
    with pytest.raises(ValueError, match=r"odd number \(G\+1\).*group id 4 has 2"):
        mc_grpo(torch.tensor([1.0, 2.0, 3.0, 1.0, 2.0]), torch.tensor([1, 1, 1, 4, 4]))


def binary_forest(n_trees: int, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parents, depths, tree ids) of n_trees full binary trees, rows in breadth-first order per tree."""
    size = 2 ** (depth + 1) - 1
    local = torch.arange(size)
    local_parents = torch.where(local > 0, (local - 1) // 2, -1)
    local_depths = torch.floor(torch.log2(local.double() + 1)).long()
    offsets = torch.arange(n_trees).repeat_interleave(size) * size
    parents = torch.where(local_parents.repeat(n_trees) >= 0, local_parents.repeat(n_trees) + offsets, -1)
    return parents, local_depths.repeat(n_trees), torch.arange(n_trees).repeat_interleave(size)


# A hand-built tree of uneven shape: root 0 -> a (1), b (2), c (3, a leaf at depth 1); a -> leaves 4, 5;
# b -> d (6) and a leaf 10 at depth 2; d -> leaves 7, 8, 9 at depth 3. Rows 11-14 are a second tree,
# pruned to a chain: root 11 -> e (12) -> leaves 13, 14.
UNEVEN_PARENTS = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 6, 6, 6, 2, -1, 11, 12, 12])
UNEVEN_DEPTHS = torch.tensor([0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 2, 0, 1, 2, 2])
UNEVEN_LEAF_REWARDS = {3: 0.2, 4: 1.0, 5: 0.0, 7: 1.0, 8: 1.0, 9: 0.0, 10: 0.5, 13: 0.3, 14: 0.9}


def mean_fused(parents: torch.Tensor, leaf_rewards: dict[int, float]) -> torch.Tensor:
    """Every node's mean leaf reward (BranchGRPO's mean fusion), computed by walking up from each leaf."""
    sums, counts = [0.0] * len(parents), [0] * len(parents)
    for leaf, reward in leaf_rewards.items():
        node = leaf
        while node >= 0:
            sums[node] += reward
            counts[node] += 1
            node = int(parents[node])
    return torch.tensor([total / count for total, count in zip(sums, counts, strict=True)])


def branchgrpo_reference(rewards: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor) -> list[float]:
    """BranchGRPO's depth-wise advantage as its code computes it, node by node: per tree and depth, 0
    for one node or an unbiased std under 1e-6, else (r - mean) / (torch.std + 1e-8), then clipped
    to [-5, 5] (its loss's adv_clip_max)."""
    roots = []
    for node in range(len(parents)):
        root = node
        while int(parents[root]) >= 0:
            root = int(parents[root])
        roots.append(root)
    out = [0.0] * len(rewards)
    for key in {(roots[i], int(depths[i])) for i in range(len(rewards))}:
        nodes = [i for i in range(len(rewards)) if (roots[i], int(depths[i])) == key]
        if len(nodes) <= 1:
            continue
        values = torch.tensor([float(rewards[i]) for i in nodes], dtype=torch.float64)
        if values.std() < 1e-6:
            continue
        for i, value in zip(nodes, (values - values.mean()) / (values.std() + 1e-8), strict=True):
            out[i] = max(-5.0, min(5.0, float(value)))
    return out


def test_tree_depthwise_hand_computed_and_single_node_depths():
    # One binary tree: root (row 0), depth 1: rows 1, 2 with [1, 3], depth 2: rows 3-6 with [0, 2, 2, 4];
    # a second tree (rows 7-9) whose depth-1 rewards are equal (std 0 -> advantage 0).
    rewards = torch.tensor([5.0, 1.0, 3.0, 0.0, 2.0, 2.0, 4.0, 7.0, 1.5, 1.5])
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 2, -1, 7, 7])
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 2, 0, 1, 1])
    out = tree_depthwise(rewards, parents, depths, eps=0.0)
    # unbiased stds: depth 1 sqrt(2); depth 2: deviations -2 0 0 2 -> sqrt(8 / 3)
    s1, s2 = math.sqrt(2), math.sqrt(8 / 3)
    expected = torch.tensor([0.0, -1 / s1, 1 / s1, -2 / s2, 0.0, 0.0, 2 / s2, 0.0, 0.0, 0.0])
    torch.testing.assert_close(out.values, expected)
    # the population-std variant gives each depth unit scale: +-1 at depth 1, +-sqrt(2) at depth 2
    population = tree_depthwise_population_std(rewards, parents, depths, eps=0.0).values
    r2 = math.sqrt(2)
    expected = torch.tensor([0.0, -1.0, 1.0, -2 / r2, 0.0, 0.0, 2 / r2, 0.0, 0.0, 0.0])
    torch.testing.assert_close(population, expected)


def test_tree_depthwise_equals_branchgrpos_code_on_uneven_and_pruned_trees():
    fused = mean_fused(UNEVEN_PARENTS, UNEVEN_LEAF_REWARDS)
    got = tree_depthwise(fused, UNEVEN_PARENTS, UNEVEN_DEPTHS).values
    torch.testing.assert_close(
        got, torch.tensor(branchgrpo_reference(fused, UNEVEN_PARENTS, UNEVEN_DEPTHS)), atol=1e-6, rtol=1e-6
    )
    torch.manual_seed(5)
    parents, depths, _ = binary_forest(6, 4)
    rewards = torch.rand(len(depths))
    torch.testing.assert_close(
        tree_depthwise(rewards, parents, depths).values,
        torch.tensor(branchgrpo_reference(rewards, parents, depths)),
        atol=1e-6,
        rtol=1e-6,
    )


def test_tree_depthwise_zero_mean_per_tree_depth_and_clip():
    torch.manual_seed(3)
    parents, depths, trees = binary_forest(20, 4)
    rewards = torch.rand(len(depths))
    values = tree_depthwise(rewards, parents, depths).values
    assert max(abs(m) for m in group_means(values, trees * 10 + depths)) < 1e-5
    # One outlier among 16 leaves: z = (15 / 16) / unbiased std (1/4) = 3.75; clip at 2 caps it.
    parents, depths, _ = binary_forest(1, 4)
    outlier = torch.zeros(len(depths))
    outlier[15] = 1.0  # the first leaf
    assert math.isclose(tree_depthwise(outlier, parents, depths).values[15].item(), 3.75, rel_tol=1e-5)
    assert tree_depthwise(outlier, parents, depths, clip=2.0).values[15].item() == 2.0


def tree_paths(parents: torch.Tensor) -> dict[int, str]:
    """Each leaf's path from its root as TreePO names a trajectory: node ids joined by '#'."""
    has_child = {int(p) for p in parents if int(p) >= 0}
    paths = {}
    for leaf in (i for i in range(len(parents)) if i not in has_child):
        chain, node = [], leaf
        while node >= 0:
            chain.append(str(node))
            node = int(parents[node])
        paths[leaf] = "#".join(reversed(chain))
    return paths


def treepo_reference(paths: dict[int, str], rewards: dict[int, float], weighting: str) -> dict[int, float]:
    """TreePO's tree_reinforce_plus_plus_baseline on one score per trajectory, written from its
    definition: for depth 0 .. max depth - 1, group the trajectories by the first depth + 1 parts of
    their path; a group of one has mean 0; every trajectory takes r - mean of its group at depth 0,
    and at a deeper depth when its group holds others too; the terms are averaged (or weighted by
    group size), then whitened over the batch with the unbiased variance plus 1e-8."""
    leaves = list(paths)
    terms: dict[int, list[tuple[float, int]]] = {leaf: [] for leaf in leaves}
    for depth in range(max(len(path.split("#")) - 1 for path in paths.values())):
        prefix = {leaf: "#".join(paths[leaf].split("#")[: depth + 1]) for leaf in leaves}
        groups: dict[str, list[int]] = {}
        for leaf in leaves:
            groups.setdefault(prefix[leaf], []).append(leaf)
        for leaf in leaves:
            members = groups[prefix[leaf]]
            mean = sum(rewards[m] for m in members) / len(members) if len(members) > 1 else 0.0
            if depth == 0 or len(members) > 1:
                terms[leaf].append((rewards[leaf] - mean, len(members)))
    if weighting == "average":
        scores = {leaf: sum(t for t, _ in terms[leaf]) / len(terms[leaf]) for leaf in leaves}
    else:
        scores = {
            leaf: sum(t * n for t, n in terms[leaf]) / sum(n for _, n in terms[leaf]) for leaf in leaves
        }
    values = torch.tensor([scores[leaf] for leaf in leaves], dtype=torch.float64)
    whitened = (values - values.mean()) * torch.rsqrt(values.var() + 1e-8)
    return dict(zip(leaves, whitened.tolist(), strict=True))


@pytest.mark.parametrize("weighting", ["average", "group_size"])
def test_treepo_equals_treepos_code_on_uneven_and_pruned_trees(weighting):
    paths = tree_paths(UNEVEN_PARENTS)
    expected = treepo_reference(paths, UNEVEN_LEAF_REWARDS, weighting)
    fused = mean_fused(UNEVEN_PARENTS, UNEVEN_LEAF_REWARDS)
    values = treepo(fused, UNEVEN_PARENTS, UNEVEN_DEPTHS, weighting=weighting).values.double()
    for leaf, value in expected.items():
        assert math.isclose(values[leaf].item(), value, rel_tol=1e-6, abs_tol=1e-7), leaf
    # an inner node gets the mean of its leaves' values: d (6) over 7, 8, 9; b (2) over 7, 8, 9, 10
    assert math.isclose(values[6].item(), sum(expected[i] for i in (7, 8, 9)) / 3, rel_tol=1e-6)
    assert math.isclose(values[2].item(), sum(expected[i] for i in (7, 8, 9, 10)) / 4, rel_tol=1e-6)
    # inner nodes' fused rewards are not read (another fusion, the same advantages)
    other_fusion = fused.clone()
    other_fusion[[1, 2, 6, 12]] = torch.tensor([9.0, -3.0, 4.0, 0.0])
    torch.testing.assert_close(
        treepo(other_fusion, UNEVEN_PARENTS, UNEVEN_DEPTHS, weighting=weighting).values, values.float()
    )


def test_treepo_hand_computed_leaf_advantages_before_whitening():
    # root 0 -> a (1) -> leaves 3 [1], 4 [0]; root -> leaf 2 [0.5]. Subgroups: root {3, 4, 2} mean 0.5;
    # a {3, 4} mean 0.5. Leaf 3: avg(1 - 0.5, 1 - 0.5) = 0.5; leaf 4: -0.5; leaf 2: 0.5 - 0.5 = 0.
    # Whitened with mean 0 and unbiased variance 0.25: 0.5 / sqrt(0.25 + 1e-8) = 1 (to 1e-7).
    parents, depths = torch.tensor([-1, 0, 0, 1, 1]), torch.tensor([0, 1, 1, 2, 2])
    rewards = torch.tensor([0.5, 0.5, 0.5, 1.0, 0.0])
    values = treepo(rewards, parents, depths).values
    torch.testing.assert_close(values, torch.tensor([0.0, 0.0, 0.0, 1.0, -1.0]), atol=1e-6, rtol=0)
    # a lone leaf under its root keeps its raw reward before whitening (TreePO's code: mean 0)
    lone = treepo(
        torch.tensor([0.2, 0.2, 0.6, 0.6]), torch.tensor([-1, 0, -1, 2]), torch.tensor([0, 1, 0, 1])
    )
    assert lone.values[1] < 0 < lone.values[3]
    assert treepo(torch.tensor([0.0, 1.0]), torch.tensor([-1, 0]), torch.tensor([0, 1])).values.tolist() == [
        0,
        0,
    ]


def test_tree_depthwise_nested_hand_computed():
    # root 0 -> a (1), b (2); a -> rows 3, 4; b -> rows 5, 6. Leaf rewards [1, 0] under a, [1, 1] under b.
    rewards = torch.tensor([0.75, 0.5, 1.0, 1.0, 0.0, 1.0, 1.0])
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 2])
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 2])
    out = tree_depthwise_nested(rewards, parents, depths, eps=0.0).values
    # depth 1: one level (the root's subgroup {a, b}): a = -1, b = +1.
    # leaf 3 (reward 1): level 0 subgroup = all 4 leaves (mean 0.75, std sqrt(3)/4) -> 0.25 / (sqrt(3)/4);
    # level 1 subgroup = {3, 4} (mean 0.5, std 0.5) -> 1; averaged over the two levels.
    z0 = 0.25 / (math.sqrt(3) / 4)
    expected = torch.tensor(
        [0.0, -1.0, 1.0, (z0 + 1.0) / 2, (-3 * z0 - 1.0) / 2, z0 / 2, z0 / 2]  # b's leaves tie at level 1
    )
    torch.testing.assert_close(out, expected)
    # level 0 alone is the population-std depth-wise form: on a depth-1 tree (a flat group) they agree
    flat_parents, flat_depths = torch.tensor([-1, 0, 0, 0]), torch.tensor([0, 1, 1, 1])
    flat_rewards = torch.tensor([0.0, 1.0, 0.0, 0.5])
    torch.testing.assert_close(
        tree_depthwise_nested(flat_rewards, flat_parents, flat_depths).values,
        tree_depthwise_population_std(flat_rewards, flat_parents, flat_depths).values,
    )


def test_tree_depthwise_nested_credits_the_late_decision_more_than_depthwise():
    # a's leaves [1, 0]: the late decision mattered; b's leaves [1, 1]: only the early one (b) did.
    # Depth-wise credit is the same for all three right answers; the nested form ranks a's right
    # answer above b's, whose credit already went to the edge into b.
    rewards = torch.tensor([0.75, 0.5, 1.0, 1.0, 0.0, 1.0, 1.0])
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 2])
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 2])
    depthwise = tree_depthwise_population_std(rewards, parents, depths).values
    nested = tree_depthwise_nested(rewards, parents, depths).values
    assert depthwise[3] == depthwise[5] == depthwise[6]
    assert nested[3] > depthwise[3] > nested[5] == nested[6] > 0
    assert nested[4] < 0 and depthwise[4] < 0


def test_every_advantage_and_loss_says_where_it_comes_from():
    from mmrl.registry import LOSSES

    for registry in (ADVANTAGES, LOSSES):
        for name in registry.names():
            assert registry.tag(name, "source"), f"{registry.kind} {name} has no source tag"
    variants = [n for n in ADVANTAGES.names() if ADVANTAGES.tag(n, "source").startswith("variant of ")]
    assert sorted(variants) == ["tree_depthwise_nested", "tree_depthwise_population_std"]
    for name in variants:  # a variant names the entry it varies
        assert ADVANTAGES.tag(name, "source").split()[2].rstrip(":") in ADVANTAGES.names()


def test_tree_value_hand_computed():
    # Tree 1: root 0 -> a (1), b (2); a -> leaves [1, 0], b -> leaves [1, 1] (mean fusion: a 0.5, b 1,
    # root 0.75; leaf std sqrt(3)/4). Tree 2 (rows 7-9): two equal leaves -> no spread, all 0.
    rewards = torch.tensor([0.75, 0.5, 1.0, 1.0, 0.0, 1.0, 1.0, 2.0, 2.0, 2.0])
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 2, -1, 7, 7])
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 2, 0, 1, 1])
    out = tree_value(rewards, parents, depths, eps=0.0).values
    s = math.sqrt(3) / 4
    expected = torch.tensor([0.0, -0.25 / s, 0.25 / s, 0.25 / s, -0.75 / s, 0.25 / s, 0.25 / s, 0, 0, 0])
    torch.testing.assert_close(out, expected)


def test_tree_value_is_grpo_on_a_flat_group_and_scales_shallow_credit_by_the_gap():
    flat_parents, flat_depths = torch.tensor([-1, 0, 0, 0, 0]), torch.tensor([0, 1, 1, 1, 1])
    leaves = torch.tensor([0.0, 1.0, 0.25, 0.5])
    flat_rewards = torch.cat([leaves.mean()[None], leaves])
    torch.testing.assert_close(
        tree_value(flat_rewards, flat_parents, flat_depths).values[1:],
        grpo(leaves, torch.zeros(4, dtype=torch.long)).values,
    )
    # Two subtrees whose leaves differ by 1 within each and whose means differ by 0.02: depth-wise
    # credit gives the two early edges +-1/sqrt(2) (unbiased std of two) whatever the gap; tree_value
    # gives them about +-0.02.
    rewards = torch.tensor([0.5, 0.49, 0.51, 0.99, -0.01, 1.01, 0.01])
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 2])
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 2])
    value = tree_value(rewards, parents, depths).values
    depthwise = tree_depthwise(rewards, parents, depths).values
    assert depthwise[:3].tolist() == pytest.approx([0.0, -(0.5**0.5), 0.5**0.5], rel=1e-3)
    assert -0.03 < value[1].item() < 0 < value[2].item() < 0.03  # the better subtree still ranks first
    assert value[3] > 0 > value[4] and value[5] > 0 > value[6]


def test_tree_estimators_refuse_a_parent_table_that_is_not_a_forest():
    rewards = torch.zeros(3)
    with pytest.raises(ValueError, match="parent's depth \\+ 1"):
        tree_depthwise(rewards, torch.tensor([-1, 0, 0]), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="row indices"):
        tree_depthwise_nested(rewards, torch.tensor([-1, 0, 5]), torch.tensor([0, 1, 1]))


def gae_reference(rewards, values, dones, gamma, lam):
    """Plain Python GAE over one trajectory (lists), the textbook recursion."""
    advantages, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        not_done = 1.0 - float(dones[t])
        delta = rewards[t] + gamma * values[t + 1] * not_done - values[t]
        running = delta + gamma * lam * not_done * running
        advantages[t] = running
    return advantages


def test_gae_matches_python_reference_with_dones_batched():
    torch.manual_seed(4)
    rewards, values = torch.randn(3, 12, dtype=torch.float64), torch.randn(3, 13, dtype=torch.float64)
    dones = torch.rand(3, 12) < 0.2
    dones[0, 5] = True
    out = gae(rewards, values, dones, gamma=0.9, lam=0.8)
    for b in range(3):
        ref = gae_reference(rewards[b].tolist(), values[b].tolist(), dones[b].tolist(), 0.9, 0.8)
        torch.testing.assert_close(out.values[b], torch.tensor(ref, dtype=torch.float64))
    torch.testing.assert_close(out.returns, out.values + values[:, :-1])
    single = gae(rewards[1], values[1], dones[1], gamma=0.9, lam=0.8)  # 1-D [T] input
    torch.testing.assert_close(single.values, out.values[1])


def test_gae_special_cases():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0])
    values = torch.tensor([0.5, 1.0, 1.5, 2.0, 10.0])
    dones = torch.tensor([False, True, False, False])
    gamma = 0.5
    # lam = 0: one-step TD residuals, equal to td1.
    deltas = torch.tensor([1 + 0.5 * 1.0 - 0.5, 2 + 0.0 - 1.0, 3 + 0.5 * 2.0 - 1.5, 4 + 0.5 * 10.0 - 2.0])
    torch.testing.assert_close(gae(rewards, values, dones, gamma=gamma, lam=0.0).values, deltas)
    one_step = td1(rewards, values, dones, gamma=gamma)
    torch.testing.assert_close(one_step.values, deltas)
    torch.testing.assert_close(one_step.returns, deltas + values[:-1])
    # lam = 1: discounted return (reset at the done, bootstrapped at the end) minus V_t.
    returns = torch.tensor([1 + 0.5 * 2, 2.0, 3 + 0.5 * (4 + 0.5 * 10), 4 + 0.5 * 10])
    full = gae(rewards, values, dones, gamma=gamma, lam=1.0)
    torch.testing.assert_close(full.values, returns - values[:-1])
    torch.testing.assert_close(full.returns, returns)


def test_gae_rejects_bad_shapes_and_nan():
    with pytest.raises(ValueError, match=r"values \[\.\.\., T\+1\]"):
        gae(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="values contain NaN"):
        td1(torch.zeros(4), torch.tensor([0.0, float("nan"), 0, 0, 0]), torch.zeros(4))


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_group_estimators_are_permutation_invariant(estimator):
    torch.manual_seed(5)
    ids = torch.arange(-20, 20).repeat_interleave(5) * 7919  # negative, non-contiguous labels
    rewards = torch.randn(200)  # continuous: no ties, so the mc_grpo pivot is unique
    perm = torch.randperm(200)
    out, permuted = estimator(rewards, ids), estimator(rewards[perm], ids[perm])
    torch.testing.assert_close(permuted.values, out.values[perm])
    assert torch.equal(permuted.loss_mask, out.loss_mask[perm])


@pytest.mark.parametrize("estimator", TREE_ESTIMATORS)
def test_tree_estimators_are_permutation_invariant(estimator):
    torch.manual_seed(6)
    parents, depths, _ = binary_forest(8, 3)
    rewards, perm = torch.rand(len(depths)), torch.randperm(len(depths))
    out = estimator(rewards, parents, depths).values
    new_row = torch.empty_like(perm).scatter_(0, perm, torch.arange(len(perm)))  # old row -> new row
    moved_parents = torch.where(parents[perm] >= 0, new_row[parents[perm].clamp(min=0)], -1)
    torch.testing.assert_close(estimator(rewards[perm], moved_parents, depths[perm]).values, out[perm])


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS + TREE_ESTIMATORS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_rewards_raise(estimator, bad):
    rewards = torch.tensor([1.0, bad, 0.0])
    kind = "NaN" if math.isnan(bad) else "inf"
    if estimator in TREE_ESTIMATORS:
        structure = (torch.tensor([-1, 0, 0]), torch.tensor([0, 1, 1]))  # a root and its two children
    else:
        structure = (torch.zeros(3, dtype=torch.long),)  # one group
    with pytest.raises(ValueError, match=f"rewards contain {kind} .*index 1"):
        estimator(rewards, *structure)


def test_integer_rewards_and_dtype_preserved():
    assert grpo(torch.tensor([1, 0, 1, 1]), torch.tensor([0, 0, 1, 1])).values.dtype == torch.float32
    bf16 = torch.tensor([1.0, 0.0, 0.5], dtype=torch.bfloat16)
    assert rloo(bf16, torch.zeros(3, dtype=torch.long)).values.dtype == torch.bfloat16


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="same length"):
        grpo(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="1-D integer tensors"):
        tree_depthwise(torch.zeros(3), torch.tensor([-1, 0, 0]), torch.zeros(3))
