"""The schedules of the rollout loop (`vlm_rl.rollout.generate`): which conversations a rollout
starts, which of them generate in each wave, what becomes of one after its generation call (it goes
on, branches or closes), and when a step has enough. The loop itself takes turns and closes them the
same way for all of them (`vlm_rl.conversation`).

Keys. A conversation's launch key is (seed, step, slot x G + j): its group's slot in the step and its
place j in the group (G the group size); the loop puts its generation calls so far in the key's
`node`, so no two calls of a conversation share noise and a conversation's tokens do not depend on
what it is batched with, nor on how its turns were cut into calls.

`Groups`: flat groups, G conversations per question, each generating until it ends.

`Trees` (TreePO-style): a question's group is one `mmrl.tree.RolloutTree` whose branches continue from
their shared prefix, so the prompt and the early turns are generated (and prefilled) once. The root is
the prompt; every other node is one *segment*: a run of sampled tokens, with the tool's observation
when it ends a turn with a tool call (a `TreeSegment`; the edge into it holds the segment's log-probs).
Every node owns a contiguous range of the G leaf slots (the root all of them). Branch points are the
end of every turn and, with `rollout.tree.segment_tokens > 0`, every `segment_tokens` tokens inside a
turn; there a live node at depth d splits into c = min(branching[d], quota) children (branching[d] = 1
past the list), its slots shared out in order as evenly as possible; with c = 1 it just goes on. The
root splits before the first token. A node whose conversation ends becomes the leaf of its first slot
and hands the others back to its parent as a new child (a fresh sample from the parent's state), so
every question ends with exactly G leaves. A node's key is its first slot's, so ``branching: [G]``
samples what flat groups sample; siblings that have not generated yet hold their parent's sequence
and share a prefix group, which `generate_turn` prefills once.

`CarriedGroups` (APRIL): partial rollouts across steps. `begin` launches new groups up to
`train.questions_per_step x (1 + rollout.partial.over_provision)` besides the carried ones; the loop
generates every unfinished conversation until `train.questions_per_step` groups are complete (every
conversation of the group ended); `end` hands those over, the oldest launch first, and the rest carry
on, their tokens keeping the log-probs of the policy that sampled them. The bookkeeping (launches,
completion, staleness and its cap) is `mmrl.partial`'s. A conversation keeps its launch key: with
nothing carried and no over-provision a step samples exactly what flat groups sample. Steps end at
turn boundaries, or mid-turn with `rollout.partial.segment_tokens`. The state dict holds what
rebuilds the conversations in flight (question index, launch step and slot per group; per
conversation its sampled tokens and log-probs per turn, how it ended, its generation calls, the
tokens each policy version sampled); `load_state_dict` replays them
(`vlm_rl.conversation.SavedConversations`): images come back from the questions and the crop tool,
never from a pickle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from mmrl.noise import NoiseKey
from mmrl.partial import PartialGroup, PartialGroups
from mmrl.tree import Node, RolloutTree, branch_children, split_slots
from vlm_rl.config import ToolRolloutConfig
from vlm_rl.conversation import SavedConversations, Trajectory, fork, split, start_conversations
from vlm_rl.data import Question, QuestionSet
from vlm_rl.models import VLMAdapter


class Row(Protocol):
    """A conversation as the loop sees it: what it generates on, and its launch key (None: greedy)."""

    @property
    def trajectory(self) -> Trajectory: ...

    @property
    def key(self) -> NoiseKey | None: ...


class Schedule(Protocol):
    """What the rollout loop asks of a schedule."""

    segment_tokens: int  # > 0: a turn pauses after this many tokens (a branch point, a step's end)

    def wave(self) -> Sequence[Row]:
        """The conversations that generate next, in the order of the call's rows (none: done)."""
        ...

    def prefix_groups(self, rows: Sequence[Row]) -> list[int] | None:
        """Per row of a call, an id shared by rows that hold one sequence (None: no sharing)."""
        ...

    def advance(self, row: Row, log_probs: list[float]) -> None:
        """The row's call is done (`log_probs`: of the tokens it kept), or it ended at the token limit
        before one (none): it goes on, branches or closes."""
        ...

    def enough(self) -> bool:
        """Asked after every wave: whether to stop with conversations unfinished."""
        ...


@dataclass
class Generated:
    """What a rollout's generation calls cost: prompt tokens prefilled (shared ones once, no padding)
    and tokens sampled."""

    prefill_tokens: int = 0
    decoded_tokens: int = 0


