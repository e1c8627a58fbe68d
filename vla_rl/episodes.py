"""The robot's episode loop: recording demonstrations, online training and evaluation all run through
`run_episodes`.

One episode per reset seed, in waves of len(envs) environments stepped in lockstep. Every step:

1. The controller proposes the next action of each row the policy drives: `PolicyActs` calls
   `policy.act` (a VLAPolicy or a LeRobot policy: evaluation), `SampledChunks` samples action chunks
   from the policy's distribution itself, so that every action's index in its chunk is known (training:
   GRPO needs the chunk starts, and a take-over drops the rest of a chunk). Without a controller the
   scripted expert drives every step (demonstrations).
2. A `TakeoverRule` (vla_rl.supervisor), if given, compares the proposal with the scripted expert's
   action at the same privileged state and may hand the row to the expert; when the expert hands back,
   the controller drops what is left of the row's chunk.
3. With `action_noise` > 0 the env executes the chosen action plus Gaussian noise (clipped to the
   action space); recorders see both, so a dataset keeps the clean action as its label (DART).
4. Every `Recorder` sees each reset, step and outcome: dataset frames (vla_rl.recording), GIF frames
   (vla_rl.evaluate), the training arrays of an `Episode` (vla_rl.online).

Random draws come in a fixed order, so seeded runs repeat: env resets with each episode's seed at the
start of its wave; once per lockstep step, the controller's generator for the rows it samples; the
noise generator of each episode (seeded with its reset seed) once per step of that episode.

What the user's code gives the loop is checked: an env observation its adapter refuses
(`sim.adapters.ObservationError`: NaN, a frame that is not an image) and a scripted expert that raises
or returns a non-finite action stop the run (`mmrl.run_stops.TrainingStopped`) with one line naming the
env or expert, the task and the step. Runs check the first observation and the expert's first action
in their setup (`check_first_observation`), so that a fault there is refused before anything is written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from mmrl.config import ConfigError
from mmrl.run_stops import TrainingStopped
from vla_rl.supervisor import Supervisor, TakeoverRule

if TYPE_CHECKING:
    import gymnasium as gym
    from tqdm import tqdm

    from sim.experts import Expert
    from vla_rl.lerobot_policy import LeRobotPolicy
    from vla_rl.policy import VLAPolicy

Obs = Mapping[str, np.ndarray]


class Controller:
    """Proposes the actions of the rows the policy drives. Subclasses override `propose` and, if they
    keep chunks, the other methods."""

    def start(self, size: int) -> None:
        """A new wave of `size` episodes."""

    def propose(self, obs: Sequence[Obs], instructions: Sequence[str], rows: Sequence[int]) -> np.ndarray:
        """(size, action_dim): the next action of each row in `rows` (other rows may hold anything), from
        every row's latest observation."""
        raise NotImplementedError

    def executed(self, j: int) -> int:
        """Row j executes its proposal now; returns the action's index in its sampled chunk (-1: not
        known)."""
        return -1

    def hand_back(self, j: int) -> None:
        """The expert drove row j until now: its next proposal starts a fresh chunk."""


class PolicyActs(Controller):
    """`policy.act` on every row of the wave at every step, finished and expert-driven rows included:
    `act` keeps one chunk queue per row of a fixed batch, so it must see the whole batch each call."""

    def __init__(
        self,
        policy: VLAPolicy | LeRobotPolicy,
        deterministic: bool = True,
        generator: torch.Generator | None = None,
    ) -> None:
        self.policy, self.deterministic, self.generator = policy, deterministic, generator

    def start(self, size: int) -> None:
        self.policy.reset()

    def propose(self, obs: Sequence[Obs], instructions: Sequence[str], rows: Sequence[int]) -> np.ndarray:
        batch = {key: np.stack([o[key] for o in obs]) for key in obs[0]}
        return self.policy.act(
            batch, list(instructions), deterministic=self.deterministic, generator=self.generator
        )

    def hand_back(self, j: int) -> None:
        self.policy.reset([j])


