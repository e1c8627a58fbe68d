"""Online data for HABC and its baselines: supervised rollouts and a flat view of the replay buffer.

Rollouts (`rollouts`) run through the shared episode loop (`vla_rl.episodes`). Environments run in
lockstep with obs_mode "state+rgb": the policy sees the camera image, the instruction and
proprioception (the first entries of the state), while the supervisor, the expert and the critics may
read the privileged state. The policy samples an action chunk and executes its first `n_action_steps`
actions (as `VLAPolicy.act` does) before sampling the next one; chunks are sampled by `SampledChunks`
rather than through `act` so that every chunk's start step is known (GRPO needs it) and the chunk can
be dropped the moment the expert takes over. The expert takes over by the training rule of
`vla_rl.supervisor` (the recipes' `intervention.*`: the mean gap over a window, a deadline, at most
`max_per_episode` take-overs, optionally the release guard).

`GroupSeeds` says which reset seed each group of an iteration's waves gets: fresh seeds, or task
variants drawn from a pool by a sampler that learns from each group's successes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from vla_rl.episodes import Outcome, Recorder, SampledChunks, Step, evaluating, run_episodes
from vla_rl.lerobot_format import IMAGE_KEY, STATE_KEY
from vla_rl.policy import VLAPolicy
from vla_rl.replay_buffer import KINDS, ReplayBuffer, Segment
from vla_rl.supervisor import TakeoverRule

if TYPE_CHECKING:
    from mmrl.samplers import Sampler
    from sim.experts import Expert


@dataclass
class Episode:
    """One rollout: T actions, T + 1 observations, who acted at each step, and the outcome."""

    seed: int
    group: int  # episodes of one group share a reset seed (GRPO normalises success within groups)
    instruction: str
    states: np.ndarray  # (T + 1, state_dim) float32
    images: np.ndarray  # (T + 1, H, W, 3) uint8
    actions: np.ndarray  # (T, action_dim) float32
    is_intervention: np.ndarray  # (T,) bool
    chunk_step: np.ndarray  # (T,) int64: index of each policy action in its sampled chunk; -1 on expert steps
    success: bool
    terminated: bool  # ended by termination (success or unstable sim) rather than the time limit
    interventions: int  # take-overs

    @property
    def length(self) -> int:
        return len(self.actions)

    @property
    def decisions(self) -> list[tuple[int, int]]:
        """(start step, actions executed) of every chunk the policy sampled, in order."""
        chunks: list[tuple[int, int]] = []
        for t, index in enumerate(self.chunk_step.tolist()):
            if index == 0:
                chunks.append((t, 1))
            elif index > 0:
                chunks[-1] = (chunks[-1][0], index + 1)
        return chunks


class EpisodeArrays(Recorder):
    """The training arrays of every episode: observations, executed actions, who chose them, and each
    policy action's index in its sampled chunk."""

    def __init__(self) -> None:
        self.arrays: dict[int, dict[str, list]] = {}

    def begin(self, k: int, env: Any, obs: Mapping[str, np.ndarray], info: Mapping[str, Any]) -> None:
        self.arrays[k] = {
            "states": [obs["state"]],
            "images": [obs["image"]],
            "actions": [],
            "flags": [],
            "chunk_steps": [],
        }

    def step(self, k: int, env: Any, step: Step) -> None:
        arrays = self.arrays[k]
        arrays["states"].append(step.next_obs["state"])
        arrays["images"].append(step.next_obs["image"])
        arrays["actions"].append(step.executed)
        arrays["flags"].append(step.by_expert)
        arrays["chunk_steps"].append(step.chunk_index)

    def episode(self, k: int, outcome: Outcome, group: int) -> Episode:
        """Episode k's arrays, with its outcome, as an `Episode` (handed over: the recorder forgets them)."""
        arrays = self.arrays.pop(k)
        return Episode(
            seed=outcome.seed,
            group=group,
            instruction=outcome.instruction,
            states=np.stack(arrays["states"]).astype(np.float32),
            images=np.stack(arrays["images"]),
            actions=np.stack(arrays["actions"]).astype(np.float32),
            is_intervention=np.array(arrays["flags"], dtype=bool),
            chunk_step=np.array(arrays["chunk_steps"], dtype=np.int64),
            success=outcome.success,
            terminated=outcome.terminated,
            interventions=outcome.interventions,
        )