@dataclass
class StepRollouts:
    """A training step's rollouts, whatever the schedule: its groups' question indices (every
    process's), this process's groups (their places in `chosen`) and their conversations, group by
    group; the trees they grew in, and the schedule's own metrics."""

    chosen: list[int]
    slots: list[int]
    trajectories: list[Trajectory]
    tree: TreeRollout | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def launch_key(seed: int, step: int, slot: int, group_size: int, member: int) -> NoiseKey:
    """The key of member `member` of the group launched at `step` in slot `slot` (see the docstring)."""
    return NoiseKey(seed, step, slot * group_size + member, 0)


@dataclass(frozen=True)
class StepGroups:
    """The groups a step launches: `group_size` conversations per question, question i's group in slot
    `slots[i]`, keyed by the run's `seed` and the `step`; `chosen`: every process's question indices
    (the step's `StepRollouts`)."""

    seed: int
    step: int
    group_size: int
    slots: Sequence[int]
    chosen: Sequence[int] = ()

    def key(self, i: int, member: int) -> NoiseKey:
        """The launch key of member `member` of question i's group."""
        return launch_key(self.seed, self.step, self.slots[i], self.group_size, member)


@dataclass
class Conversation:
    """One conversation of a group: its trajectory so far, its launch key, and how many of its tokens
    each policy version (training step) sampled (partial rollouts)."""

    trajectory: Trajectory
    key: NoiseKey | None
    tokens_by_version: dict[int, int] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return bool(self.trajectory.ended)


class Groups:
    """Flat groups: every conversation generates until it ends. `chosen` and `slots`: the step's
    groups, for `rollouts` (a training step's)."""

    segment_tokens = 0

    def __init__(
        self, conversations: list[Conversation], chosen: Sequence[int] = (), slots: Sequence[int] = ()
    ) -> None:
        self.conversations, self.chosen, self.slots = conversations, list(chosen), list(slots)

    @classmethod
    def start(
        cls,
        adapter: VLMAdapter,
        questions: Sequence[Question],
        cfg: ToolRolloutConfig,
        step_groups: StepGroups,
    ) -> Groups:
        """`step_groups.group_size` conversations per question, keyed by their group's slot."""
        g = step_groups.group_size
        trajectories = start_conversations(adapter, [q for q in questions for _ in range(g)], cfg)
        keys = [step_groups.key(i, j) for i in range(len(questions)) for j in range(g)]
        conversations = [Conversation(*row) for row in zip(trajectories, keys, strict=True)]
        return cls(conversations, step_groups.chosen, step_groups.slots)

    def wave(self) -> list[Conversation]:
        return [c for c in self.conversations if not c.finished]

    def prefix_groups(self, rows: Sequence[Row]) -> None:
        return None

    def advance(self, row: Row, log_probs: list[float]) -> None:
        pass  # it goes on until it ends

    def enough(self) -> bool:
        return False

    @property
    def trajectories(self) -> list[Trajectory]:
        return [c.trajectory for c in self.conversations]

    def rollouts(self, generated: Generated) -> StepRollouts:
        return StepRollouts(self.chosen, self.slots, self.trajectories)


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
class Branch:
    """A live tree node as the loop sees it: its tree's index, the node, its first slot's key."""

    tree: int
    node: Node
    key: NoiseKey

    @property
    def trajectory(self) -> Trajectory:
        return self.node.state.trajectory