class SampledChunks(Controller):
    """Chunks sampled by the policy's `sample_chunks` (a VLAPolicy from its distribution, its std times
    `std_scale`; a flow-matching LeRobot policy from noise), with `generator`, for the rows that need
    one (as `act` does, executing the first `n_action_steps` actions of each), so that every executed
    action's index in its chunk is known."""

    def __init__(
        self, policy: VLAPolicy | LeRobotPolicy, generator: torch.Generator, std_scale: float = 1.0
    ) -> None:
        self.policy, self.generator, self.std_scale = policy, generator, std_scale
        self.n_exec = policy.config.n_action_steps

    def start(self, size: int) -> None:
        cfg = self.policy.config
        self.queue = np.zeros((size, cfg.horizon, cfg.action_dim), np.float32)
        self.cursor = np.full(size, self.n_exec, dtype=np.int64)  # n_exec: the next step samples a chunk

    def propose(self, obs: Sequence[Obs], instructions: Sequence[str], rows: Sequence[int]) -> np.ndarray:
        need = [j for j in rows if self.cursor[j] >= self.n_exec]
        if need:
            batch = {key: np.stack([obs[j][key] for j in need]) for key in ("state", "image")}
            tasks = [instructions[j] for j in need]
            self.queue[need] = self.policy.sample_chunks(batch, tasks, self.generator, self.std_scale)
            self.cursor[need] = 0
        actions = np.zeros((len(self.cursor), self.queue.shape[-1]), np.float32)
        actions[rows] = self.queue[rows, self.cursor[rows]]
        return actions

    def executed(self, j: int) -> int:
        self.cursor[j] += 1
        return int(self.cursor[j] - 1)

    def hand_back(self, j: int) -> None:
        self.cursor[j] = self.n_exec


@dataclass
class Step:
    """One env step of one episode, as recorders see it."""

    obs: Obs  # the observation the action was chosen at
    action: np.ndarray  # the chosen action (a dataset's label)
    executed: np.ndarray  # what the env executed: the chosen action, plus the action noise if any
    by_expert: bool  # the scripted expert chose it
    chunk_index: int  # a policy action's index in its sampled chunk; -1 for the expert or when not known
    next_obs: Obs


@dataclass
class Outcome:
    """How one episode went."""

    seed: int
    instruction: str
    success: bool
    terminated: bool  # ended by termination (success or unstable sim) rather than the time limit
    steps: int
    expert_steps: int  # steps the expert drove
    interventions: int  # take-overs


class Recorder:
    """Sees every episode's reset, steps and outcome (k: the episode's index in the seeds)."""

    def begin(self, k: int, env: gym.Env, obs: Obs, info: Mapping[str, Any]) -> None:
        """Episode k was reset in `env`."""

    def step(self, k: int, env: gym.Env, step: Step) -> None:
        """Episode k took `step`."""

    def end(self, k: int, outcome: Outcome) -> None:
        """Episode k ended."""


class Progress(Recorder):
    """Advances a progress bar by one per finished episode."""

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar

    def end(self, k: int, outcome: Outcome) -> None:
        self.bar.update(1)


def task_name(env: gym.Env) -> str:
    """The env's gymnasium id (the task's name in configs), or its class's name."""
    spec = getattr(env, "spec", None)
    return spec.id if spec is not None else type(getattr(env, "unwrapped", env)).__name__


def when(seed: int, steps: int) -> str:
    """Where in an episode something happened, as the env adapters say it."""
    if steps == 0:
        return f"at reset (seed {seed})"
    return f"at step {steps} of the episode reset with seed {seed}"


def _expert_name(expert: Expert) -> str:
    cls = type(expert)
    return f"{cls.__module__}.{cls.__qualname__}"


