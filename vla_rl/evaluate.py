"""Success rate of VLA policies over seeded episodes of a sim task, with a Wilson 95% interval.

Episode k is reset with seed `seed + k`, so a number is reproducible and two policies are compared on
the same episodes. Environments run in lockstep in batches of `num_envs` (one batched policy call per
step); they are made with obs_mode "rgb", so the policy sees the camera image and proprioception only.

A policy may be ours (`VLAPolicy`) or a LeRobot policy (`vla_rl.lerobot_policy`). Where the task's
scripted expert names failure modes (`Expert.failure`: PickPlace's, and the Meta-World tasks that carry
an object), each failed episode is classified from the privileged states it visited. `mmrl eval vla`
(`vla_rl.policy_comparison`) runs several policies side by side on these episodes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from vla_rl.episodes import (
    Outcome,
    PolicyActs,
    Progress,
    Recorder,
    Step,
    evaluating,
    expert_errors,
    run_episodes,
    task_name,
)
from vla_rl.lerobot_policy import LeRobotPolicy
from vla_rl.policy import VLAPolicy
from vla_rl.supervisor import TakeoverRule, action_gap

if TYPE_CHECKING:
    from sim.experts import Expert

VIDEO_FPS = 10  # the sim's control rate
EXPERT_BORDER = (220, 30, 30)  # GIF frames that follow an expert action get a red border
TASK_HELP = (  # the task option of every vla config
    "sim task: Reach, Push or PickPlace (or its id, e.g. mmrl/PickPlace-v0), or the gymnasium id of an "
    "external task: FetchReach-v4 (gymnasium-robotics: pip install 'mmrl[fetch]'), a Meta-World task "
    "metaworld/<task> (e.g. metaworld/pick-place-v3) or suite metaworld/MT10 (docs/robot.md: Meta-World), "
    "or one registered with sim.register_task by a module loaded with --plugin MODULE"
)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion: honest near 0% and 100%, unlike the normal one."""
    if n <= 0:
        raise ValueError(f"n = {n}; a success rate needs at least one episode")
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class Episodes:
    """Per-episode outcomes of `evaluate_episodes`, indexed by episode (reset seed = seed + index)."""

    seeds: list[int]
    success: np.ndarray  # (episodes,) bool
    steps: np.ndarray  # (episodes,) int: actions executed until termination or time limit
    interventions: np.ndarray  # (episodes,) int: policy-to-expert takeovers
    expert_steps: np.ndarray  # (episodes,) int: actions the expert executed
    videos: dict[int, tuple[list[np.ndarray], list[bool]]] = field(default_factory=dict)
    # episode -> (frames, whether the expert chose the action that led to each frame)
    failures: dict[int, str] = field(default_factory=dict)  # failed episode -> how, where the task says
    expert_gaps: dict[int, float] = field(default_factory=dict)  # episode -> ExpertGaps.largest, if asked


class FailureModes(Recorder):
    """How each failed episode failed, named by the task's expert (`Expert.failure`) from the
    privileged states the episode visited."""

    def __init__(self, expert: Expert) -> None:
        self.expert = expert
        self.states: dict[int, list[np.ndarray]] = {}
        self.tasks: dict[int, str] = {}
        self.failures: dict[int, str] = {}

    def begin(self, k: int, env: Any, obs: Any, info: Any) -> None:
        self.states[k] = [env.get_wrapper_attr("get_state")()]
        self.tasks[k] = task_name(env)

    def step(self, k: int, env: Any, step: Step) -> None:
        self.states[k].append(env.get_wrapper_attr("get_state")())

    def end(self, k: int, outcome: Outcome) -> None:
        states = np.stack(self.states.pop(k))
        if outcome.success:
            return
        moment = f"in failure(), naming how the episode reset with seed {outcome.seed} failed"
        with expert_errors(self.expert, self.tasks.pop(k), moment):
            how = self.expert.failure(states)
        if how is not None:
            self.failures[k] = how


class ExpertGaps(Recorder):
    """Per episode, the largest mean RMS gap between the policy's actions and the scripted expert's over
    `window` consecutive policy steps: what the training take-over rule (`intervention.window`,
    `intervention.threshold`) compares. Split by outcome, it shows which thresholds fire in every failed
    episode and in no successful one. As in the rule, expert-driven steps are left out and the window
    starts afresh after them; an episode with no `window` consecutive policy steps has no value."""

    def __init__(self, expert: Expert, window: int) -> None:
        self.expert, self.window = expert, window
        self.largest: dict[int, float] = {}
        self._gaps: dict[int, deque[float]] = {}
        self._expert_action: dict[int, np.ndarray] = {}  # the expert's action at the episode's state now
        self._steps: dict[int, int] = {}  # steps taken in each episode

    def begin(self, k: int, env: Any, obs: Any, info: Any) -> None:
        self._gaps[k] = deque(maxlen=self.window)
        self._steps[k] = 0
        self._expert_action[k] = self._act(k, env)

    def _act(self, k: int, env: Any) -> np.ndarray:
        """The expert's action at the episode's state now, or TrainingStopped naming the expert."""
        moment = f"at step {self._steps[k]} of evaluation episode {k} (measuring gap_window)"
        with expert_errors(self.expert, task_name(env), moment):
            return self.expert.act(env)

    def step(self, k: int, env: Any, step: Step) -> None:
        gaps = self._gaps[k]
        if step.by_expert:
            gaps.clear()
        else:
            gaps.append(action_gap(step.action, self._expert_action[k]))
            if len(gaps) == self.window:
                self.largest[k] = max(self.largest.get(k, 0.0), float(np.mean(gaps)))
        self._steps[k] += 1
        self._expert_action[k] = self._act(k, env)

    def end(self, k: int, outcome: Outcome) -> None:
        del self._gaps[k], self._expert_action[k], self._steps[k]