def rollouts(
    policy: VLAPolicy,
    envs: Sequence[Any],
    expert: Expert,
    seeds: Sequence[int],
    groups: Sequence[int],
    takeover: TakeoverRule | None,
    generator: torch.Generator,
    std_scale: float = 1.0,
) -> list[Episode]:
    """One episode per seed on envs[0..len(seeds)-1] in lockstep, supervised by the expert by the
    `takeover` rule (None: never); the policy samples its chunks with `generator` from its distribution
    with the std times `std_scale`, so a seeded generator and seeded resets repeat the rollouts exactly."""
    arrays = EpisodeArrays()
    with evaluating(policy):
        outcomes = run_episodes(
            envs,
            seeds,
            SampledChunks(policy, generator, std_scale),
            expert=expert,
            takeover=takeover,
            recorders=[arrays],
        )
    return [
        arrays.episode(k, outcome, int(group))
        for k, (outcome, group) in enumerate(zip(outcomes, groups, strict=True))
    ]


class GroupSeeds:
    """The reset seed and group id of every group of an iteration's waves.

    Without a sampler, fresh seeds: iteration `step` takes the block of `block` seeds from
    first_seed + step * block, and a group's seed is its id. With one (rollout.task_variants), the
    seeds are the pool first_seed + v of task variants v = 0 .. num_items - 1: the sampler draws each
    wave's variants and `feed` gives it each group's successes, so beta_thompson steers towards the
    variants solved about half the time and the groups dynamic_filter drops are collected in
    `dropped`. Group ids stay the block's, unique in the iteration even where a variant repeats.
    """

    def __init__(
        self, first_seed: int, group_size: int, per_wave: int, block: int, sampler: Sampler | None = None
    ) -> None:
        self.first_seed, self.group_size, self.per_wave, self.block = first_seed, group_size, per_wave, block
        self.sampler = sampler
        self.variant_of: dict[int, int] = {}  # group id -> task variant, this iteration
        self.dropped: set[int] = set()  # group ids the sampler dropped, this iteration
        self.step = 0

    def start(self, step: int) -> None:
        """A new iteration."""
        self.step = step
        self.variant_of.clear()
        self.dropped.clear()

    def wave(self, wave: int) -> tuple[list[int], list[int]]:
        """(reset seeds, group ids) of the wave's groups."""
        first = self.first_seed + self.step * self.block + wave * self.per_wave
        groups = list(range(first, first + self.per_wave))
        if self.sampler is None:
            return groups, groups
        variants = self.sampler.sample(self.per_wave)
        self.variant_of.update(zip(groups, variants, strict=True))
        return [self.first_seed + v for v in variants], groups

    def feed(self, episodes: Sequence[Episode]) -> None:
        """Give the sampler each group's successes (rewards = success, group ids = the group's place
        in the wave); a no-op with fresh seeds."""
        if self.sampler is None:
            return
        groups = list(dict.fromkeys(e.group for e in episodes))
        keep = self.sampler.update(
            [self.variant_of[g] for g in groups],
            torch.tensor([float(e.success) for e in episodes]),
            torch.tensor([groups.index(e.group) for e in episodes]),
        )
        self.dropped.update(g for g, kept in zip(groups, keep.tolist(), strict=True) if not kept)


def add_to_buffer(buffer: ReplayBuffer, episode: Episode) -> int:
    """Store an episode (split by the buffer into policy and intervention segments); return its id."""
    return buffer.add_episode(
        {STATE_KEY: episode.states, IMAGE_KEY: episode.images},
        episode.actions,
        episode.success,
        episode.instruction,
        is_intervention=episode.is_intervention,
        terminated=episode.terminated,
        chunk_step=episode.chunk_step,
    )


