"""Online data for HABC and its baselines: supervised rollouts and a flat view of the replay buffer.

Rollouts. Environments run in lockstep with obs_mode "state+rgb": the policy sees the camera image, the
instruction and proprioception (the first entries of the state), while the supervisor, the expert and
the critics may read the privileged state. The policy samples an action chunk and executes its first
`n_action_steps` actions (as `VLAPolicy.act` does) before sampling the next one; chunks are sampled
here rather than through `act` so that every chunk's start step is known (GRPO needs it) and the chunk
can be dropped the moment the expert takes over.

Intervention rule (`Supervisor`), a stand-in for a person watching the robot: after every policy step
the supervisor compares the executed action with what the scripted expert would do in the same state
(RMS difference over the 5 action entries, each in [-1, 1], the unit `mmrl eval vla` uses too). When
the mean of that gap over the last `window` policy steps exceeds `threshold` (a mean rather than
consecutive steps, because training actions are sampled and noisy), the policy has strayed from the
expert's plan, and the expert drives for `takeover_steps` steps, then hands control back (the policy
samples a fresh chunk).
The default threshold (1.0, recipes in configs/vla/) was set from the 42% BC base sampling with the
recipes' `std_scale`: it fires in every failing episode and in 15% of the successful ones (0.6 fired in
85% of them, so the expert drove most episodes the policy would have finished alone).
With `release_guard`, the supervisor also looks before each policy step: a policy about to open the
gripper where that drops what it holds away from the goal (`Expert.release_fails`) is stopped, and the
expert drives from that step. The smooth rule above reacts too late for that: one opposite gripper entry
moves the RMS gap by 0.9 and the cube falls in the next step.
Independently, if the episode has not succeeded after `deadline` steps (0: never), the expert takes
over once, for `takeover_steps` steps. At most `max_per_episode` take-overs happen per episode.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from vla_rl.buffer import KINDS, ReplayBuffer, Segment
from vla_rl.lerobot_format import IMAGE_KEY, STATE_KEY
from vla_rl.policy import VLAPolicy

if TYPE_CHECKING:
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


class Supervisor:
    """The intervention rule of the module docstring, for `n` environments at once."""

    def __init__(
        self,
        n: int,
        enabled: bool,
        window: int,
        threshold: float,
        takeover_steps: int,
        deadline: int,
        max_per_episode: int,
        release_guard: bool = False,
    ) -> None:
        self.enabled, self.window, self.threshold = enabled, window, threshold
        self.release_guard = release_guard
        self.takeover_steps, self.deadline, self.max_per_episode = takeover_steps, deadline, max_per_episode
        self.expert_steps_left = np.zeros(n, dtype=np.int64)
        self.count = np.zeros(n, dtype=np.int64)
        self.deadline_used = np.zeros(n, dtype=bool)
        self.gaps: list[deque[float]] = [deque(maxlen=window) for _ in range(n)]

    def reset(self, j: int) -> None:
        """A new episode in env j: policy in control, no take-overs counted."""
        self.expert_steps_left[j] = self.count[j] = 0
        self.deadline_used[j] = False
        self.gaps[j].clear()

    def expert_drives(self, j: int) -> bool:
        """Whether the expert is in control of env j now."""
        return bool(self.expert_steps_left[j] > 0)

    def vetoes(self, j: int, action: np.ndarray, release_fails: bool) -> bool:
        """The release guard: True (the expert takes over from this very step, before the policy's action
        runs) when the policy would open the gripper (last action entry < 0) where that loses the
        episode (`Expert.release_fails`), as a person watching would stop the arm."""
        if not (self.enabled and self.release_guard) or self.count[j] >= self.max_per_episode:
            return False
        if not (action[-1] < 0 and release_fails):
            return False
        self._take_over(j)
        return True

    def after_policy_step(
        self, j: int, steps_done: int, action: np.ndarray, expert_action: np.ndarray
    ) -> bool:
        """Record the policy's action at a state; True when the expert takes over from the next step."""
        if not self.enabled:
            return False
        gap = np.asarray(action, np.float64) - np.asarray(expert_action, np.float64)
        self.gaps[j].append(float(np.sqrt(np.mean(gap * gap))))
        if self.count[j] >= self.max_per_episode:
            return False
        strayed = len(self.gaps[j]) == self.window and float(np.mean(self.gaps[j])) > self.threshold
        late = self.deadline > 0 and steps_done >= self.deadline and not self.deadline_used[j]
        if not (strayed or late):
            return False
        self.deadline_used[j] |= late
        self._take_over(j)
        return True

    def _take_over(self, j: int) -> None:
        """Hand env j to the expert for `takeover_steps` steps; the gap window starts afresh after."""
        self.count[j] += 1
        self.expert_steps_left[j] = self.takeover_steps
        self.gaps[j].clear()

    def after_expert_step(self, j: int) -> bool:
        """Count down a take-over; True when control goes back to the policy."""
        self.expert_steps_left[j] -= 1
        return self.expert_steps_left[j] == 0