@dataclass
class TreeRollout:
    """The grown trees. Leaves are question-major: leaf slot j of question i is
    `leaves[i * group_size + j]`, so rewards, group ids and metrics line up as for flat groups."""

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
        index, node id), as `mmrl.credit.assign_credit` returns them); 0 on the prompt."""
        return [
            torch.tensor([node_advantages.get((k // self.group_size, n), 0.0) for n in nodes])
            for k, nodes in enumerate(self.token_nodes)
        ]


class Trees:
    """Each question's group grown as a tree (`rollout.tree`; see the module docstring)."""

    def __init__(
        self,
        adapter: VLMAdapter,
        questions: Sequence[Question],
        cfg: ToolRolloutConfig,
        step_groups: StepGroups,
    ) -> None:
        if len(step_groups.slots) != len(questions):
            raise ValueError(f"{len(step_groups.slots)} slots for {len(questions)} questions")
        self.step_groups, self.group_size = step_groups, step_groups.group_size
        self.branching, self.segment_tokens = list(cfg.tree.branching), cfg.tree.segment_tokens
        self.trees: list[RolloutTree] = []
        self.live: list[Branch] = []  # the nodes still generating
        self.leaf_of: dict[tuple[int, int], int] = {}  # (tree index, leaf slot) -> node id
        self.branch_points = 0
        for root in start_conversations(adapter, questions, cfg):  # the prompt, split at once
            self.trees.append(RolloutTree(TreeSegment(root, 0, range(self.group_size), fresh=False)))
            self.branch(len(self.trees) - 1, 0)

    def wave(self) -> list[Branch]:
        wave = sorted(self.live, key=lambda branch: (branch.tree, branch.node.state.slots.start))
        self.live = []
        return wave

    def prefix_groups(self, rows: Sequence[Branch]) -> list[int]:
        """Fresh siblings hold their parent's sequence: one group."""
        groups: dict[tuple[int, int, bool], int] = {}
        return [
            groups.setdefault(
                (b.tree, b.node.parent_id, True) if b.node.state.fresh else (b.tree, b.node.node_id, False),
                len(groups),
            )
            for b in rows
        ]

    def advance(self, row: Branch, log_probs: list[float]) -> None:
        state = row.node.state
        state.log_probs += log_probs
        state.fresh = False
        if state.trajectory.ended:
            self.close(row.tree, row.node)
        elif self.width(row.node) == 1:  # a branch point without a split: the node goes on
            self.live.append(row)
        else:
            self.close(row.tree, row.node)
            self.branch(row.tree, row.node.node_id)

    def enough(self) -> bool:
        return False

    def width(self, node: Node) -> int:
        """How many children the node splits into at a branch point (1: it goes on)."""
        return branch_children(self.branching, node.depth, len(node.state.slots))

    def branch(self, i: int, node_id: int) -> None:
        """Share the node's slots out to `width` new children, in order, as evenly as possible."""
        node = self.trees[i].nodes[node_id]
        children = self.width(node)
        self.branch_points += children > 1
        for slots in split_slots(node.state.slots, children):
            self.add_child(i, node_id, slots)

    def add_child(self, i: int, parent_id: int, slots: range) -> None:
        """A live child that starts from the parent's end (the parent's generation calls included)."""
        trajectory = fork(self.trees[i].nodes[parent_id].state.trajectory)
        child_id = self.trees[i].add_child(
            parent_id, TreeSegment(trajectory, len(trajectory.sequence), slots)
        )
        self.live.append(Branch(i, self.trees[i].nodes[child_id], self.step_groups.key(i, slots.start)))

    def close(self, i: int, node: Node) -> None:
        """The node stops generating: its edge gets its log-probs; an ended one becomes the leaf of its
        first slot and hands the others back to its parent as a fresh branch."""
        state = node.state
        node.old_logp = torch.tensor(state.log_probs)
        if not state.trajectory.ended:
            return
        self.leaf_of[(i, state.slots[0])] = node.node_id
        if len(state.slots) > 1:
            self.add_child(i, node.parent_id, state.slots[1:])
            state.slots = state.slots[:1]

    def tree_rollout(self, generated: Generated) -> TreeRollout:
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
            generated.prefill_tokens,
            generated.decoded_tokens,
            self.branch_points,
        )

    def rollouts(self, generated: Generated) -> StepRollouts:
        """Prefilled and decoded tokens, nodes and branch points per question as metrics."""
        tree, questions = self.tree_rollout(generated), len(self.trees)
        metrics = {
            "prefill_tokens": tree.prefill_tokens / questions,
            "decoded_tokens": tree.decoded_tokens / questions,
            "tree_nodes": sum(len(t) for t in tree.trees) / questions,
            "branch_points": tree.branch_points / questions,
        }
        chosen, slots = list(self.step_groups.chosen), list(self.step_groups.slots)
        return StepRollouts(chosen, slots, tree.leaves, tree, metrics)


@dataclass
class PartialStep:
    """The groups a step trains, the oldest launch first, and the step's partial-rollout metrics."""

    groups: list[PartialGroup[Conversation]]
    metrics: dict[str, float]

    @property
    def trajectories(self) -> list[Trajectory]:
        """The conversations, group by group (group size each)."""
        return [member.trajectory for group in self.groups for member in group.members]

    @property
    def items(self) -> list[int]:
        """The question index of each group."""
        return [group.item for group in self.groups]


