"""The rollout tree: one structure for every rollout whose prefixes are shared.

A node holds a state (a latent, a token span, an observation); the edge parent -> node holds the
action taken and its old log-prob (a float, or a tensor of per-step log-probs when an edge spans
several denoising or decoding steps). Leaves hold rewards. A flat GRPO group is a tree of depth 1;
a BranchGRPO denoising tree and a multi-turn tool rollout branching at a tool decision are deeper.

Node ids are 0..N-1 in creation order (root = 0), so a parent's id is always below its children's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from mmrl.advantages import Advantages

FUSION_MODES = ("mean", "logprob_weighted")
WIDTH_PRUNE_MODES = ("top_half_per_branch", "best_worst_quarter")


@dataclass
class Node:
    node_id: int
    parent_id: int | None
    depth: int
    state: Any
    action: Any = None
    old_logp: Tensor | float | None = None  # of the edge parent -> this node
    children: list[int] = field(default_factory=list)
    reward: float | None = None  # set on leaves; fuse_rewards fills it everywhere

    @property
    def is_leaf(self) -> bool:
        return not self.children


class Edge(NamedTuple):
    """A trainable edge parent -> child; its depth is the child's depth."""

    parent: int
    child: int


class RolloutTree:
    def __init__(self, root_state: Any) -> None:
        self.nodes: list[Node] = [Node(node_id=0, parent_id=None, depth=0, state=root_state)]

    @classmethod
    def flat(
        cls,
        root_state: Any,
        leaf_states: Sequence[Any],
        rewards: Sequence[float] | None = None,
        old_logps: Sequence[Tensor | float] | None = None,
    ) -> RolloutTree:
        """A GRPO group: the prompt as root and one leaf per rollout."""
        tree = cls(root_state)
        for i, state in enumerate(leaf_states):
            leaf = tree.add_child(0, state, old_logp=None if old_logps is None else old_logps[i])
            if rewards is not None:
                tree.set_leaf_reward(leaf, rewards[i])
        return tree

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def depth(self) -> int:
        return max(node.depth for node in self.nodes)

    def add_child(
        self, parent_id: int, state: Any, action: Any = None, old_logp: Tensor | float | None = None
    ) -> int:
        parent = self.nodes[parent_id]
        child = Node(len(self.nodes), parent_id, parent.depth + 1, state, action, old_logp)
        self.nodes.append(child)
        parent.children.append(child.node_id)
        return child.node_id

    def leaves(self) -> list[int]:
        return [node.node_id for node in self.nodes if node.is_leaf]

    def leaf_counts(self) -> list[int]:
        """How many leaves lie below each node (1 for a leaf), by node id."""
        counts = [0] * len(self.nodes)
        for node in reversed(self.nodes):  # children come after their parent, so they are done first
            counts[node.node_id] = counts[node.node_id] or 1
            if node.parent_id is not None:
                counts[node.parent_id] += counts[node.node_id]
        return counts

    def set_leaf_reward(self, node_id: int, reward: float) -> None:
        if not self.nodes[node_id].is_leaf:
            raise ValueError(
                f"node {node_id} has children; rewards go on leaves, fuse_rewards fills the rest"
            )
        self.nodes[node_id].reward = float(reward)

    def path_to(self, node_id: int) -> list[Edge]:
        """The edges from the root down to `node_id`."""
        path = []
        node = self.nodes[node_id]
        while node.parent_id is not None:
            path.append(Edge(node.parent_id, node.node_id))
            node = self.nodes[node.parent_id]
        return path[::-1]

    def edges(self) -> list[Edge]:
        """Every edge, ordered by child id."""
        return [Edge(node.parent_id, node.node_id) for node in self.nodes[1:]]

    def fuse_rewards(self, mode: str = "mean") -> None:
        """Give every node a reward from its leaves' rewards (BranchGRPO reward fusion).

        mean: the mean reward of the node's leaves.
        logprob_weighted: the children's fused rewards weighted by a softmax over the children's edge
        log-probs (summed over steps for multi-step edges), applied from the leaves up.
        """
        if mode not in FUSION_MODES:
            raise ValueError(f"unknown fusion mode {mode!r}: choose one of {', '.join(FUSION_MODES)}")
        missing = [i for i in self.leaves() if self.nodes[i].reward is None]
        if missing:
            raise ValueError(f"leaves {missing} have no reward; call set_leaf_reward first")
        leaf_sum = [0.0] * len(self.nodes)
        leaf_count = self.leaf_counts()
        for node in reversed(self.nodes):  # children come after their parent, so they are done first
            if mode == "mean":
                if node.is_leaf:
                    leaf_sum[node.node_id] = node.reward
                else:
                    node.reward = leaf_sum[node.node_id] / leaf_count[node.node_id]
                if node.parent_id is not None:
                    leaf_sum[node.parent_id] += leaf_sum[node.node_id]
            elif not node.is_leaf:
                children = [self.nodes[i] for i in node.children]
                edge_logps = torch.tensor([_edge_logp(child) for child in children], dtype=torch.float64)
                weights = torch.softmax(edge_logps, dim=0).tolist()
                node.reward = float(sum(w * child.reward for w, child in zip(weights, children, strict=True)))

    def to_tensors(self) -> dict[str, Tensor]:
        """Per-node arrays in node-id order; parent of the root is -1, a missing reward is NaN."""
        return {
            "node_ids": torch.arange(len(self.nodes)),
            "parent_ids": torch.tensor([-1 if n.parent_id is None else n.parent_id for n in self.nodes]),
            "depths": torch.tensor([n.depth for n in self.nodes]),
            "rewards": torch.tensor([torch.nan if n.reward is None else n.reward for n in self.nodes]),
        }


