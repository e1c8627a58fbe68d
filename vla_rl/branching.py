"""Snapshot-branched GRPO groups (`grpo.branch_every` > 0): a group's episodes share their prefixes.

A flat GRPO group runs `rollout.group_size` (G) episodes from one reset seed, each from reset. Here the
group is an `mmrl.tree.RolloutTree`: the root is the reset state, and a branch runs `branch_every`
sampled chunks, saves the env (`sim.env.snapshot_env`: the whole MuJoCo state, step counters, time
limit, task targets) and splits into `branching[depth]` children that each restore the snapshot and
continue with their own chunks. A node is a snapshot at a branch point; the edge into it holds the
steps executed since its parent's snapshot (an `Episode` of its own, `BranchNode.edge`) and the
per-chunk log-probs of the executed actions (`old_logp`); a leaf's reward is the episode's success.

Leaf quota (`mmrl.tree.split_slots`): the root owns the leaf slots [0, G), each node a contiguous range
of its parent's; a branch that ends (success, failure, time limit) keeps its first slot for its leaf
and hands the rest back to its parent as a new child that restarts from the parent's snapshot, so
every group ends with exactly G leaf episodes. A node that would split into one child just goes on.

Noise. Chunk c (counted along the path from reset) of the branch whose first leaf slot is s, in the
group at index i of the iteration, is sampled with the keyed noise NoiseKey(seed, step, i * G + s, c):
a function of the group, the branch's place in the tree and the chunk index alone, never of the env
slot that ran it. Branches of all the groups of a wave share `len(envs)` envs in lockstep, the policy
sampling one batch for every branch that needs a chunk.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from mmrl.noise import NoiseKey, keyed_randn_batch
from mmrl.tree import RolloutTree, branch_children, split_slots
from vla_rl.episodes import Obs, evaluating
from vla_rl.online import Episode

if TYPE_CHECKING:
    import gymnasium as gym

    from sim.env import EnvSnapshot
    from vla_rl.policy import VLAPolicy


@dataclass(frozen=True)
class BranchPlan:
    """How groups branch: G leaves, chunks between branch points, children per branch point by depth."""

    group_size: int
    every: int
    branching: tuple[int, ...]


@dataclass
class Origin:
    """A chunk boundary that branches start from: the env's snapshot there and what the policy saw."""

    snapshot: EnvSnapshot
    obs: Obs
    chunks: int  # chunks sampled on the path from reset to here


@dataclass
class BranchNode:
    """A tree node's state: the leaf slots it owns and where its edge starts (its parent's origin; the
    root's own), and once its branch stopped, the edge's steps and, where it split, its own origin."""

    slots: range
    start: Origin
    edge: Episode | None = None
    origin: Origin | None = None


@dataclass
class BranchedGroups:
    """What `branched_rollouts` returns: one tree per group (node states are `BranchNode`s), and each
    group's G leaf episodes from reset (prefix and branch joined), group-major in slot order."""

    trees: list[RolloutTree]
    leaves: list[Episode]
    env_steps: int  # env steps simulated: each shared prefix once
    branch_points: int  # splits into two or more children

    def edges(self) -> list[tuple[int, int, Episode]]:
        """(tree index, node id, the edge's steps) of every non-root node, tree by tree."""
        return [(t, n.node_id, n.state.edge) for t, tree in enumerate(self.trees) for n in tree.nodes[1:]]

    def without(self, groups: set[int]) -> BranchedGroups:
        """These groups less those whose id is in `groups` (the env-step counts stay)."""
        size = len(self.leaves) // max(len(self.trees), 1)
        kept = [t for t in range(len(self.trees)) if self.leaves[t * size].group not in groups]
        leaves = [leaf for t in kept for leaf in self.leaves[t * size : (t + 1) * size]]
        return BranchedGroups([self.trees[t] for t in kept], leaves, self.env_steps, self.branch_points)

    def extend(self, other: BranchedGroups) -> None:
        self.trees += other.trees
        self.leaves += other.leaves
        self.env_steps += other.env_steps
        self.branch_points += other.branch_points


def chunk_key(
    seed: int, step: int, group_index: int, group_size: int, first_slot: int, chunk: int
) -> NoiseKey:
    """The key of a branch's chunk sampling noise (module docstring)."""
    return NoiseKey(seed, step, group_index * group_size + first_slot, chunk)