@contextlib.contextmanager
def expert_errors(expert: Expert, task: str, moment: str) -> Iterator[None]:
    """Re-raise what the scripted expert's code raises as TrainingStopped, one line naming the expert,
    the task, the exception and `moment` (e.g. `when(seed, steps)`)."""
    try:
        yield
    except Exception as err:  # the expert is the user's code: it may raise anything
        reason = " ".join(f"{type(err).__name__}: {err}".split())
        raise TrainingStopped(
            f"the scripted expert {_expert_name(expert)} of task {task} raised {reason} {moment}: fix the "
            "expert (the class given to sim.register_task(..., expert=...))"
        ) from err


def expert_action(expert: Expert, task: str, moment: str, act: Callable[..., Any], *args: Any) -> np.ndarray:
    """`act(*args)` (`expert` or one of its methods) as a float32 action, or TrainingStopped naming the
    expert, the task and `moment` if it raises or returns a non-finite action."""
    with expert_errors(expert, task, moment):
        action = np.asarray(act(*args), dtype=np.float32)
    if not np.isfinite(action).all():
        raise TrainingStopped(
            f"the scripted expert {_expert_name(expert)} of task {task} returned the non-finite action "
            f"{np.round(action, 4).tolist()} {moment}: fix the expert (the class given to "
            "sim.register_task(..., expert=...))"
        )
    return action


@contextlib.contextmanager
def env_faults() -> Iterator[None]:
    """An observation an env's adapter refuses (`sim.adapters.ObservationError`, whose message names the
    env, the key and the step) stops the run: TrainingStopped with that message."""
    from sim.adapters import ObservationError

    try:
        yield
    except ObservationError as err:
        raise TrainingStopped(str(err)) from None


def check_first_observation(env: gym.Env, seed: int, key: str, expert: Expert | None = None) -> None:
    """Reset `env` with `seed` and refuse, as a ConfigError naming config `key` (the one that names
    the task), a first observation its adapter refuses (`sim.adapters.ObservationError`), a camera that
    cannot render (`sim.render.RenderingError`) or, with `expert`, a first state the scripted expert
    fails on. Runs call it in their setup, before anything is written; every episode resets with its
    own seed, so the extra reset changes nothing in the run."""
    from sim.adapters import ObservationError
    from sim.render import RenderingError

    task = task_name(env)
    try:
        env.reset(seed=seed)
        if expert is not None:
            expert_action(expert, task, when(seed, 0), expert.act, env)
    except (ObservationError, RenderingError, TrainingStopped) as err:
        raise ConfigError(f"config error: {key} = {task!r}: {err}") from None


def make_env(task: str, key: str, **kwargs: Any) -> gym.Env:
    """`sim.make(task, **kwargs)`, or a ConfigError naming config `key` that says why the task's env
    cannot be made (e.g. an external task's state parts that do not fit its observations)."""
    import sim

    try:
        return sim.make(task, **kwargs)
    except (ValueError, ImportError) as err:
        raise ConfigError(f"config error: {key} = {task!r}: {err}") from None


@contextlib.contextmanager
def evaluating(policy: nn.Module) -> Iterator[None]:
    """The policy in eval mode (no dropout) while it acts, then back in the mode it was in."""
    was_training = policy.training
    policy.eval()
    try:
        yield
    finally:
        policy.train(was_training)


@torch.no_grad()
def run_episodes(
    envs: Sequence[gym.Env],
    seeds: Sequence[int],
    controller: Controller | None,
    *,
    expert: Expert | None = None,
    takeover: TakeoverRule | None = None,
    action_noise: float = 0.0,
    recorders: Sequence[Recorder] = (),
) -> list[Outcome]:
    """One episode per reset seed, in waves of len(envs) episodes in lockstep (module docstring). The
    `expert` drives every step without a controller and takes over by the `takeover` rule."""
    if controller is None and takeover is not None:
        raise ValueError("a take-over rule needs a controller: without one the expert drives every step")
    if expert is None and (controller is None or takeover is not None):
        raise ValueError(
            "the scripted expert drives without a controller or under a take-over rule: pass expert"
        )
    supervisor = Supervisor(takeover, len(envs)) if takeover is not None else None
    outcomes: list[Outcome] = []
    for first in range(0, len(seeds), len(envs)):
        wave = [int(seed) for seed in seeds[first : first + len(envs)]]
        with env_faults():
            outcomes += _run_wave(
                envs[: len(wave)], wave, first, controller, expert, supervisor, action_noise, recorders
            )
    return outcomes