class VideoFrames(Recorder):
    """Front-camera frames of the first `count` episodes: the reset frame, then one per step, each with
    whether the expert chose the action that led to it."""

    def __init__(self, count: int, size: int) -> None:
        self.count, self.size = count, size
        self.videos: dict[int, tuple[list[np.ndarray], list[bool]]] = {}
        self.cameras: dict[int, Any] = {}  # id(env) -> its CameraRenderer

    def begin(self, k: int, env: Any, obs: Any, info: Any) -> None:
        self._frame(k, env, False)

    def step(self, k: int, env: Any, step: Step) -> None:
        self._frame(k, env, step.by_expert)

    def _frame(self, k: int, env: Any, by_expert: bool) -> None:
        if k >= self.count:
            return
        from sim.env import ArmEnv
        from sim.render import CameraRenderer

        frames, flags = self.videos.setdefault(k, ([], []))
        if isinstance(env.unwrapped, ArmEnv):
            if id(env) not in self.cameras:
                self.cameras[id(env)] = CameraRenderer(env.unwrapped.model, "front", self.size, self.size)
            frames.append(self.cameras[id(env)].render(env.unwrapped.data).copy())
        else:  # an external task has no "front" camera: its own render, the policy's view
            frames.append(np.asarray(env.render()).copy())
        flags.append(by_expert)

    def close(self) -> None:
        for camera in self.cameras.values():
            camera.close()


def evaluate_episodes(
    policy: VLAPolicy | LeRobotPolicy,
    task: str,
    episodes: int,
    seed: int,
    *,
    num_envs: int = 8,
    deterministic: bool = True,
    progress: bool = True,
    takeover: TakeoverRule | None = None,
    videos: int = 0,
    video_size: int = 128,
    gap_window: int = 0,
) -> Episodes:
    """Roll out `policy` for `episodes` episodes (reset seeds seed, seed+1, ...), optionally supervised
    by the scripted expert (`takeover`), recording front-camera frames of the first `videos` episodes
    and, where the task's expert names failure modes, how each failed episode failed; with `gap_window`
    > 0, each episode's largest mean gap to the expert over that many policy steps (`ExpertGaps`).

    Sampling (deterministic=False) draws from a generator seeded with `seed`, so a run is repeatable.
    """
    import sim  # the robot extra: only rollouts need it
    from sim import expert_for

    try:
        expert = expert_for(task)
    except TypeError:  # an external task registered without an expert: no failure modes
        if takeover is not None or gap_window:  # nor take-overs or gaps: the error names the fix
            raise
        expert = None

    envs = [
        sim.make(task, obs_mode="rgb", image_size=policy.config.image_size)
        for _ in range(min(num_envs, episodes))
    ]
    controller = PolicyActs(policy, deterministic, torch.Generator().manual_seed(seed))
    frames = VideoFrames(videos, video_size)
    failures = [FailureModes(expert)] if expert is not None else []
    gaps = [ExpertGaps(expert, gap_window)] if gap_window else []
    bar = tqdm(total=episodes, desc=f"eval {task}", disable=not progress, dynamic_ncols=True, leave=False)
    try:
        with evaluating(policy):
            outcomes = run_episodes(
                envs,
                [seed + k for k in range(episodes)],
                controller,
                expert=expert if takeover is not None else None,
                takeover=takeover,
                recorders=[frames, Progress(bar), *failures, *gaps],
            )
    finally:
        bar.close()
        frames.close()
        for env in envs:
            env.close()
    return Episodes(
        seeds=[o.seed for o in outcomes],
        success=np.array([o.success for o in outcomes], dtype=bool),
        steps=np.array([o.steps for o in outcomes], dtype=np.int64),
        interventions=np.array([o.interventions for o in outcomes], dtype=np.int64),
        expert_steps=np.array([o.expert_steps for o in outcomes], dtype=np.int64),
        videos=frames.videos,
        failures=failures[0].failures if failures else {},
        expert_gaps=gaps[0].largest if gaps else {},
    )


def evaluate_policy(
    policy: VLAPolicy | LeRobotPolicy,
    task: str,
    episodes: int,
    seed: int,
    *,
    num_envs: int = 8,
    deterministic: bool = True,
    progress: bool = True,
) -> dict[str, float]:
    """Roll out `policy` for `episodes` episodes (reset seeds seed, seed+1, ...) and return
    success_rate with its Wilson 95% interval (success_ci_low, success_ci_high), episodes and
    mean_steps."""
    result = evaluate_episodes(
        policy, task, episodes, seed, num_envs=num_envs, deterministic=deterministic, progress=progress
    )
    low, high = wilson_interval(int(result.success.sum()), episodes)
    return {
        "success_rate": float(result.success.mean()),
        "success_ci_low": low,
        "success_ci_high": high,
        "episodes": float(episodes),
        "mean_steps": float(result.steps.mean()),
    }


def write_gif(frames: list[np.ndarray], by_expert: list[bool], path: Path) -> None:
    """An animated GIF at the control rate; frames reached by an expert action get a red border."""
    from PIL import Image

    images = []
    for frame, expert in zip(frames, by_expert, strict=True):
        if expert:
            frame = frame.copy()
            for edge in (frame[:3], frame[-3:], frame[:, :3], frame[:, -3:]):
                edge[...] = EXPERT_BORDER
        images.append(Image.fromarray(frame))
    path.parent.mkdir(parents=True, exist_ok=True)
    images[0].save(
        path,
        save_all=True,
        append_images=images[1:],
        duration=round(1000 / VIDEO_FPS),
        loop=0,
        optimize=False,
    )