@torch.no_grad()
def branched_rollouts(
    policy: VLAPolicy,
    envs: Sequence[gym.Env],
    seeds: Sequence[int],
    groups: Sequence[int],
    plan: BranchPlan,
    noise: tuple[int, int, int],
    std_scale: float = 1.0,
) -> BranchedGroups:
    """One branched group per reset seed (`groups[i]`: its group id in the episodes), run on `envs`
    in lockstep. `noise` is (run seed, iteration, index of the first group in the iteration): group i
    samples with keys of index noise[2] + i."""
    with evaluating(policy):
        return _Runner(policy, envs, seeds, groups, plan, noise, std_scale).run()


@dataclass
class _Branch:
    """A branch being run in an env slot: its node, where it is on the path, what it recorded."""

    tree: int
    node: int
    obs: Obs
    chunks: int  # chunks sampled on the path from reset, the current one included
    done_chunks: int = 0  # chunks this branch completed
    cursor: int = 0  # next action's index in the current chunk
    queue: np.ndarray | None = None  # (horizon, action_dim) the current chunk
    queue_logp: np.ndarray | None = None  # (horizon,) its actions' log-probs
    logps: list[float] = field(default_factory=list)  # per chunk: the executed actions' log-prob
    arrays: dict[str, list] = field(default_factory=dict)