@dataclass
class Transitions:
    """Every policy and intervention transition in the buffer as flat rows, the steps of a segment in
    consecutive rows (so row r + k is step t + k of the same segment while k < seg_left[r]). Images
    stay in their segments and are gathered per minibatch."""

    segments: list[Segment]
    seg: Tensor  # (N,) index into segments
    t: Tensor  # (N,) step within its segment
    state: Tensor  # (N, S) s_t
    next_state: Tensor  # (N, S) s_{t+1}
    action: Tensor  # (N, A)
    intervention: Tensor  # (N,) bool: the expert executed this step
    chunk_step: Tensor  # (N,) a policy step's index in its sampled chunk (0: sampled here); -1: expert
    seg_left: Tensor  # (N,) steps left in the segment, this one included (1 at its last step)
    steps_left: Tensor  # (N,) steps left in the episode, this one included
    seg_ends_episode: Tensor  # (N,) bool: the segment's last step is the episode's last
    success: Tensor  # (N,) bool: the episode's outcome
    terminated: Tensor  # (N,) bool: this step ended the episode by termination (no bootstrap from s')

    def __len__(self) -> int:
        return len(self.t)

    @property
    def last(self) -> Tensor:
        """(N,) bool: the last step of its segment."""
        return self.seg_left == 1

    @classmethod
    def from_buffer(cls, buffer: ReplayBuffer, episode_length: dict[int, int]) -> Transitions:
        """Rows of the buffer's policy and intervention segments; `episode_length` (episode id ->
        steps) tells a segment that ends with its episode from one that ends in a hand-over."""
        segments = [s for kind in KINDS[:2] for s in buffer.segments[kind]]
        parts: dict[str, list[np.ndarray]] = {
            k: [] for k in ("seg", "t", "left", "to_end", "ends", "succ", "term")
        }
        for i, s in enumerate(segments):
            t = np.arange(s.length)
            end = s.start + s.length == episode_length[s.episode]
            parts["seg"].append(np.full(s.length, i))
            parts["t"].append(t)
            parts["left"].append(s.length - t)
            parts["to_end"].append(episode_length[s.episode] - s.start - t)
            parts["ends"].append(np.full(s.length, end))
            parts["succ"].append(np.full(s.length, s.outcome))
            parts["term"].append((t == s.length - 1) & s.done)
        if not segments:
            raise ValueError("the replay buffer holds no policy or intervention transitions yet")
        cat = {k: torch.from_numpy(np.concatenate(v)) for k, v in parts.items()}
        return cls(
            segments=segments,
            seg=cat["seg"].long(),
            t=cat["t"].long(),
            state=torch.from_numpy(np.concatenate([s.obs[STATE_KEY][:-1] for s in segments])).float(),
            next_state=torch.from_numpy(np.concatenate([s.obs[STATE_KEY][1:] for s in segments])).float(),
            action=torch.from_numpy(np.concatenate([s.action for s in segments])).float(),
            intervention=torch.from_numpy(np.concatenate([s.is_intervention for s in segments])),
            chunk_step=torch.from_numpy(np.concatenate([s.chunk_step for s in segments])).long(),
            seg_left=cat["left"].long(),
            steps_left=cat["to_end"].long(),
            seg_ends_episode=cat["ends"].bool(),
            success=cat["succ"].bool(),
            terminated=cat["term"].bool(),
        )

    @property
    def actor_rows(self) -> Tensor:
        """Rows an actor can learn from as chunk targets: every expert step (the expert's action is a
        function of its own state, so steps t.. of a segment are what it does from s_t) and the policy
        steps where a chunk was sampled. A policy step inside a chunk was decided at an earlier state,
        so it is not a sample of the policy at its own state; training on it as if it were pulls the
        policy toward stale open-loop actions (docs/results.md, Why the robot recipes are set as they are)."""
        return torch.nonzero(self.intervention | (self.chunk_step == 0)).flatten()

    def chunk_rows(self, rows: Tensor, horizon: int, executed: bool = True) -> tuple[Tensor, Tensor]:
        """Rows of steps t .. t+horizon-1 of each row's segment (B, horizon), clamped inside the
        segment, and the mask of the target steps (B, horizon): those that exist and, from a policy
        step when `executed`, those executed from the same sampled chunk (pass False when the targets
        are relabelled by the expert, a function of each step's own state)."""
        offsets = torch.arange(horizon)
        mask = offsets[None, :] < self.seg_left[rows, None]
        chunk = rows[:, None] + torch.minimum(offsets[None, :], self.seg_left[rows, None] - 1)
        if not executed:
            return chunk, mask
        start = self.chunk_step[rows, None]
        same_chunk = self.chunk_step[chunk] == start + offsets[None, :]
        mask &= (start < 0) | same_chunk
        return chunk, mask

    def policy_inputs(self, policy: VLAPolicy, rows: Tensor) -> dict[str, Tensor]:
        """The policy's batch (image, proprio, instruction tokens) for the observations s_t of `rows`."""
        segs, steps = self.seg[rows].tolist(), self.t[rows].tolist()
        obs = {
            "image": np.stack([self.segments[i].obs[IMAGE_KEY][t] for i, t in zip(segs, steps, strict=True)]),
            "state": self.state[rows].numpy(),
        }
        return policy.prepare(obs, [self.segments[i].task for i in segs])