@torch.no_grad()
def run_episodes(
    policy: VLAPolicy,
    envs: Sequence[Any],
    expert: Expert,
    seeds: Sequence[int],
    groups: Sequence[int],
    supervisor: Supervisor,
    generator: torch.Generator,
    std_scale: float = 1.0,
) -> list[Episode]:
    """One episode per seed on envs[0..len(seeds)-1] in lockstep; the policy samples its chunks with
    `generator` from its distribution with the std times `std_scale`, so a seeded generator and seeded
    resets repeat the rollouts exactly."""
    n = len(seeds)
    horizon, n_exec = policy.config.horizon, policy.config.n_action_steps
    states: list[list[np.ndarray]] = [[] for _ in range(n)]
    images: list[list[np.ndarray]] = [[] for _ in range(n)]
    actions: list[list[np.ndarray]] = [[] for _ in range(n)]
    flags: list[list[bool]] = [[] for _ in range(n)]
    chunk_steps: list[list[int]] = [[] for _ in range(n)]
    instructions, outcome = [""] * n, [(False, False)] * n
    queue = np.zeros((n, horizon, policy.config.action_dim), np.float32)
    cursor = np.full(n, n_exec, dtype=np.int64)  # n_exec: the next policy step samples a new chunk
    for j, seed in enumerate(seeds):
        obs, info = envs[j].reset(seed=int(seed))
        states[j].append(obs["state"])
        images[j].append(obs["image"])
        instructions[j] = info["instruction"]
        supervisor.reset(j)
    active = np.ones(n, dtype=bool)
    guard = supervisor.enabled and supervisor.release_guard
    was_training = policy.training
    policy.eval()
    try:
        while active.any():
            rows = np.flatnonzero(active)
            need = [j for j in rows if not supervisor.expert_drives(j) and cursor[j] >= n_exec]
            if need:
                obs = {
                    "state": np.stack([states[j][-1] for j in need]),
                    "image": np.stack([images[j][-1] for j in need]),
                }
                dist = policy(policy.prepare(obs, [instructions[j] for j in need])).scaled(std_scale)
                chunk = dist.sample(generator=generator)
                queue[need] = chunk.float().cpu().numpy()
                for j in need:
                    cursor[j] = 0
            expert_actions = expert(np.stack([states[j][-1] for j in rows]))
            for j, expert_action in zip(rows, expert_actions, strict=True):
                by_expert = supervisor.expert_drives(j)
                if (  # the guard's state check runs only where the policy is about to open the gripper
                    guard
                    and not by_expert
                    and queue[j, cursor[j], -1] < 0
                    and supervisor.vetoes(j, queue[j, cursor[j]], expert.release_fails(states[j][-1]))
                ):
                    by_expert, cursor[j] = True, n_exec  # the rest of the chunk is dropped
                if by_expert:
                    action = expert_action.astype(np.float32)
                    chunk_steps[j].append(-1)
                else:
                    action = queue[j, cursor[j]].copy()
                    chunk_steps[j].append(int(cursor[j]))
                    cursor[j] += 1
                obs, _, terminated, truncated, info = envs[j].step(action)
                states[j].append(obs["state"])
                images[j].append(obs["image"])
                actions[j].append(action)
                flags[j].append(by_expert)
                if terminated or truncated:
                    active[j] = False
                    outcome[j] = (bool(info["is_success"]), bool(terminated))
                elif by_expert:
                    if supervisor.after_expert_step(j):
                        cursor[j] = n_exec
                elif supervisor.after_policy_step(j, len(actions[j]), action, expert_action):
                    cursor[j] = n_exec  # the expert drives from the next step: drop the chunk
    finally:
        policy.train(was_training)
    return [
        Episode(
            seed=int(seeds[j]),
            group=int(groups[j]),
            instruction=instructions[j],
            states=np.stack(states[j]).astype(np.float32),
            images=np.stack(images[j]),
            actions=np.stack(actions[j]).astype(np.float32),
            is_intervention=np.array(flags[j], dtype=bool),
            chunk_step=np.array(chunk_steps[j], dtype=np.int64),
            success=outcome[j][0],
            terminated=outcome[j][1],
            interventions=int(supervisor.count[j]),
        )
        for j in range(n)
    ]


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
        policy toward stale open-loop actions (it cut a 42% policy to 9% in 80 updates)."""
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