class _Runner:
    """The groups' trees, the branches waiting for an env slot and the one running in each slot."""

    def __init__(
        self,
        policy: VLAPolicy,
        envs: Sequence[gym.Env],
        seeds: Sequence[int],
        groups: Sequence[int],
        plan: BranchPlan,
        noise: tuple[int, int, int],
        std_scale: float,
    ) -> None:
        self.policy, self.envs, self.plan, self.noise, self.std_scale = policy, envs, plan, noise, std_scale
        self.seeds, self.groups = [int(s) for s in seeds], [int(g) for g in groups]
        self.n_exec = policy.config.n_action_steps
        self.trees: list[RolloutTree] = []
        self.instructions: list[str] = []
        self.pending: deque[tuple[int, int]] = deque()
        self.running: list[_Branch | None] = [None] * len(envs)
        self.leaf_of: dict[tuple[int, int], int] = {}
        self.env_steps = self.branch_points = 0

    def run(self) -> BranchedGroups:
        from sim.env import snapshot_env

        for t, seed in enumerate(self.seeds):
            obs, info = self.envs[0].reset(seed=seed)
            origin = Origin(snapshot_env(self.envs[0]), obs, 0)
            self.trees.append(RolloutTree(BranchNode(range(self.plan.group_size), origin, origin=origin)))
            self.instructions.append(info["instruction"])
            self.split(t, 0)
        while self.pending or any(b is not None for b in self.running):
            self.fill_slots()
            self.sample_chunks()
            for j, branch in enumerate(self.running):
                if branch is not None:
                    self.step(j, branch)
        leaves = [
            leaf_episode(tree, self.leaf_of[(t, slot)])
            for t, tree in enumerate(self.trees)
            for slot in range(self.plan.group_size)
        ]
        return BranchedGroups(self.trees, leaves, self.env_steps, self.branch_points)

    def children(self, t: int, node_id: int) -> int:
        node = self.trees[t].nodes[node_id]
        return branch_children(self.plan.branching, node.depth, len(node.state.slots))

    def split(self, t: int, node_id: int) -> None:
        """The node's slots shared out to its children, which wait for an env slot."""
        node = self.trees[t].nodes[node_id].state
        children = self.children(t, node_id)
        self.branch_points += children > 1
        for slots in split_slots(node.slots, children):
            self.pending.append((t, self.trees[t].add_child(node_id, BranchNode(slots, node.origin))))

    def fill_slots(self) -> None:
        """Free env slots take waiting branches, restored to their start's snapshot."""
        from sim.env import restore_env

        for j, branch in enumerate(self.running):
            if branch is None and self.pending:
                t, node_id = self.pending.popleft()
                start = self.trees[t].nodes[node_id].state.start
                restore_env(self.envs[j], start.snapshot)
                arrays = {"states": [start.obs["state"]], "images": [start.obs["image"]]}
                self.running[j] = _Branch(
                    t, node_id, start.obs, start.chunks, cursor=self.n_exec,
                    arrays=arrays | {"actions": [], "chunk_steps": []},
                )  # fmt: skip

    def sample_chunks(self) -> None:
        """One policy batch for every branch that finished its chunk, each row with its keyed noise."""
        branches = [b for b in self.running if b is not None and b.cursor >= self.n_exec]
        if not branches:
            return
        batch = {key: np.stack([b.obs[key] for b in branches]) for key in ("state", "image")}
        inputs = self.policy.prepare(batch, [self.instructions[b.tree] for b in branches])
        dist = self.policy(inputs).scaled(self.std_scale)
        seed, step, first_index = self.noise
        keys = [
            chunk_key(
                seed,
                step,
                first_index + b.tree,
                self.plan.group_size,
                self.trees[b.tree].nodes[b.node].state.slots.start,
                b.chunks,
            )
            for b in branches
        ]
        mean = dist.mean
        chunks = dist.sample(
            noise=keyed_randn_batch(mean.shape[1:], keys, device=mean.device, dtype=mean.dtype)
        )
        logps = dist.log_prob(chunks).sum(-1).float().cpu().numpy()
        for b, chunk, logp in zip(branches, chunks.float().cpu().numpy(), logps, strict=True):
            b.queue, b.queue_logp, b.cursor = chunk, logp, 0
            b.chunks += 1

    def step(self, j: int, b: _Branch) -> None:
        """Env slot j executes its branch's next action; the branch stops where its episode ends or at
        its branch point."""
        action = b.queue[b.cursor]
        b.obs, _, terminated, truncated, info = self.envs[j].step(action)
        self.env_steps += 1
        for key, value in (
            ("states", b.obs["state"]),
            ("images", b.obs["image"]),
            ("actions", action),
            ("chunk_steps", b.cursor),
        ):
            b.arrays[key].append(value)
        b.cursor += 1
        ended = terminated or truncated
        if ended or b.cursor == self.n_exec:
            b.logps.append(float(b.queue_logp[: b.cursor].sum()))
            b.done_chunks += not ended
        if ended:
            self.close(j, b, bool(info["is_success"]), bool(terminated))
        elif (
            b.cursor == self.n_exec and b.done_chunks == self.plan.every and self.children(b.tree, b.node) > 1
        ):
            self.close(j, b, None, False)

    def close(self, j: int, b: _Branch, success: bool | None, terminated: bool) -> None:
        """The branch in env slot j stops and frees the slot. Its edge is recorded; a leaf (`success`
        not None) hands its spare slots back to its parent, a branch point saves the env and splits."""
        from sim.env import snapshot_env

        self.running[j] = None
        tree = self.trees[b.tree]
        tree_node = tree.nodes[b.node]
        node = tree_node.state
        node.edge = Episode(
            seed=self.seeds[b.tree],
            group=self.groups[b.tree],
            instruction=self.instructions[b.tree],
            states=np.stack(b.arrays["states"]).astype(np.float32),
            images=np.stack(b.arrays["images"]),
            actions=np.stack(b.arrays["actions"]).astype(np.float32),
            is_intervention=np.zeros(len(b.arrays["actions"]), dtype=bool),
            chunk_step=np.array(b.arrays["chunk_steps"], dtype=np.int64),
            success=bool(success),
            terminated=terminated,
            interventions=0,
        )
        tree_node.old_logp = torch.tensor(b.logps)
        if success is None:
            node.origin = Origin(snapshot_env(self.envs[j]), b.obs, b.chunks)
            self.split(b.tree, b.node)
            return
        tree.set_leaf_reward(b.node, float(success))
        self.leaf_of[(b.tree, node.slots[0])] = b.node
        if len(node.slots) > 1:
            parent = tree_node.parent_id
            rest = BranchNode(node.slots[1:], tree.nodes[parent].state.origin)
            self.pending.append((b.tree, tree.add_child(parent, rest)))


def leaf_episode(tree: RolloutTree, leaf: int) -> Episode:
    """The leaf's whole episode from reset: the edges on its path joined (each edge's first
    observation is its parent's last)."""
    edges = [tree.nodes[edge.child].state.edge for edge in tree.path_to(leaf)]
    last = edges[-1]
    return Episode(
        seed=last.seed,
        group=last.group,
        instruction=last.instruction,
        states=np.concatenate([edges[0].states[:1], *(e.states[1:] for e in edges)]),
        images=np.concatenate([edges[0].images[:1], *(e.images[1:] for e in edges)]),
        actions=np.concatenate([e.actions for e in edges]),
        is_intervention=np.concatenate([e.is_intervention for e in edges]),
        chunk_step=np.concatenate([e.chunk_step for e in edges]),
        success=last.success,
        terminated=last.terminated,
        interventions=0,
    )