class CarriedGroups:
    """Groups of conversations in flight across training steps (see the module docstring): `begin` a
    step, run the loop on it, `end` it."""

    TENSOR_KEYS = (
        *PartialGroups.TENSOR_KEYS,
        *SavedConversations.TENSOR_KEYS,
        "version_entries",
        "versions",
        "version_tokens",
    )

    def __init__(
        self,
        adapter: VLMAdapter,
        questions: QuestionSet | Sequence[Question],
        cfg: ToolRolloutConfig,
        target_groups: int,
        group_size: int,
        seed: int,
    ) -> None:
        self.adapter, self.questions, self.cfg = adapter, questions, cfg
        self.group_size, self.seed = group_size, seed
        self.segment_tokens = cfg.partial.segment_tokens
        self.groups: PartialGroups[Conversation] = PartialGroups(
            target_groups, cfg.partial.over_provision, cfg.partial.max_staleness
        )
        self.step, self.launched = 0, 0

    def key(self, launch_step: int, slot: int, member: int) -> NoiseKey:
        """A conversation's key for good: where it was launched, not where it is continued."""
        return launch_key(self.seed, launch_step, slot, self.group_size, member)

    def start(self, step: int, slot: int, item: int) -> list[Conversation]:
        question = self.questions[item]
        trajectories = start_conversations(self.adapter, [question] * self.group_size, self.cfg)
        return [Conversation(t, self.key(step, slot, j)) for j, t in enumerate(trajectories)]

    def begin(self, step: int, sample: Callable[[int], list[int]]) -> CarriedGroups:
        """Drop the groups too stale to train at `step` (their questions go again), launch new groups
        with `sample(n)` (question indices) to fill up."""
        plan = self.groups.begin_step(step)
        items = plan.relaunch + (sample(plan.new) if plan.new else [])
        self.groups.launch(step, items, lambda slot, item: self.start(step, slot, item))
        self.step, self.launched = step, len(items)
        return self

    def wave(self) -> list[Conversation]:
        return [m for g in self.groups.groups for m in g.members if not m.finished]

    def prefix_groups(self, rows: Sequence[Row]) -> None:
        return None

    def advance(self, row: Conversation, log_probs: list[float]) -> None:
        if log_probs:  # sampled by this step's policy
            row.tokens_by_version[self.step] = row.tokens_by_version.get(self.step, 0) + len(log_probs)

    def enough(self) -> bool:
        return self.groups.enough()

    def end(self) -> PartialStep:
        """The complete groups the step trains; the others carry on."""
        trained = self.groups.take_trained()
        metrics = self.groups.metrics(self.step, trained) | {"partial_launched_groups": self.launched}
        return PartialStep(trained, metrics)

    def rollouts(self, generated: Generated) -> StepRollouts:
        done = self.end()
        return StepRollouts(done.items, list(range(len(done.groups))), done.trajectories, None, done.metrics)

    def state_dict(self) -> dict[str, Any]:
        members = [m for g in self.groups.groups for m in g.members]
        versions = [sorted(m.tokens_by_version.items()) for m in members]

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long)

        return {
            **self.groups.state_dict(),
            **SavedConversations.state_dict([m.trajectory for m in members]),
            "group_size": self.group_size,
            "version_entries": longs([len(v) for v in versions]),
            "versions": longs([version for v in versions for version, _ in v]),
            "version_tokens": longs([tokens for v in versions for _, tokens in v]),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["group_size"]) != self.group_size:
            raise ValueError(
                f"partial rollout state has groups of {state['group_size']} but this run's have "
                f"{self.group_size}"
            )
        saved = SavedConversations(state)
        entries = state["version_entries"].tolist()
        versions = split(
            list(zip(state["versions"].tolist(), state["version_tokens"].tolist(), strict=True)), entries
        )

        def rebuild(position: int, group: PartialGroup) -> list[Conversation]:
            members = []
            for j in range(self.group_size):
                c = position * self.group_size + j
                trajectory = saved.replay(self.adapter, self.questions[group.item], self.cfg, c)
                members.append(
                    Conversation(trajectory, self.key(group.launch_step, group.slot, j), dict(versions[c]))
                )
            return members

        self.groups.load_state_dict(state, rebuild)
