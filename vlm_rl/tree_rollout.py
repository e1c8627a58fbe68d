"""Tree rollouts (TreePO-style): a question's group of conversations is a tree whose branches continue
from their shared prefix, so the prompt and the early turns are generated (and prefilled) once.

One `mmrl.tree.RolloutTree` per question. The root is the prompt (image + question); every other node is
one *segment*: a contiguous run of sampled tokens, with the tool's observation when the segment ends a
turn with a tool call. A node holds a `TreeSegment` (the conversation up to its end, where its own tokens
start, the leaf slots it owns); the edge into it holds the segment's sampled-token log-probs.

Leaf quota. Every node owns a contiguous range of the question's G leaf slots (the root all of them).
Branch points are the end of every turn (after the tool's result) and, with `segment_tokens > 0`, every
`segment_tokens` tokens inside a turn. At a branch point a live node at depth d splits into
c = min(branching[d], quota) children (branching[d] = 1 past the list), its slots shared out as evenly
as possible in order; with c = 1 it just goes on (a chain of single-child segments is one node). The
root splits before the first token. A node whose conversation ends becomes the leaf of its first slot
and hands the others back to its parent as a new child (a fresh sample from the parent's state), so
every question ends with exactly G leaves and a flat group is ``branching: [G]``.

Keys. A node's generation call is keyed NoiseKey(seed, step, s * G + first slot, n), n the number of
generation calls along its path before this one: with ``branching: [G]`` and ``segment_tokens: 0`` that
is `rollout`'s key for conversation j's turn n, so a flat group samples the very same tokens.

Every wave sends all live nodes of all questions to one `generate_turn` call; siblings that have not
generated yet hold their parent's sequence and share a prefix group, so it is prefilled once.

Turns are taken and closed, and conversations end, exactly as in `rollout` (`call_limit`,
`take_generated`: answer, max_turns, max_images, max_tokens, truncated; each row within its own limits).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from mmrl.noise import NoiseKey
from mmrl.tree import RolloutTree, branch_children, split_slots
from vlm_rl.data import Question
from vlm_rl.models import VLMAdapter
from vlm_rl.rollout import (
    ToolRolloutConfig,
    Trajectory,
    TurnGenerator,
    call_limit,
    prompt_segment,
    take_generated,
)
from vlm_rl.tools import CropSettings, ImageStore, ToolStats


@dataclass
class TreeSegment:
    """A tree node's state: the conversation from the root to the node's end, and where its own tokens
    (sampled, then any observation) begin in it. Frozen once the node splits or ends; children fork it."""

    trajectory: Trajectory  # its `calls` count the generation calls along the path, this node's included
    start: int
    slots: range  # the leaf slots this node owns
    log_probs: list[float] = field(default_factory=list)  # of this node's sampled tokens
    fresh: bool = True  # nothing generated yet: the sequence is still the parent's

    @property
    def span(self) -> tuple[int, int]:
        return self.start, len(self.trajectory.sequence)


@dataclass
class TreeRollout:
    """What `tree_rollout` returns. Leaves are question-major: leaf slot j of question i is
    `leaves[i * group_size + j]`, so rewards, group ids and metrics line up as for a flat rollout."""

    trees: list[RolloutTree]
    group_size: int
    leaves: list[Trajectory]
    leaf_nodes: list[int]  # the tree node each leaf ends in
    token_nodes: list[list[int]]  # per leaf: the node each token belongs to (0, the root, for the prompt)
    prefill_tokens: int  # tokens the generation calls prefilled (shared prefixes once, no padding)
    decoded_tokens: int  # tokens sampled into the tree (each shared segment once)
    branch_points: int  # splits into two or more children, over all trees

    def set_leaf_rewards(self, rewards: Sequence[float] | Tensor) -> None:
        """Put the leaves' rewards (in `leaves` order) on the trees."""
        for k, reward in enumerate(torch.as_tensor(rewards).tolist()):
            self.trees[k // self.group_size].set_leaf_reward(self.leaf_nodes[k], reward)

    def token_advantages(self, node_advantages: dict[tuple[int, int], float]) -> list[Tensor]:
        """Per leaf, the advantage of every token: A(node) of the segment it lies in (keyed by (tree
        index, node id), as `mmrl.tree.fused_node_advantages` returns them); 0 on the prompt."""
        return [
            torch.tensor([node_advantages.get((k // self.group_size, n), 0.0) for n in nodes])
            for k, nodes in enumerate(self.token_nodes)
        ]


def fork(trajectory: Trajectory) -> Trajectory:
    """A copy a branch can extend without touching its parent's (images are shared, never edited)."""
    store = copy.copy(trajectory.store)
    store.images, store.boxes = list(store.images), list(store.boxes)
    stats = trajectory.tool_stats
    return replace(
        trajectory,
        loss_mask=list(trajectory.loss_mask),
        old_log_probs=list(trajectory.old_log_probs),
        turn_ids=list(trajectory.turn_ids),
        store=store,
        tool_stats=ToolStats(stats.calls, stats.successes, Counter(stats.errors)),
    )


class Forest:
    """The trees of one step while they grow: which nodes still generate, which leaf slots are taken."""

    def __init__(self, branching: Sequence[int], group_size: int) -> None:
        self.branching, self.group_size = list(branching), group_size
        self.trees: list[RolloutTree] = []
        self.live: list[tuple[int, int]] = []  # (tree index, node id) of the nodes still generating
        self.leaf_of: dict[tuple[int, int], int] = {}  # (tree index, leaf slot) -> node id
        self.branch_points = 0

    def plant(self, root: Trajectory) -> None:
        """A question's tree: the prompt as root, split at once into its first branches."""
        self.trees.append(RolloutTree(TreeSegment(root, 0, range(self.group_size), fresh=False)))
        self.branch(len(self.trees) - 1, 0)

    def width(self, i: int, node_id: int) -> int:
        """How many children the node splits into at a branch point (1: it goes on)."""
        node = self.trees[i].nodes[node_id]
        return branch_children(self.branching, node.depth, len(node.state.slots))

    def branch(self, i: int, node_id: int) -> None:
        """Share the node's slots out to `width` new children, in order, as evenly as possible."""
        children = self.width(i, node_id)
        self.branch_points += children > 1
        for slots in split_slots(self.trees[i].nodes[node_id].state.slots, children):
            self.add_child(i, node_id, slots)

    def add_child(self, i: int, parent_id: int, slots: range) -> None:
        """A live child that starts from the parent's end (the parent's generation calls included)."""
        parent = self.trees[i].nodes[parent_id].state
        trajectory = fork(parent.trajectory)
        state = TreeSegment(trajectory, len(trajectory.sequence), slots)
        self.live.append((i, self.trees[i].add_child(parent_id, state)))

    def close(self, i: int, node_id: int) -> None:
        """The node stops generating: its edge gets its log-probs; an ended one becomes the leaf of its
        first slot and hands the others back to its parent as a fresh branch."""
        node = self.trees[i].nodes[node_id]
        state = node.state
        node.old_logp = torch.tensor(state.log_probs)
        if not state.trajectory.ended:
            return
        self.leaf_of[(i, state.slots[0])] = node_id
        if len(state.slots) > 1:
            self.add_child(i, node.parent_id, state.slots[1:])
            state.slots = state.slots[:1]

    def result(self, prefill_tokens: int, decoded_tokens: int) -> TreeRollout:
        g = self.group_size
        leaf_nodes = [self.leaf_of[(i, j)] for i in range(len(self.trees)) for j in range(g)]
        token_nodes = []
        for k, leaf in enumerate(leaf_nodes):
            tree = self.trees[k // g]
            nodes = [0] * tree.nodes[0].state.span[1]
            for edge in tree.path_to(leaf):
                start, end = tree.nodes[edge.child].state.span
                nodes += [edge.child] * (end - start)
            token_nodes.append(nodes)
        return TreeRollout(
            self.trees,
            g,
            [self.trees[k // g].nodes[n].state.trajectory for k, n in enumerate(leaf_nodes)],
            leaf_nodes,
            token_nodes,
            prefill_tokens,
            decoded_tokens,
            self.branch_points,
        )


@torch.no_grad()
def tree_rollout(
    adapter: VLMAdapter,
    questions: Sequence[Question],
    group_size: int,
    cfg: ToolRolloutConfig,
    seed: int,
    step: int,
    slots: Sequence[int],
    engine: TurnGenerator | None = None,
) -> TreeRollout:
    """`group_size` leaves per question, grown as a tree (`cfg.tree`); `slots[i]` is question i's slot
    in the step (its keys' prompt index is slot * group_size + leaf slot). `engine` generates the turns
    (default: the adapter's transformers model)."""
    if len(slots) != len(questions):
        raise ValueError(f"{len(slots)} slots for {len(questions)} questions")
    settings = CropSettings(cfg.coordinate_space, cfg.crop_padding, cfg.crop_min_size)
    forest = Forest(cfg.tree.branching, group_size)
    for question in questions:
        prompt = prompt_segment(adapter, question, cfg.system_prompt, question.image)
        store = ImageStore(question.image, settings)
        forest.plant(Trajectory(prompt, [False] * len(prompt), [0.0] * len(prompt), question.options, store))
    prefill_tokens = decoded_tokens = 0
    while forest.live:
        wave = sorted(
            forest.live, key=lambda row: (row[0], forest.trees[row[0]].nodes[row[1]].state.slots.start)
        )
        forest.live = []
        rows, limits = [], []
        for i, node_id in wave:
            state = forest.trees[i].nodes[node_id].state
            if len(state.trajectory.sequence) >= cfg.max_tokens:  # at the token limit before generating
                state.trajectory.ended = "max_tokens"
                forest.close(i, node_id)
                continue
            rows.append((i, node_id))
            limits.append(call_limit(state.trajectory, cfg, cfg.tree.segment_tokens))
        if not rows:
            continue
        nodes = [forest.trees[i].nodes[node_id] for i, node_id in rows]
        groups: dict[tuple[int, int, bool], int] = {}  # fresh siblings hold their parent's sequence
        out = (engine or adapter).generate_turn(
            [node.state.trajectory.sequence for node in nodes],
            max(limits),
            keys=[
                NoiseKey(
                    seed, step, slots[i] * group_size + node.state.slots.start, node.state.trajectory.calls
                )
                for (i, _), node in zip(rows, nodes, strict=True)
            ],
            temperature=cfg.temperature,
            prefix_groups=[
                groups.setdefault(
                    (i, node.parent_id, True) if node.state.fresh else (i, node.node_id, False), len(groups)
                )
                for (i, _), node in zip(rows, nodes, strict=True)
            ],
        )
        prefill_tokens += out.prefill_tokens
        for r, ((i, node_id), node, limit) in enumerate(zip(rows, nodes, limits, strict=True)):
            state, t = node.state, node.state.trajectory
            log_probs = take_generated(adapter, t, out, r, limit, cfg, forced=[])
            decoded_tokens += len(log_probs)
            state.log_probs += log_probs
            state.fresh = False
            if t.ended:
                forest.close(i, node_id)
            elif forest.width(i, node_id) == 1:  # a branch point without a split: the node goes on
                forest.live.append((i, node_id))
            else:
                forest.close(i, node_id)
                forest.branch(i, node_id)
    return forest.result(prefill_tokens, decoded_tokens)