def _edge_logp(node: Node) -> float:
    if node.old_logp is None:
        raise ValueError(f"edge into node {node.node_id} has no old_logp; logprob_weighted fusion needs one")
    if isinstance(node.old_logp, Tensor):
        return float(node.old_logp.sum())
    return float(node.old_logp)


def batch_trees(trees: Sequence[RolloutTree]) -> dict[str, Tensor]:
    """Concatenate `to_tensors()` of several trees, adding `tree_ids` and `parents`.

    Rows are ordered by tree, then node id, so tree t's node i is row `offset_t + i`; node and parent
    ids stay local to their tree, while `parents` holds each node's parent row in the batch (-1 for a
    root): the layout tree advantage estimators take.
    """
    parts = [tree.to_tensors() for tree in trees]
    batch = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
    batch["tree_ids"] = torch.cat([torch.full((len(tree),), t) for t, tree in enumerate(trees)])
    offsets = torch.tensor([0, *itertools.accumulate(len(tree) for tree in trees)])[:-1]
    batch["parents"] = torch.where(
        batch["parent_ids"] >= 0, batch["parent_ids"] + offsets[batch["tree_ids"]], -1
    )
    return batch


def depth_prune(
    tree: RolloutTree, depths_to_drop: Iterable[int], edges: Iterable[Edge] | None = None
) -> list[Edge]:
    """BranchGRPO depth pruning: drop the edges into nodes at the given depths from training.

    Prunes `edges` (default: all of the tree's), e.g. the result of `width_prune`, keeping their order.
    """
    drop = set(depths_to_drop)
    edges = tree.edges() if edges is None else edges
    return [edge for edge in edges if tree.nodes[edge.child].depth not in drop]


def width_prune(
    tree: RolloutTree, advantages: Tensor | Sequence[float], mode: str = "top_half_per_branch"
) -> list[Edge]:
    """BranchGRPO width pruning of the edges into leaves (after the last split); other edges stay.

    top_half_per_branch: per parent, the better half of its leaf children by advantage (at least one).
    best_worst_quarter: the best and the worst quarter of all leaves by advantage (at least one each).
    `advantages` is indexed by node id. Returns the kept edges in `tree.edges()` order; pass them
    to `depth_prune` to prune both ways.
    """
    if mode not in WIDTH_PRUNE_MODES:
        raise ValueError(f"unknown width-prune mode {mode!r}: choose one of {', '.join(WIDTH_PRUNE_MODES)}")
    advantages = torch.as_tensor(advantages, dtype=torch.float64)

    def best_first(node_ids: list[int]) -> list[int]:
        order = torch.argsort(advantages[node_ids], descending=True, stable=True)
        return [node_ids[i] for i in order.tolist()]

    kept_leaves: set[int] = set()
    if mode == "top_half_per_branch":
        for node in tree.nodes:
            leaf_children = [i for i in node.children if tree.nodes[i].is_leaf]
            if leaf_children:
                kept_leaves.update(best_first(leaf_children)[: max(1, len(leaf_children) // 2)])
    else:
        ranked = best_first(tree.leaves())
        quarter = max(1, len(ranked) // 4)
        kept_leaves.update(ranked[:quarter] + ranked[-quarter:])
    return [edge for edge in tree.edges() if not tree.nodes[edge.child].is_leaf or edge.child in kept_leaves]


def fused_node_advantages(
    trees: Sequence[RolloutTree],
    estimator: Callable[..., Advantages],
    fusion: str = "mean",
    **options: Any,
) -> dict[tuple[int, int], float]:
    """Node credit from any tree advantage estimator (an `ADVANTAGES` entry of kind "tree", called as
    estimator(node_rewards, parents, depths, **options)): fuse leaf rewards up each tree, score every
    node, and zero the nodes outside the estimator's loss mask. Returns A(node) for every non-root
    node, keyed by (tree index, node id)."""
    for tree in trees:
        tree.fuse_rewards(fusion)
    batch = batch_trees(trees)
    result = estimator(batch["rewards"], batch["parents"], batch["depths"], **options)
    values = result.values * result.loss_mask
    return {
        (int(t), int(n)): float(a)
        for t, n, a in zip(batch["tree_ids"], batch["node_ids"], values, strict=True)
        if int(n) != 0
    }


def branch_children(branching: Sequence[int], depth: int, quota: int) -> int:
    """How many children a node at `depth` splits into at a branch point: branching[depth] (1 past the
    end of the list), at most one per leaf slot it owns (`quota`)."""
    return min(branching[depth] if depth < len(branching) else 1, quota)


def split_slots(slots: range, children: int) -> list[range]:
    """A node's leaf slots shared out to `children` children, in order and as evenly as possible (the
    first `len(slots) % children` get one more).

    The leaf quota of a branched group: the root owns the slots [0, G), every node a contiguous range
    of its parent's, and a branch that ends with more than one slot keeps the first for its leaf and
    hands the rest back to its parent as a new child (a fresh continuation from the parent's state),
    so a group ends with exactly G leaves however its branches end."""
    if not 1 <= children <= len(slots):
        raise ValueError(f"cannot share {len(slots)} leaf slots out to {children} children")
    sizes = [len(slots) // children + (k < len(slots) % children) for k in range(children)]
    ends = list(itertools.accumulate(sizes, initial=slots.start))
    return [range(start, end) for start, end in itertools.pairwise(ends)]
