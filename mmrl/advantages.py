"""Advantage estimators: pure functions from rewards (and values) to per-sample advantages.

Every estimator is registered in `ADVANTAGES` and returns the same `Advantages` tuple, so a trainer
can switch estimators from its config without changing the loss code:

    adv = ADVANTAGES.get(cfg.advantage)(rewards=rewards, group_ids=prompt_ids)
    loss = (per_sample_loss * adv.values)[adv.loss_mask].mean()

Group-based estimators take 1-D `rewards` and `group_ids` of the same length. Group ids are any
int64 labels (not necessarily contiguous or sorted); all statistics are segment reductions over
`torch.unique(..., return_inverse=True)`, vectorised over the whole batch (no loop over groups).
Statistics are accumulated in float64 and the result is cast back to the rewards' dtype (float32
for integer or bool rewards). Rewards containing NaN or inf raise ValueError: a non-finite reward
would silently poison every advantage of its group.

An estimator that carries a paper's name computes what that paper's code computes, its standard
deviation (population or unbiased) and eps included; a deliberate variant has a name of its own
and says how it differs. Each entry's `source` tag says which it is (`mmrl list` shows it). The
group estimators use population standard deviations, as Flow-GRPO's and DiffusionNFT's code do
(verl and TRL use the unbiased one, larger by sqrt(G / (G - 1))); BranchGRPO's depth-wise
advantage uses the unbiased one, as its code does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from mmrl.config import ConfigError
from mmrl.registry import ADVANTAGES

# A (tree, depth) whose fused rewards spread less than this carries no ranking signal (BranchGRPO).
DEGENERATE_STD = 1e-6


class Advantages(NamedTuple):
    """What every estimator returns.

    values: per-sample advantages, shaped like the rewards.
    loss_mask: bool, False for samples that must stay out of the policy loss (the `mc_grpo` pivots).
    returns: value-function targets, only from the value-based estimators (`gae`, `td1`).
    """

    values: Tensor
    loss_mask: Tensor
    returns: Tensor | None = None


def check_group_size(name: str, group_size: int, key: str) -> None:
    """Refuse, at config time, a group size the estimator `name` cannot use (its ``group_size`` tag:
    mc_grpo needs G + 1 rollouts, an odd number, so that the median is one of them); `key` is the
    config key that sets the size."""
    if ADVANTAGES.tag(name, "group_size") == "odd" and group_size % 2 == 0:
        raise ConfigError(
            f"config error: {name} needs an odd number of rollouts per group (G + 1), but {key} = "
            f"{group_size}: use {group_size + 1} or {group_size - 1}"
        )


def _as_float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.float()


def _check_finite(name: str, x: Tensor) -> None:
    """Raise ValueError naming `name` when x holds NaN or inf."""
    bad = ~torch.isfinite(x)
    if bad.any():
        kind = "NaN" if torch.isnan(x).any() else "inf"
        first = int(bad.flatten().nonzero()[0])
        raise ValueError(f"{name} contain {kind} (first non-finite value at flat index {first})")


def _segments(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Check 1-D matching inputs; return (distinct group ids, segment index per sample, segment sizes)."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group ids must be 1-D of the same length, got shapes "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point():
        raise ValueError(f"group ids must be integers, got dtype {group_ids.dtype}")
    _check_finite("rewards", rewards)
    labels, segment = torch.unique(group_ids, return_inverse=True)
    sizes = torch.bincount(segment, minlength=len(labels))
    return labels, segment, sizes


def _segment_sum(x: Tensor, segment: Tensor, n_segments: int) -> Tensor:
    return x.new_zeros(n_segments).index_add_(0, segment, x)


def _segment_mean_std(x: Tensor, segment: Tensor, sizes: Tensor) -> tuple[Tensor, Tensor]:
    """Per-segment mean and population std of float64 x (two passes, so no cancellation)."""
    mean = _segment_sum(x, segment, len(sizes)) / sizes
    var = _segment_sum((x - mean[segment]) ** 2, segment, len(sizes)) / sizes
    return mean, var.sqrt()


def _keep_all(x: Tensor) -> Tensor:
    return torch.ones_like(x, dtype=torch.bool)


@ADVANTAGES.register("grpo", kind="group", source="GRPO, population std")
def grpo(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Advantages:
    """GRPO: A_i = (r_i - mean_g) / (std_g + eps) within each group g (population std).

    A group of one, or a group whose rewards are all equal, gets 0 (exactly, for float32 rewards:
    the float64 mean of equal float32 values is exact).
    """
    rewards = _as_float(rewards)
    _, segment, sizes = _segments(rewards, group_ids)
    r = rewards.double()
    mean, std = _segment_mean_std(r, segment, sizes)
    values = (r - mean[segment]) / (std[segment] + eps)
    return Advantages(values.to(rewards.dtype), _keep_all(rewards))


@ADVANTAGES.register("grpo_global_std", kind="group", source="Flow-GRPO's and DiffusionNFT's code")
def grpo_global_std(rewards: Tensor, group_ids: Tensor, eps: float = 1e-4) -> Advantages:
    """Flow-GRPO: A_i = (r_i - mean_g) / (std_batch + eps), with the population std of all rewards
    of the batch (numpy's std) and eps 1e-4, as Flow-GRPO's and DiffusionNFT's per-prompt stat
    trackers compute it, so groups with a small spread are not blown up to unit scale."""
    rewards = _as_float(rewards)
    _, segment, sizes = _segments(rewards, group_ids)
    r = rewards.double()
    mean = _segment_sum(r, segment, len(sizes)) / sizes
    values = (r - mean[segment]) / (r.std(unbiased=False) + eps)
    return Advantages(values.to(rewards.dtype), _keep_all(rewards))


@ADVANTAGES.register("rloo", kind="group", source="RLOO")
def rloo(rewards: Tensor, group_ids: Tensor) -> Advantages:
    """RLOO: A_i = r_i - mean_{j != i} r_j = (n r_i - sum_g) / (n - 1) within each group of size n.

    Advantages sum to 0 within each group; a group of one gets 0. No std normalisation.
    """
    rewards = _as_float(rewards)
    _, segment, sizes = _segments(rewards, group_ids)
    r = rewards.double()
    total = _segment_sum(r, segment, len(sizes))
    n = sizes[segment].double()
    values = (n * r - total[segment]) / (n - 1).clamp(min=1)
    return Advantages(values.to(rewards.dtype), _keep_all(rewards))


def _sortable_int64(x: Tensor) -> Tensor:
    """int64 keys ordered like the float values of x (IEEE bits; negatives get magnitude bits flipped).

    Integer sorts are radix sorts on CPU, faster than float sorts.
    """
    bits = x.double().view(torch.int64)
    return bits ^ ((bits >> 63) & torch.iinfo(torch.int64).max)


@ADVANTAGES.register("mc_grpo", kind="group", group_size="odd", source="MC-GRPO")
def mc_grpo(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Advantages:
    """MC-GRPO: median baseline over G+1 rollouts, A_i = (r_i - median_g) / (std_g + eps).

    std_g is the population std of all G+1 rewards of the group (the GRPO scale, so only the
    baseline changes). G+1 is odd, so the median is the reward of one rollout, the pivot: its
    advantage is 0 and `loss_mask` drops it, which keeps G gradient-contributing rollouts per group.
    When several rollouts tie at the median the lowest batch index is the pivot. Raises ValueError
    unless every group has an odd size.
    """
    rewards = _as_float(rewards)
    labels, segment, sizes = _segments(rewards, group_ids)
    even = sizes % 2 == 0
    if even.any():
        first = int(even.nonzero()[0])
        raise ValueError(
            f"mc_grpo needs an odd number (G+1) of rollouts per group; group id {int(labels[first])} "
            f"has {int(sizes[first])} ({int(even.sum())} of {len(sizes)} groups are even)"
        )
    # Sort by (group, reward): a stable sort by group after a sort by reward.
    by_reward = torch.argsort(_sortable_int64(rewards), stable=True)
    order = by_reward[torch.argsort(segment[by_reward], stable=True)]
    sorted_segment = segment[order]
    starts = torch.cumsum(sizes, 0) - sizes
    rank_in_group = torch.arange(len(order), device=order.device) - starts[sorted_segment]
    at_median = rank_in_group == (sizes[sorted_segment] - 1) // 2
    median = rewards.new_zeros(len(sizes), dtype=torch.float64)
    median[sorted_segment[at_median]] = rewards[order[at_median]].double()

    r = rewards.double()
    _, std = _segment_mean_std(r, segment, sizes)
    values = (r - median[segment]) / (std[segment] + eps)

    index = torch.arange(len(r), device=r.device)
    ties_median = r == median[segment]
    pivot = torch.full_like(sizes, len(r)).scatter_reduce_(
        0, segment[ties_median], index[ties_median], reduce="amin"
    )
    loss_mask = _keep_all(rewards)
    loss_mask[pivot] = False
    return Advantages(values.to(rewards.dtype), loss_mask)


def _ancestors(parents: Tensor, depths: Tensor) -> Tensor:
    """[N, D+1] long: row of each node's ancestor at every depth up to its own (itself at its depth),
    -1 below it. Checks that `parents` and `depths` describe a forest."""
    n = len(depths)
    if not parents.shape == depths.shape or depths.dim() != 1 or depths.is_floating_point():
        raise ValueError(
            f"parents and depths must be 1-D integer tensors shaped like the node rewards, got "
            f"{parents.dtype} {tuple(parents.shape)} and {depths.dtype} {tuple(depths.shape)}"
        )
    parents, depths = parents.long(), depths.long()
    if n and (int(parents.min()) < -1 or int(parents.max()) >= n):
        raise ValueError(f"parents must be row indices in [0, {n}) or -1 for a root")
    has_parent = parents >= 0
    parent_depth = depths[parents.clamp(min=0)]
    if bool((depths[~has_parent] != 0).any()) or bool(
        (parent_depth[has_parent] != depths[has_parent] - 1).any()
    ):
        raise ValueError("a root (parent -1) must have depth 0 and every other node its parent's depth + 1")
    table = torch.full((n, int(depths.max()) + 1 if n else 1), -1, dtype=torch.long, device=depths.device)
    rows = torch.arange(n, device=depths.device)
    current = rows
    for _ in range(table.shape[1]):
        alive = current >= 0
        table[rows[alive], depths[current[alive]]] = current[alive]
        current = torch.where(alive, parents[current.clamp(min=0)], current)
    return table


def _normalised_within(r: Tensor, keys: Tensor, eps: float, unbiased: bool) -> tuple[Tensor, Tensor]:
    """(r - mean) / (std + eps) within each key's nodes (the unbiased or the population std), 0 for a
    key of one node or whose nodes spread less than DEGENERATE_STD; and each node's count of nodes
    sharing its key."""
    _, segment, sizes = _segments(r, keys)
    mean, std = _segment_mean_std(r, segment, sizes)
    if unbiased:
        std = std * (sizes / (sizes - 1).clamp(min=1)).sqrt()
    std, n = std[segment], sizes[segment]
    values = (r - mean[segment]) / (std + eps)
    return values.masked_fill((std < DEGENERATE_STD) | (n < 2), 0.0), n


def _depthwise(
    node_rewards: Tensor, parents: Tensor, depths: Tensor, eps: float, clip: float | None, unbiased: bool
) -> Advantages:
    """Every node's reward normalised over the nodes at its depth of its tree (one key per (tree,
    depth)), with the unbiased or the population standard deviation, clipped to [-clip, clip]."""
    node_rewards = _as_float(node_rewards)
    ancestors = _ancestors(parents, depths)
    by_tree_depth = ancestors[:, 0] * ancestors.shape[1] + depths
    values, _ = _normalised_within(node_rewards.double(), by_tree_depth, eps, unbiased)
    if clip is not None:
        values = values.clamp(-clip, clip)
    return Advantages(values.to(node_rewards.dtype), _keep_all(node_rewards))


@ADVANTAGES.register("tree_depthwise", kind="tree", source="BranchGRPO's code")
def tree_depthwise(
    node_rewards: Tensor, parents: Tensor, depths: Tensor, eps: float = 1e-8, clip: float | None = 5.0
) -> Advantages:
    """BranchGRPO's depth-wise advantage: A(n) = (R(n) - mean_d) / (std_d + eps) over the nodes at the
    same depth d of the same tree, std_d the unbiased standard deviation (torch.std), clipped to
    [-clip, clip] (None: no clip), as BranchGRPO's code computes it.

    `parents[i]` is the row of node i's parent (-1 for a root), `depths[i]` its depth (roots 0). A
    (tree, depth) with one node or with std < DEGENERATE_STD gets 0. The edge parent -> child is
    trained with A(child). The unbiased std is sqrt(n / (n - 1)) times the population one, so a depth
    of few nodes gets smaller advantages than a wide one (x0.71 at two nodes, x0.96 at twelve):
    `tree_depthwise_population_std` gives every depth unit scale instead.
    """
    return _depthwise(node_rewards, parents, depths, eps, clip, unbiased=True)


@ADVANTAGES.register(
    "tree_depthwise_population_std", kind="tree", source="variant of tree_depthwise: population std"
)
def tree_depthwise_population_std(
    node_rewards: Tensor, parents: Tensor, depths: Tensor, eps: float = 1e-6, clip: float | None = 5.0
) -> Advantages:
    """`tree_depthwise` with the population standard deviation (and eps 1e-6): every (tree, depth)
    with a spread gets advantages of mean 0 and std 1 up to eps, whatever its number of nodes, where
    BranchGRPO's unbiased std scales a depth of n nodes by sqrt((n - 1) / n) and so weighs shallow,
    narrow depths less. Otherwise as `tree_depthwise`."""
    return _depthwise(node_rewards, parents, depths, eps, clip, unbiased=False)


@ADVANTAGES.register("treepo", kind="tree", source="TreePO's code (tree_reinforce_plus_plus_baseline)")
def treepo(
    node_rewards: Tensor,
    parents: Tensor,
    depths: Tensor,
    weighting: str = "average",
    clip: float | None = None,
) -> Advantages:
    """TreePO's segment-level advantage (its `tree_reinforce_plus_plus_baseline`), from the leaves'
    rewards alone (inner nodes' fused rewards are not read, so the fusion mode does not matter).

    For a leaf l at depth D, each ancestor a at depth 0..D-1 defines a subgroup, the leaves below a,
    with mean reward m(a); the subgroups of one leaf (the root's always, a deeper one only when it
    holds more than that leaf) give the terms R(l) - m(a), which are averaged (`weighting="average"`,
    TreePO's recipe) or weighted by the subgroups' sizes (`"group_size"`, its code's default). The
    leaves' values are then whitened once over the whole batch: (x - mean) / sqrt(var + 1e-8) with
    the unbiased variance over the leaves (verl's masked_whiten, each leaf counted once where TreePO
    counts it once per response token). A root with a single leaf uses subgroup mean 0 (TreePO's
    code), so that leaf keeps its raw reward before whitening; a batch of one leaf gets 0. A chain of
    nodes that do not branch adds one subgroup per node, as a TreePO segment does.

    An inner node gets the mean of its leaves' values: TreePO trains a shared segment once per leaf
    below it with that leaf's advantage, whose mean this is; node credit trains the segment once with
    it (weight 1, where TreePO's token sum weighs it by its leaf count). `clip` (None: none, as in
    TreePO's code) clips the whitened values, for trainers that clip every tree advantage.
    """
    if weighting not in ("average", "group_size"):
        raise ValueError(f"treepo: weighting must be 'average' or 'group_size', got {weighting!r}")
    node_rewards = _as_float(node_rewards)
    _check_finite("rewards", node_rewards)
    ancestors = _ancestors(parents, depths)
    r, n = node_rewards.double(), len(node_rewards)
    is_leaf = torch.ones(n, dtype=torch.bool, device=r.device)
    is_leaf[parents[parents >= 0].long()] = False
    leaves = is_leaf.nonzero().flatten()
    levels = ancestors.shape[1]
    # leaves and leaf-reward sums below every node, from each leaf's row of ancestors
    below = ancestors[leaves]  # [L, D+1], -1 past a leaf's own depth
    valid = below >= 0
    count = torch.zeros(n, dtype=torch.float64, device=r.device).index_add_(
        0, below[valid], torch.ones(int(valid.sum()), dtype=torch.float64, device=r.device)
    )
    total = torch.zeros(n, dtype=torch.float64, device=r.device).index_add_(
        0, below[valid], r[leaves].unsqueeze(1).expand_as(below)[valid]
    )
    leaf_depth = depths[leaves].long()
    level = torch.arange(levels, device=r.device).expand_as(below)
    ancestor = below.clamp(min=0)
    size = count[ancestor]
    # a leaf's subgroups: its ancestors strictly above it; the root's always, a deeper one if shared
    counted = (level < leaf_depth.unsqueeze(1)) & ((level == 0) | (size > 1))
    mean = torch.where(size > 1, total[ancestor] / size.clamp(min=1), 0.0)
    weight = counted.double() * (size if weighting == "group_size" else 1.0)
    terms = (r[leaves].unsqueeze(1) - mean) * weight
    leaf_values = terms.sum(1) / weight.sum(1).clamp(min=1e-300)
    values = torch.zeros(n, dtype=torch.float64, device=r.device)
    if len(leaves) > 1:
        centre, spread = leaf_values.mean(), leaf_values.var(unbiased=True)
        leaf_values = (leaf_values - centre) * torch.rsqrt(spread + 1e-8)
        sums = torch.zeros(n, dtype=torch.float64, device=r.device).index_add_(
            0, below[valid], leaf_values.unsqueeze(1).expand_as(below)[valid]
        )
        values = sums / count.clamp(min=1)
    if clip is not None:
        values = values.clamp(-clip, clip)
    return Advantages(values.to(node_rewards.dtype), _keep_all(node_rewards))


@ADVANTAGES.register(
    "tree_depthwise_nested", kind="tree", source="variant of treepo: subgroups by depth, normalised"
)
def tree_depthwise_nested(
    node_rewards: Tensor, parents: Tensor, depths: Tensor, eps: float = 1e-6, clip: float | None = 5.0
) -> Advantages:
    """The depth-wise normalisation repeated inside every ancestor's subtree and averaged: node n at
    depth d is normalised within each subgroup it belongs to (the nodes at depth d below one of its
    ancestors, population std), averaged over the ancestors' levels 0..d-1:

        A(n) = mean over levels l with a subgroup of >= 2 nodes of (R(n) - mean_l) / (std_l + eps)

    Level 0 alone is `tree_depthwise_population_std`; deeper levels compare a node with its closer
    relatives (siblings that share more of its prefix), so credit for a late decision is not swamped
    by an early one. It differs from TreePO's estimator (`treepo`) in three ways: each subgroup term
    is divided by that subgroup's std (TreePO subtracts means only and whitens once over the batch),
    a subgroup holds the nodes at the node's own depth (TreePO's, all leaves below the ancestor,
    which differ on trees whose leaves lie at several depths), and every node is scored from the
    fused rewards (TreePO scores leaves). A subgroup spreading less than DEGENERATE_STD contributes 0;
    a node in no subgroup of two gets 0. Clipped to [-clip, clip] (None: no clip)."""
    node_rewards = _as_float(node_rewards)
    ancestors = _ancestors(parents, depths)
    r = node_rewards.double()
    total, levels = torch.zeros_like(r), torch.zeros_like(r)
    for level in range(ancestors.shape[1] - 1):
        below = depths > level
        if not bool(below.any()):
            break
        keys = torch.where(
            below, ancestors[:, level] * ancestors.shape[1] + depths, -1 - torch.arange(len(r))
        )
        values, sizes = _normalised_within(r, keys, eps, False)
        counted = below & (sizes >= 2)
        total += torch.where(counted, values, 0.0)
        levels += counted.double()
    values = torch.where(levels > 0, total / levels.clamp(min=1), 0.0)
    if clip is not None:
        values = values.clamp(-clip, clip)
    return Advantages(values.to(node_rewards.dtype), _keep_all(node_rewards))


@ADVANTAGES.register("tree_value", kind="tree", source="ours: TreeRL's global term, GRPO's scale")
def tree_value(
    node_rewards: Tensor, parents: Tensor, depths: Tensor, eps: float = 1e-6, clip: float | None = 5.0
) -> Advantages:
    """A node's fused reward against its tree's root, on the scale of the tree's leaves (the global
    term of TreeRL's advantage, normalised like GRPO; TreeRL's own estimator adds a local term, the
    node against its parent, and divides by the square root of the node's leaf count):

        A(n) = (R(n) - R(root)) / (std of the tree's leaf rewards + eps)

    With mean fusion R(n) is the mean reward of the leaves below n, so on a tree of depth 1 this is
    `grpo`, and an early split whose subtrees score alike gets a small advantage. `tree_depthwise`
    gives two siblings +-1 whatever their gap, so at a shallow split the leaves' noise sets the
    credit at full strength. A tree whose leaves spread less than DEGENERATE_STD gets 0. Clipped to
    [-clip, clip] (None: no clip)."""
    node_rewards = _as_float(node_rewards)
    _check_finite("rewards", node_rewards)
    ancestors = _ancestors(parents, depths)
    r = node_rewards.double()
    tree = ancestors[:, 0].contiguous()  # the row of each node's root
    is_leaf = torch.ones_like(r, dtype=torch.bool)
    is_leaf[parents[parents >= 0].long()] = False
    roots, segment, sizes = _segments(r[is_leaf], tree[is_leaf])
    _, leaf_std = _segment_mean_std(r[is_leaf], segment, sizes)
    std = leaf_std[torch.searchsorted(roots, tree)]
    values = ((r - r[tree]) / (std + eps)).masked_fill(std < DEGENERATE_STD, 0.0)
    if clip is not None:
        values = values.clamp(-clip, clip)
    return Advantages(values.to(node_rewards.dtype), _keep_all(node_rewards))


def _td_residuals(
    rewards: Tensor, values: Tensor, dones: Tensor, gamma: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Check shapes; return (delta_t, one-step target r_t + gamma (1 - d_t) V_{t+1}, 1 - d_t)."""
    if values.shape != (*rewards.shape[:-1], rewards.shape[-1] + 1) or dones.shape != rewards.shape:
        raise ValueError(
            f"need rewards [..., T], values [..., T+1] (last one the bootstrap V(s_T)) and dones [..., T]; "
            f"got {tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(dones.shape)}"
        )
    _check_finite("rewards", rewards)
    _check_finite("values", values)
    not_done = 1.0 - dones.to(rewards.dtype)
    target = rewards + gamma * not_done * values[..., 1:]
    return target - values[..., :-1], target, not_done


@ADVANTAGES.register("gae", kind="temporal", source="GAE")
def gae(rewards: Tensor, values: Tensor, dones: Tensor, gamma: float = 0.99, lam: float = 0.95) -> Advantages:
    """Generalised advantage estimation over the last (time) axis, vectorised over leading axes.

    delta_t = r_t + gamma (1 - d_t) V_{t+1} - V_t;  A_t = delta_t + gamma lam (1 - d_t) A_{t+1};
    returns_t = A_t + V_t. rewards and dones are [..., T]; values are [..., T+1], the last column
    being the bootstrap value of the state after the segment. d_t = 1 means the episode terminated
    after step t: nothing flows back across it (time-limit truncation needs its own bootstrap).
    lam = 0 gives the one-step TD residuals (`td1`), lam = 1 the discounted returns minus V_t.
    """
    rewards = _as_float(rewards)
    values = values.to(rewards.dtype)
    deltas, _, not_done = _td_residuals(rewards, values, dones, gamma)
    decay = gamma * lam * not_done
    deltas_by_time, decay_by_time = deltas.movedim(-1, 0).contiguous(), decay.movedim(-1, 0).contiguous()
    advantages = torch.empty_like(deltas_by_time)
    running = torch.zeros_like(deltas_by_time[0])
    for t in reversed(range(len(deltas_by_time))):
        running = deltas_by_time[t] + decay_by_time[t] * running
        advantages[t] = running
    advantages = advantages.movedim(0, -1).contiguous()
    return Advantages(advantages, _keep_all(rewards), returns=advantages + values[..., :-1])


@ADVANTAGES.register("td1", kind="temporal", source="TD(0)")
def td1(rewards: Tensor, values: Tensor, dones: Tensor, gamma: float = 0.99) -> Advantages:
    """One-step TD advantage A_t = r_t + gamma (1 - d_t) V_{t+1} - V_t (GAE with lam = 0), same
    shapes as `gae`; returns are the one-step targets."""
    rewards = _as_float(rewards)
    values = values.to(rewards.dtype)
    deltas, target, _ = _td_residuals(rewards, values, dones, gamma)
    return Advantages(deltas, _keep_all(rewards), returns=target)