def _run_wave(
    envs: Sequence[gym.Env],
    seeds: list[int],
    first: int,
    controller: Controller | None,
    expert: Expert | None,
    supervisor: Supervisor | None,
    action_noise: float,
    recorders: Sequence[Recorder],
) -> list[Outcome]:
    """Episodes first, first+1, ... (reset seeds `seeds`) on envs[0], envs[1], ... until all ended."""
    n = len(seeds)
    obs: list[Obs] = []
    instructions: list[str] = []
    for j, (env, seed) in enumerate(zip(envs, seeds, strict=True)):
        first_obs, info = env.reset(seed=seed)
        obs.append(first_obs)
        instructions.append(info["instruction"])
        if supervisor is not None:
            supervisor.reset(j)
        for recorder in recorders:
            recorder.begin(first + j, env, first_obs, info)
    noise = [np.random.default_rng(seed) for seed in seeds]
    if controller is not None:
        controller.start(n)
    steps, expert_steps = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    outcomes: list[Outcome | None] = [None] * n
    while any(outcome is None for outcome in outcomes):
        rows = [j for j in range(n) if outcomes[j] is None]
        proposed, policy_rows = None, []
        if controller is not None:  # every step, whoever drives: `policy.act` moves all rows' queues at once
            policy_rows = [j for j in rows if supervisor is None or not supervisor.expert_drives(j)]
            proposed = controller.propose(obs, instructions, policy_rows)
        for j in rows:
            env = envs[j]
            by_expert, expert_chose, chunk_index = j not in policy_rows, None, -1
            task, moment = task_name(env), when(seeds[j], int(steps[j]))
            if not by_expert and supervisor is not None:  # the supervisor looks before the policy acts
                state = env.get_wrapper_attr("get_state")()
                expert_chose = expert_action(expert, task, moment, expert, state)
                with expert_errors(expert, task, moment):
                    release_fails = supervisor.rule.release_guard and expert.release_fails(state)
                by_expert = supervisor.before_policy_step(j, proposed[j], expert_chose, release_fails)
            if by_expert:
                if expert_chose is None:
                    expert_chose = expert_action(expert, task, moment, expert.act, env)
                action = expert_chose
                expert_steps[j] += 1
                if supervisor is not None and supervisor.after_expert_step(j):
                    controller.hand_back(j)
            else:
                action = proposed[j]
                chunk_index = controller.executed(j)
            executed = action
            if action_noise > 0:  # DART: execute a perturbed action, label the clean one
                executed = action + noise[j].normal(0.0, action_noise, np.shape(action))
                executed = np.clip(executed, env.action_space.low, env.action_space.high).astype(np.float32)
            next_obs, _, terminated, truncated, info = env.step(executed)
            steps[j] += 1
            step = Step(obs[j], action, executed, by_expert, chunk_index, next_obs)
            for recorder in recorders:
                recorder.step(first + j, env, step)
            obs[j] = next_obs
            if terminated or truncated:
                outcomes[j] = outcome = Outcome(
                    seed=seeds[j],
                    instruction=instructions[j],
                    success=bool(info["is_success"]),
                    terminated=bool(terminated),
                    steps=int(steps[j]),
                    expert_steps=int(expert_steps[j]),
                    interventions=int(supervisor.count[j]) if supervisor is not None else 0,
                )
                for recorder in recorders:
                    recorder.end(first + j, outcome)
            elif not by_expert and supervisor is not None:
                supervisor.after_policy_step(j, int(steps[j]), action, expert_chose)
    return outcomes
